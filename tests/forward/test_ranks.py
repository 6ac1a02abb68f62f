"""Work shared between ranks: what one rank runs, and what every rank ends with."""

from __future__ import annotations

from padless.forward import ranks, sequence_parallel


def test_a_sequence_parallel_group_of_the_engines_degree_shares_one_slice(as_rank):
    """Processes 2 and 3 of 4 form one group at degree 2: both get data-parallel rank 1's slice, and only
    process 2 (the group's first) counts its results."""
    items = list(range(5))
    shares = {}
    for process in range(4):
        as_rank(rank=process, world=4)
        shares[process] = (ranks.equal_share(items, 2), sequence_parallel.leads_group(2))
    assert shares[2] == (([3, 4, 0], 2), True)  # ceil(5 / 2) = 3 a slice: 2 real, 1 filler
    assert shares[3] == (([3, 4, 0], 2), False)
    assert shares[0] == (([0, 1, 2], 3), True) and shares[1] == (([0, 1, 2], 3), False)
    as_rank(rank=3, world=4)
    assert ranks.equal_share(items, 1) == ([0, 0], 0)  # without a group: rank 3 of 4, past the 5 items
