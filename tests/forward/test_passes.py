"""The one no-grad pass in lockstep: what each rank runs, fillers to the common count, and what it returns."""

from __future__ import annotations

import pytest

from padless.forward import passes, ranks
from padless.forward.packing import budget_batches

LENGTHS = [5, 9, 3, 8, 4, 7, 6]  # 7 items, budget 12: 4 batches by best-fit decreasing


def values(items: list[int]) -> list[tuple[float, int]]:
    return [(i + 0.5, -i) for i in items]


@pytest.mark.parametrize("process, world, degree", [(1, 2, 1), (3, 4, 2)])
def test_a_shared_pass_runs_this_ranks_batches_in_lockstep_and_gathers_each_result_once(
    monkeypatch, as_rank, process, world, degree
):
    """The same items on two data-parallel ranks: rank 1 runs its round-robin share of the batches, then the
    first batch (a real planned one) as a filler up to the busiest rank's count; each item's result comes
    back once, from the rank that ran it, the filler's dropped. Of a sequence-parallel group (process 3 of
    4 with degree 2: rank 1's second) only the first gives its results; every process gets them all."""
    groups = budget_batches(LENGTHS, 12, shuffle=False)
    assert len(groups) == 4
    by_rank = [[(i, v) for g in groups[r::2] for i, v in zip(g, values(g), strict=True)] for r in (0, 1)]
    as_rank(rank=process, world=world, longest=3)
    sent: list[tuple[int, tuple[float, int]]] = []
    monkeypatch.setattr(ranks, "gather_object", lambda mine: sent.extend(mine) or by_rank[0] + by_rank[1])
    calls: list[list[int]] = []
    out = passes.lockstep_pass(
        list(range(7)),
        LENGTHS,
        lambda batch: calls.append(batch) or values(batch),
        12,
        share=ranks.start(degree),
    )
    assert calls == [groups[1], groups[3], groups[0]]  # its share, then a filler to the common count
    assert sent == (by_rank[1] if degree == 1 else [])  # not the filler's; nothing from a group's second
    assert out == values(list(range(7)))


def test_a_shared_pass_on_one_process_runs_everything_planned_batches_first():
    """Batches given (a step's micro-batches) run as they are, before those planned for the other items."""
    calls: list[list[int]] = []

    def run(batch: list[int]) -> list[tuple[float, int]]:
        calls.append(batch)
        return values(batch)

    planned = [[6, 0], [2]]
    out = passes.lockstep_pass(list(range(7)), LENGTHS, run, 12, share=ranks.start(), planned=planned)
    rest = [1, 3, 4, 5]
    own = [[rest[i] for i in g] for g in budget_batches([LENGTHS[i] for i in rest], 12, shuffle=False)]
    assert calls == planned + own and out == values(list(range(7)))
    assert passes.lockstep_pass([], [], values, 12, share=ranks.start()) == []


def test_a_rank_with_fewer_batches_repeats_its_first_and_drops_its_results(as_rank):
    """Each rank passes its own items: this one's 2 batches (an item longer than the budget alone, not
    refused), then its first batch again until the busiest rank's 4, the repeats' results dropped (each
    result names the call that made it); a rank with no items runs the filler instead."""
    as_rank(rank=0, world=2, longest=4)
    items, lengths = ["a", "b", "c"], [20, 3, 4]
    calls: list[list[str]] = []

    def run(batch: list[str]) -> list[str]:
        calls.append(batch)
        return [f"{item.upper()}{len(calls)}" for item in batch]

    out = passes.lockstep_pass(items, lengths, run, 8, filler="z")
    assert sorted(map(sorted, calls[:2])) == [["a"], ["b", "c"]] and calls[2:] == [calls[0]] * 2
    assert out == [f"{item.upper()}{1 + (item not in calls[0])}" for item in items]
    calls.clear()
    assert passes.lockstep_pass([], [], run, 8, filler="z") == [] and calls == [["z"]] * 4
