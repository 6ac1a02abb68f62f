"""Losses as pure functions of per-token or per-sequence tensors.

Every reduction takes an explicit ``normaliser`` (a global count over the whole gradient-accumulation
window and all data-parallel ranks), so the loss of a step does not depend on how its data was split
into micro-batches or processes.
"""

from __future__ import annotations

import torch


def sft_loss(logps: torch.Tensor, mask: torch.Tensor, normaliser: float) -> torch.Tensor:
    """Summed NLL of the target tokens divided by the global number of target tokens."""
    return -(logps * mask).sum() / normaliser
