"""Shared by the trainer tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from padless.run.loop import MicroBatch

StepFn = Callable[..., tuple[dict[str, float], list[torch.Tensor]]]


def _step_metrics(recipe, model, groups, pairs) -> tuple[dict[str, float], list[torch.Tensor]]:
    """Summed metric shares and gradients of one step accumulated over ``groups`` of pair indices."""
    model.zero_grad(set_to_none=True)
    totals: dict[str, float] = {}
    for group in groups:
        loss, metrics = recipe.loss(model, MicroBatch([pairs[i] for i in group], 0, 0), normaliser=len(pairs))
        loss.backward()
        for key, value in metrics.items():
            totals[key] = totals.get(key, 0.0) + value
    return totals, [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.fixture(scope="session")
def step_metrics() -> StepFn:
    """One optimizer step's metrics and gradients, accumulated over micro-batches as the loop does."""
    return _step_metrics
