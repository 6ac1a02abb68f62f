"""Work shared between ranks: what one rank runs, and what every rank ends with."""

from __future__ import annotations

from padless.forward import ranks


def test_a_sequence_parallel_group_shares_one_slice(as_rank):
    """Processes 2 and 3 of 4 form one group at degree 2 (the topology made at run start): both get
    data-parallel rank 1's slice, and only process 2 (the group's first) counts its results."""
    items = list(range(5))
    shares = {}
    for process in range(4):
        as_rank(rank=process, world=4)
        topology = ranks.start(2)
        group = topology.sequence_parallel.group
        shares[process] = (ranks.equal_share(items, topology), topology.leads, group)
    assert shares[2] == (([3, 4, 0], 2), True, (2, 3))  # ceil(5 / 2) = 3 a slice: 2 real, 1 filler
    assert shares[3] == (([3, 4, 0], 2), False, (2, 3))
    assert shares[0] == (([0, 1, 2], 3), True, (0, 1)) and shares[1] == (([0, 1, 2], 3), False, (0, 1))
    as_rank(rank=3, world=4)
    alone = ranks.start()
    assert (alone.rank, alone.world, alone.leads, alone.degree) == (3, 4, True, 1)
    assert ranks.equal_share(items, alone) == ([0, 0], 0)  # without a group: rank 3 of 4, past the 5 items
