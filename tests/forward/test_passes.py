"""The one no-grad pass in lockstep: what each rank runs, fillers to the common count, and what it returns."""

from __future__ import annotations

import torch

from padless.forward import passes, ranks
from padless.forward.packing import budget_batches

LENGTHS = [5, 9, 3, 8, 4, 7, 6]  # 7 items, budget 12: 4 batches by best-fit decreasing


def values(items: list[int]) -> torch.Tensor:
    return torch.tensor([[i + 0.5, -i] for i in items], dtype=torch.float32)


def test_a_shared_pass_runs_this_ranks_batches_in_lockstep_and_sums_once(monkeypatch, as_rank):
    """The same items on two ranks: rank 1 runs its round-robin share of the batches, then the first batch
    as a filler up to the busiest rank's count; each item's values come back once, in float64, the
    filler's dropped (rank 0's arrive through the sum)."""
    groups = budget_batches(LENGTHS, 12, shuffle=False)
    assert len(groups) == 4
    from_rank0 = torch.zeros(7, 2, dtype=torch.float64)
    for g in groups[0::2]:
        from_rank0[g] = values(g).double()
    state = as_rank(rank=1, world=2, longest=3)
    monkeypatch.setattr(passes, "PartialState", lambda: state)
    monkeypatch.setattr(passes, "reduce", lambda t, reduction: t + from_rank0)
    calls: list[list[int]] = []
    out = passes.lockstep_pass(
        list(range(7)), LENGTHS, lambda batch: calls.append(batch) or values(batch), 12, share=ranks.start()
    )
    assert calls == [groups[1], groups[3], groups[0]]  # its share, then a filler to the common count
    assert torch.stack(out).dtype == torch.float64
    assert torch.stack(out).tolist() == [[i + 0.5, -i] for i in range(7)]


def test_a_shared_pass_on_one_process_runs_everything():
    out = passes.lockstep_pass(list(range(7)), LENGTHS, values, 12, share=ranks.start())
    assert torch.stack(out).tolist() == [[i + 0.5, -i] for i in range(7)]
    assert passes.lockstep_pass([], [], values, 12, share=ranks.start()) == []


def test_a_rank_with_fewer_batches_repeats_the_filler_and_drops_its_results(as_rank):
    """Each rank passes its own items: this one's 2 batches (an item longer than the budget alone, not
    refused), then the filler until the busiest rank's 4; per-item results in the items' order."""
    as_rank(rank=0, world=2, longest=4)
    items, lengths = ["a", "b", "c"], [20, 3, 4]
    calls: list[list[str]] = []

    def run(batch: list[str]) -> list[str]:
        calls.append(batch)
        return [item.upper() for item in batch]

    assert passes.lockstep_pass(items, lengths, run, 8, filler="z") == ["A", "B", "C"]
    assert sorted(map(sorted, calls[:2])) == [["a"], ["b", "c"]] and calls[2:] == [["z"], ["z"]]
    calls.clear()
    assert passes.lockstep_pass([], [], run, 8, filler="z") == [] and calls == [["z"]] * 4
