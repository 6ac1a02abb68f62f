"""Fixtures of the forward wing's tests."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from padless.forward import ranks, sequence_parallel


@pytest.fixture
def as_rank(monkeypatch) -> Callable[..., SimpleNamespace]:
    """``as_rank(rank, world, longest=0)`` makes this process rank ``rank`` of ``world``, the longest share
    of any rank ``longest`` (what gloo's count would give); returns the accelerate state it shows. A
    sequence-parallel group (:func:`padless.forward.ranks.start`) is then the tuple of its ranks."""

    def make(rank: int, world: int, longest: int = 0) -> SimpleNamespace:
        state = SimpleNamespace(process_index=rank, num_processes=world, device=torch.device("cpu"))
        monkeypatch.setattr(ranks, "PartialState", lambda: state)
        monkeypatch.setattr(sequence_parallel, "PartialState", lambda: state)
        monkeypatch.setattr(sequence_parallel, "_GROUPS", {})
        monkeypatch.setattr(sequence_parallel.dist, "new_group", lambda members: tuple(members))
        monkeypatch.setattr(ranks, "common_count", lambda count: max(count, longest))
        return state

    return make
