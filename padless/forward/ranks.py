"""Ranks in lockstep. Sharded engines (FSDP2, ZeRO-3) gather parameters in every forward and reduce
gradients in every backward, and DDP broadcasts buffers in every forward: a rank that runs one pass fewer
than the others leaves them waiting forever. Work is shared out so every rank runs the same count of
passes, with fillers (real data whose results are dropped) where a rank's share runs out.

Which share is this process's is its :class:`Topology`, made once at run start (:func:`start`) and carried
by the engine (``EngineSettings.topology``), from which the loop and the recipes read it."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
from accelerate import PartialState
from accelerate.utils import gather, gather_object

from padless.errors import UserCodeError
from padless.forward import sequence_parallel
from padless.forward.sequence_parallel import SequenceParallel

T = TypeVar("T")


@dataclass(frozen=True)
class Topology:
    """Where this process stands among the run's processes. The W processes form W / N data-parallel
    groups of N consecutive processes (N: the sequence-parallel degree): every process of a group holds
    the same data, its group's data-parallel ``rank`` of ``world``, and splits each packed row with the
    others over ``sequence_parallel`` (None for N = 1)."""

    rank: int
    world: int
    sequence_parallel: SequenceParallel | None = None

    @property
    def degree(self) -> int:
        """The sequence-parallel degree N (1: rows run whole)."""
        return 1 if self.sequence_parallel is None else self.sequence_parallel.degree

    @property
    def leads(self) -> bool:
        """Whether this process is its group's first: the one whose results count once in sums over ranks."""
        return self.sequence_parallel is None or self.sequence_parallel.rank == 0


def start(degree: int = 1) -> Topology:
    """This process's topology for sequence parallelism of ``degree`` (``train.sequence_parallel``). Every
    process must call it (a group is made by all of them)."""
    state = PartialState()
    group = sequence_parallel.start(degree) if degree > 1 else None  # rows run whole: no group
    return Topology(state.process_index // degree, state.num_processes // degree, group)


def equal_share(items: list[T], topology: Topology) -> tuple[list[T], int]:
    """This rank's contiguous slice of ``items`` padded with fillers (copies of ``items[0]``) to the same
    length on every rank; returns the slice and how many of its items are real (they come first).
    Ranks are data-parallel ranks: the processes of a sequence-parallel group get the same slice."""
    if not items:
        raise ValueError("nothing to share out between ranks")
    size = math.ceil(len(items) / topology.world)
    mine = items[topology.rank * size : (topology.rank + 1) * size]
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


def gather_shares(items: list[T], topology: Topology) -> list[T]:
    """Every data-parallel rank's ``items`` in rank order, on every process (the processes of a
    sequence-parallel group hold the same items: their group's first gives them)."""
    if PartialState().num_processes == 1:
        return items
    return gather_object(items if topology.leads else [])


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
