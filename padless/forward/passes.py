"""A no-grad pass of the engine over many items in token-budget packed batches, every rank in lockstep:
RL's stored log-probs and values, reward-model scores, DPO's and KTO's precomputed reference log-probs.

Two ways to share the items out:

- each rank its own items (a rollout's share);
- ``share=topology``: the same items on every rank (a whole data set, a gathered rollout), the batches
  dealt out round robin between data-parallel ranks, each item's result computed by exactly one rank (the
  first of its sequence-parallel group) and gathered to every rank: every rank holds the very numbers the
  rank that ran an item computed, whatever the number of ranks.

Either way every rank runs as many batches (sharded engines gather in every forward): a rank whose batches
run out repeats the first batch, its results dropped. That filler is a real planned batch, laid out as the
others are: ZeRO-3 traces the parameters each forward uses, and a filler of another layout (one item packed
flat beside others' tree rows) makes the ranks' traces differ and the run stop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from padless.forward.engine import inner_engine, sequence_scores
from padless.forward.packing import Example, budget_batches, pack
from padless.forward.ranks import Topology, gather_shares, lockstep
from padless.forward.tree import tree_batches

T = TypeVar("T")
R = TypeVar("R")


@torch.no_grad()
def lockstep_pass(
    items: Sequence[T],
    lengths: Sequence[int],
    run: Callable[[list[T]], Sequence[R]],
    max_tokens: int,
    filler: T | None = None,
    share: Topology | None = None,
    tree: bool = False,
    planned: Sequence[Sequence[int]] = (),
) -> list[R]:
    """``run(batch)`` (one result per item of the batch) on batches of at most ``max_tokens`` tokens (an
    item longer than that alone); returns each item's result, in order.

    ``planned``: batches already planned (indices of ``items``, e.g. the micro-batches a step trains), run
    as they are; the items none of them holds are batched here, after them.
    Without ``share`` every rank passes its own items; ``filler`` (its result dropped) is what a rank with
    no items at all runs while the others run theirs.
    With ``share`` (the run's topology, which the engine carries) the items are the same on every rank and
    so are the results, gathered: give ``run`` results that travel between processes (numbers, lists; not
    tensors on a device).
    ``tree``: the items are examples that the engine runs as tree rows: batched by the tokens of their
    trees, shared prefixes side by side (:func:`padless.forward.tree.tree_batches`)."""
    held = {i for group in planned for i in group}
    rest = [i for i in range(len(items)) if i not in held]
    budget = max([max_tokens, *(lengths[i] for i in rest)])
    own = (
        tree_batches([items[i] for i in rest], budget)  # type: ignore[misc]
        if tree
        else budget_batches([lengths[i] for i in rest], budget, shuffle=False)
    )
    groups = [list(group) for group in planned] + [[rest[i] for i in group] for group in own]
    dealt = groups if share is None else groups[share.rank :: share.world]
    mine: list[tuple[int, R]] = []
    for group, real in lockstep(dealt, groups[0] if groups else None):  # the filler: a planned batch
        values = run([items[i] for i in group] if group is not None else [filler])  # type: ignore[list-item]
        if real:
            mine += zip(group, values, strict=True)
    results: list[R | None] = [None] * len(items)
    for i, value in mine if share is None else gather_shares(mine, share):  # a group's first gives them
        results[i] = value
    return results  # type: ignore[return-value]


def score_examples(
    model: torch.nn.Module, examples: Sequence[Example], max_tokens: int = 8192, filler: Example | None = None
) -> list[float]:
    """One score per example, in order, through a (prepared) scoring engine, read at each sequence's last
    token (:func:`~padless.forward.engine.sequence_scores`)."""
    device = next(model.parameters()).device

    def run(batch: list[Example]) -> list[float]:
        return sequence_scores(model, pack(batch, device=device)).tolist()

    tree = inner_engine(model).tree
    return lockstep_pass(examples, [len(e) for e in examples], run, max_tokens, filler, tree=tree)
