"""A no-grad pass of the engine over many items in token-budget packed batches, every rank in lockstep:
RL's stored log-probs and values, reward-model scores, DPO's precomputed reference log-probs.

Two ways to share the items out:

- each rank its own items (a rollout's share): a rank that runs out of batches repeats a filler, whose
  results are dropped, until every rank has run as many (sharded engines gather in every forward);
- ``share=topology``: the same items on every rank (a whole data set), the batches dealt out round robin
  between data-parallel ranks, each item's result computed by exactly one rank (the first of its
  sequence-parallel group) and summed over ranks once, in float64: exact, since the others add zeros.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from accelerate import PartialState
from accelerate.utils import reduce

from padless.forward.engine import inner_engine, sequence_scores
from padless.forward.packing import Example, budget_batches, pack
from padless.forward.ranks import Topology, lockstep
from padless.forward.tree import plan_batches

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
) -> list[R]:
    """``run(batch)`` (one result per item of the batch) on batches of at most ``max_tokens`` tokens (an
    item longer than that alone); returns each item's result, in order.

    Without ``share`` every rank passes its own items and ``filler`` (its results dropped) keeps a rank
    whose batches ran out in step with the others; it is needed when a rank may have no items at all.
    With ``share`` (the run's topology, which the engine carries) the items are the same on every rank and
    the results, tensors of one shape, come back summed over ranks (float64; see the module docstring).
    ``tree``: the items are examples that the engine runs as tree rows: batched by the tokens of their
    trees, shared prefixes side by side (:func:`padless.forward.tree.tree_batches`)."""
    budget = max([max_tokens, *lengths])
    groups = plan_batches(items, budget, tree) if tree else budget_batches(lengths, budget, shuffle=False)
    groups = groups if len(items) else []
    if share is None:
        results: list[R | None] = [None] * len(items)
        for group, real in lockstep(groups, []):
            values = run([items[i] for i in group] if real else [filler])  # type: ignore[list-item]
            if real:
                for i, value in zip(group, values, strict=True):
                    results[i] = value
        return results  # type: ignore[return-value]
    summed: torch.Tensor | None = None
    for group, real in lockstep(groups[share.rank :: share.world], groups[0] if groups else []):
        values = torch.stack(list(run([items[i] for i in group]))).double()  # type: ignore[arg-type]
        if summed is None:
            summed = values.new_zeros(len(items), *values.shape[1:])
        if real and share.leads:  # a sequence-parallel group's first counts it
            summed[group] = values
    if summed is None:
        return []
    if PartialState().num_processes > 1:
        summed = reduce(summed, reduction="sum")
    return list(summed.unbind(0))  # type: ignore[arg-type]


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
