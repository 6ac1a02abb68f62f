"""Work shared between ranks: what one rank runs, and what every rank ends with."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from padless.forward import ranks, sequence_parallel


def _as_rank(monkeypatch, rank: int, world: int, others: list[torch.Tensor], longest: int) -> ranks.Topology:
    """Make this process rank ``rank`` of ``world`` and return its topology: the other ranks' results
    arrive through the sum and the longest share through the count (what gloo would give); a
    sequence-parallel group is made of the ranks it lists."""
    state = SimpleNamespace(process_index=rank, num_processes=world, device=torch.device("cpu"))
    monkeypatch.setattr(ranks, "PartialState", lambda: state)
    monkeypatch.setattr(sequence_parallel, "PartialState", lambda: state)
    monkeypatch.setattr(sequence_parallel, "_GROUPS", {})
    monkeypatch.setattr(sequence_parallel.dist, "new_group", lambda members: tuple(members))
    monkeypatch.setattr(ranks, "common_count", lambda count: max(count, longest))
    monkeypatch.setattr(ranks, "reduce", lambda t, reduction: t + sum(others))
    return ranks.start()


def test_shared_pass_runs_this_ranks_share_in_lockstep_and_sums_once(monkeypatch):
    groups = [[0, 3], [1], [2, 5], [4], [6]]  # 5 batches on 2 ranks: rank 1 runs 2 real + 1 filler
    calls: list[list[int]] = []

    def run(group: list[int]) -> torch.Tensor:
        calls.append(group)
        return torch.tensor([[i + 0.5, -i] for i in group], dtype=torch.float32)

    from_rank0 = torch.zeros(7, 2, dtype=torch.float64)
    for g in groups[0::2]:
        from_rank0[g] = torch.tensor([[i + 0.5, -i] for i in g], dtype=torch.float64)
    topology = _as_rank(monkeypatch, rank=1, world=2, others=[from_rank0], longest=3)
    out = ranks.shared_pass(groups, run, total=7, width=2, topology=topology)
    assert calls == [[1], [4], [0, 3]]  # its share, then a filler (the first group) to the common count
    assert out.dtype == torch.float64
    assert out.tolist() == [[i + 0.5, -i] for i in range(7)]  # the filler's results were dropped


def test_shared_pass_on_one_process_runs_everything(monkeypatch):
    one = _as_rank(monkeypatch, rank=0, world=1, others=[], longest=0)
    out = ranks.shared_pass(
        [[1, 0], [2]], lambda g: torch.tensor(g, dtype=torch.float64)[:, None] * 2, 3, 1, one
    )
    assert out.flatten().tolist() == [0.0, 2.0, 4.0]
    assert ranks.shared_pass([], lambda g: torch.zeros(0, 1), 0, 1, one).shape == (0, 1)


def test_a_sequence_parallel_group_shares_one_slice(monkeypatch):
    """Processes 2 and 3 of 4 form one group at degree 2 (the topology made at run start): both get
    data-parallel rank 1's slice, and only process 2 (the group's first) counts its results."""
    items = list(range(5))
    shares = {}
    for process in range(4):
        _as_rank(monkeypatch, rank=process, world=4, others=[], longest=0)
        topology = ranks.start(2)
        group = topology.sequence_parallel.group
        shares[process] = (ranks.equal_share(items, topology), topology.leads, group)
    assert shares[2] == (([3, 4, 0], 2), True, (2, 3))  # ceil(5 / 2) = 3 a slice: 2 real, 1 filler
    assert shares[3] == (([3, 4, 0], 2), False, (2, 3))
    assert shares[0] == (([0, 1, 2], 3), True, (0, 1)) and shares[1] == (([0, 1, 2], 3), False, (0, 1))
    alone = _as_rank(monkeypatch, rank=3, world=4, others=[], longest=0)
    assert (alone.rank, alone.world, alone.leads) == (3, 4, True)
    assert ranks.equal_share(items, alone) == ([0, 0], 0)  # without a group: rank 3 of 4, past the 5 items
