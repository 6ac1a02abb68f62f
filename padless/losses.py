"""Losses as pure functions of per-token or per-sequence tensors.

Every reduction takes an explicit ``normaliser`` (a global count over the whole gradient-accumulation
window and all data-parallel ranks), so the loss of a step does not depend on how its data was split
into micro-batches or processes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sft_loss(logps: torch.Tensor, mask: torch.Tensor, normaliser: float) -> torch.Tensor:
    """Summed NLL of the target tokens divided by the global number of target tokens."""
    return -(logps * mask).sum() / normaliser


def sft_token_weights(mask: torch.Tensor, normaliser: float) -> torch.Tensor:
    """Per-token weights ``w`` with ``sft_loss(logps, mask, normaliser) == (w * logps).sum()``: the form in
    which the LM head takes the loss before its forward pass (``logp_weights``), to compute the gradient
    there."""
    return -mask.float() / normaliser


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None,
    ref_rejected_logps: torch.Tensor | None,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO-family losses and implicit rewards from summed completion log-probs ``[P]``.

    ``sigmoid`` (with conservative label smoothing) and ``hinge`` use summed log-ratios; ``ipo`` uses
    log-probs averaged per token, as in the IPO paper; ``simpo`` is reference-free and length-normalised
    with a target margin ``simpo_gamma``. Returns ``(losses, chosen_rewards, rejected_rewards)``.
    """
    if loss_type in ("ipo", "simpo"):
        chosen_logps = chosen_logps / chosen_lengths
        rejected_logps = rejected_logps / rejected_lengths
    if loss_type == "simpo":
        chosen_ratio, rejected_ratio = chosen_logps, rejected_logps
    else:
        if ref_chosen_logps is None or ref_rejected_logps is None:
            raise ValueError(f"loss_type={loss_type!r} needs reference log-probs")
        if loss_type == "ipo":
            ref_chosen_logps = ref_chosen_logps / chosen_lengths
            ref_rejected_logps = ref_rejected_logps / rejected_lengths
        chosen_ratio = chosen_logps - ref_chosen_logps
        rejected_ratio = rejected_logps - ref_rejected_logps
    logits = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = (
            -F.logsigmoid(beta * logits) * (1 - label_smoothing)
            - F.logsigmoid(-beta * logits) * label_smoothing
        )
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)
    elif loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    elif loss_type == "simpo":
        margin = logits - simpo_gamma / beta
        losses = (
            -F.logsigmoid(beta * margin) * (1 - label_smoothing)
            - F.logsigmoid(-beta * margin) * label_smoothing
        )
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; choose sigmoid, ipo, hinge or simpo")
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def bradley_terry_loss(
    chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, margin: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-pair ``-log sigmoid(r_chosen - r_rejected - margin)``."""
    diff = chosen_scores - rejected_scores
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff)


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4
) -> torch.Tensor:
    """GRPO: each reward minus its group's mean (optionally over the group's std); groups are consecutive."""
    groups = rewards.view(-1, group_size)
    centred = groups - groups.mean(1, keepdim=True)
    if scale:
        centred = centred / (groups.std(1, keepdim=True) + eps)
    return centred.flatten()


def clipped_policy_loss(
    logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO surrogate ``-min(r A, clip(r) A)`` and whether the clip was active."""
    ratio = torch.exp(logps - old_logps)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).detach()


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token unbiased, non-negative KL(policy || ref) estimator ``e^d - d - 1``, d = ref - policy."""
    d = ref_logps - logps
    return torch.exp(d) - d - 1


def gae(
    rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over one sequence's targets ``[n]``; the value after the end is 0.

    Returns ``(advantages, returns)`` with ``returns = advantages + values``.
    """
    advantages = torch.zeros_like(rewards)
    running = rewards.new_zeros(())
    for t in range(rewards.shape[0] - 1, -1, -1):
        next_value = values[t + 1] if t + 1 < rewards.shape[0] else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
    return advantages, advantages + values


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> torch.Tensor:
    """Per-token ``0.5 max((v - R)^2, (v_clipped - R)^2)``, v clipped to ``old +- clip``."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)


def whiten(values: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Zero mean, unit variance (PPO advantages over a whole rollout)."""
    return (values - values.mean()) / (values.std() + eps) if values.numel() > 1 else values - values.mean()
