"""Ranks in lockstep. Sharded engines (FSDP2, ZeRO-3) gather parameters in every forward and reduce
gradients in every backward, and DDP broadcasts buffers in every forward: a rank that runs one pass fewer
than the others leaves them waiting forever. Work is shared out so every rank runs the same count of
passes, with fillers (real data whose results are dropped) where a rank's share runs out."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from accelerate import PartialState
from accelerate.utils import gather, gather_object

from padless.errors import UserCodeError
from padless.forward import sequence_parallel

T = TypeVar("T")


def equal_share(items: list[T], degree: int) -> tuple[list[T], int]:
    """This rank's contiguous slice of ``items`` padded with fillers (copies of ``items[0]``) to the same
    length on every rank; returns the slice and how many of its items are real (they come first).
    Ranks are data-parallel ranks: the processes of a sequence-parallel group (of ``degree``, the engine's)
    get the same slice."""
    if not items:
        raise ValueError("nothing to share out between ranks")
    rank, world = sequence_parallel.data_parallel(degree)  # a sequence-parallel group shares one slice
    size = math.ceil(len(items) / world)
    mine = items[rank * size : (rank + 1) * size]
    return mine + [items[0]] * (size - len(mine)), len(mine)


def common_count(count: int) -> int:
    """The largest ``count`` over all ranks."""
    state = PartialState()
    if state.num_processes == 1:
        return count
    return int(gather(torch.tensor([count], device=state.device)).max())


def lockstep(batches: list[T], filler: T) -> Iterator[tuple[T, bool]]:
    """``batches`` (flagged real), then ``filler`` (flagged not real) until every rank has run as many."""
    total = common_count(len(batches))
    for i in range(total):
        yield (batches[i], True) if i < len(batches) else (filler, False)


def gather_shares(items: list[T], degree: int) -> list[T]:
    """Every data-parallel rank's ``items`` in rank order, on every process (the processes of a
    sequence-parallel group hold the same items: their group's first gives them)."""
    if PartialState().num_processes == 1:
        return items
    return gather_object(items if sequence_parallel.leads_group(degree) else [])


def agreed(run: Callable[[], T], what: str) -> T:
    """``run()``, rank-local user code (reward functions), such that a failure on any rank stops every rank
    here, at the same point: the failing rank raises its own error, the others one naming it. Such errors
    carry ``every_rank = True``: the ranks are together, so they can checkpoint the trained steps before
    stopping (a rank that stopped alone would leave the others waiting in their next collective)."""
    state = PartialState()
    failed: Exception | None = None
    try:
        result = run()
    except Exception as e:
        failed = e
    if state.num_processes > 1:
        flags = gather(torch.tensor([failed is not None], device=state.device, dtype=torch.int64))
        first = next((rank for rank, flag in enumerate(flags.tolist()) if flag), None)
    else:
        first = None if failed is None else 0
    if failed is not None:
        failed.every_rank = True  # type: ignore[attr-defined]
        raise failed
    if first is not None:
        error = UserCodeError(f"{what} failed on rank {first} (its error is in that rank's output)")
        error.every_rank = True  # type: ignore[attr-defined]
        raise error
    return result
