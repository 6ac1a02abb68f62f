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
    rewards: torch.Tensor,
    values: torch.Tensor,
    gamma: float,
    lam: float,
    lengths: list[int] | None = None,
    block: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over sequences' targets concatenated in ``[T]`` (``lengths`` each,
    default one sequence); the value after each sequence's end is 0.

    ``A_t = sum_k (gamma lam)^(k-t) delta_k`` over ``k >= t`` in the same sequence, in fp64: every block of
    ``block`` targets at once as a masked matrix of powers, then each block's first advantage carried into
    the block before it (a scalar recursion over T / block blocks) instead of a step per token.
    Returns ``(advantages, returns)``, ``returns = advantages + values``, in the rewards' dtype.
    """
    total = rewards.shape[0]
    lengths = [total] if lengths is None else lengths
    if sum(lengths) != total:
        raise ValueError(f"gae: lengths sum to {sum(lengths)}, but {total} rewards were given")
    r, v = rewards.double(), values.double()
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))
    ends = seq[1:] != seq[:-1]  # target t is its sequence's last: no value after it
    deltas = r + gamma * torch.cat([v[1:].masked_fill(ends, 0.0), v.new_zeros(1)]) - v
    pad = -total % block
    d = F.pad(deltas, (0, pad)).view(-1, block)
    s = F.pad(seq, (0, pad), value=-1).view(-1, block)  # padding is a sequence of its own
    decay = torch.tensor(gamma * lam, dtype=torch.float64)
    at = torch.arange(block)
    gap = at[None, :] - at[:, None]  # k - t
    powers = torch.where(gap >= 0, decay ** gap.clamp(min=0), 0.0)
    local = torch.cat(
        [
            torch.einsum("btk,bk->bt", powers * (sc[:, :, None] == sc[:, None, :]), dc)
            for dc, sc in zip(d.split(1024), s.split(1024), strict=True)  # bounded memory: 8 MB a chunk
        ]
    )
    # how the first advantage of the next block enters each target of this block
    follows = s == torch.cat([s[1:, :1], s.new_full((1, 1), -2)])
    into = torch.where(follows, decay ** (block - at), 0.0)
    firsts, coefs = local[:, 0].tolist(), into[:, 0].tolist()
    carried = [0.0] * len(firsts)
    for b in range(len(firsts) - 2, -1, -1):
        carried[b] = firsts[b + 1] + coefs[b + 1] * carried[b + 1]
    advantages = (local + into * torch.tensor(carried, dtype=torch.float64)[:, None]).flatten()[:total]
    advantages = advantages.to(rewards.dtype)
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
