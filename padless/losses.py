"""Losses as pure functions of per-token or per-sequence tensors.

Every reduction takes an explicit ``normaliser`` (a global count over the whole gradient-accumulation
window and all data-parallel ranks), so the loss of a step does not depend on how its data was split
into micro-batches or processes.
"""

from __future__ import annotations

import math

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


def load_balancing_loss(
    router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int
) -> torch.Tensor:
    """A mixture of experts' load-balancing loss (Switch Transformer, eq. 4-6) over every token of every
    layer: ``num_experts * sum_e f_e P_e``, with ``f_e`` the share of top-k assignments that go to expert
    ``e`` and ``P_e`` its mean router probability. ``router_logits``: one ``[tokens, experts]`` tensor
    per routed layer, real tokens only (a packed row has no padding; a padded batch passes its real rows).

    This is what transformers' MoE causal LMs add to their loss (``load_balancing_loss_func`` with the
    attention mask): a statistic of the whole batch, not a sum over tokens, so micro-batches are
    combined by the caller (:mod:`padless.forward.routers`). Only ``P_e`` carries a gradient."""
    assignments = router_logits[0].new_zeros(num_experts, dtype=torch.float32)
    probabilities = torch.zeros_like(assignments)
    rows = 0
    for logits in router_logits:
        probs = F.softmax(logits, dim=-1)  # in the logits' dtype, as transformers takes the top-k of it
        chosen = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
        assignments = assignments.index_add(0, chosen, torch.ones_like(chosen, dtype=torch.float32))
        probabilities = probabilities + probs.float().sum(0)
        rows += logits.shape[0]
    return num_experts * ((assignments / max(rows, 1)) * (probabilities / max(rows, 1))).sum()


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


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0`` without cancellation: ``log(-expm1(x))`` near 0, ``log1p(-exp(x))``
    below ``-log 2`` (Maechler 2012, "Accurately computing log(1 - exp(-|a|))")."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(
    chosen_mean_logps: torch.Tensor, rejected_mean_logps: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """ORPO's odds-ratio term per pair ``-beta log sigmoid(log odds(chosen) - log odds(rejected))``, where
    ``odds(y) = P(y) / (1 - P(y))`` of the completion's mean per-token log-prob; returns it and the log
    odds ratio. The SFT term (the chosen completion's NLL) is added by the recipe.

    Source: Hong et al. 2024, "ORPO" (arXiv:2403.07691) Eq. 4-7; ``beta`` is the paper's lambda (TRL's
    ``beta``)."""
    chosen, rejected = chosen_mean_logps.float(), rejected_mean_logps.float()
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    return -beta * F.logsigmoid(log_odds), log_odds.detach()


def kto_loss(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor | float,
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-completion KTO losses and implicit rewards ``beta (log pi - log pi_ref)`` from summed completion
    log-probs ``[N]`` and which completions are desirable ``[N]`` (bool).

    ``kto``: desirable ``w_d (1 - sigmoid(beta (r - z)))``, undesirable ``w_u (1 - sigmoid(beta (z - r)))``
    with ``r`` the log-ratio and ``z`` the KL baseline (taken without gradient; the recipe estimates it on
    mismatched prompt / completion pairs). ``apo_zero_unpaired``: the same without ``z``, undesirable
    ``w_u sigmoid(beta r)``.

    Source: Ethayarajh et al. 2024, "KTO" (arXiv:2402.01306) Eq. 7-8; APO-zero: D'Oosterlinck et al. 2024
    (arXiv:2408.06266), the unpaired form TRL 1.16 ships."""
    ratio = logps - ref_logps
    if loss_type == "kto":
        z = torch.as_tensor(kl, dtype=ratio.dtype, device=ratio.device).detach()
        good, bad = 1 - torch.sigmoid(beta * (ratio - z)), 1 - torch.sigmoid(beta * (z - ratio))
    elif loss_type == "apo_zero_unpaired":
        good, bad = 1 - torch.sigmoid(beta * ratio), torch.sigmoid(beta * ratio)
    else:
        raise ValueError(f"unknown KTO loss_type {loss_type!r}; choose kto or apo_zero_unpaired")
    losses = torch.where(desirable, desirable_weight * good, undesirable_weight * bad)
    return losses, beta * ratio.detach()


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-token generalised Jensen-Shannon divergence ``[n]`` between the student's and the teacher's
    next-token distributions (logits ``[n, V]``, temperature already applied), summed over the vocabulary:
    ``beta KL(p_T || m) + (1 - beta) KL(p_S || m)`` with the mixture ``m = beta p_T + (1 - beta) p_S``;
    ``beta = 0`` is the forward ``KL(p_T || p_S)``, ``beta = 1`` the reverse ``KL(p_S || p_T)``.

    Source: Agarwal et al. 2024, "On-Policy Distillation of Language Models" (GKD, arXiv:2306.13649)
    Eq. 1, as TRL 1.16's ``GKDTrainer.generalized_jsd_loss`` computes it (the same mixture weights)."""
    s = student_logits.float().log_softmax(-1)
    t = teacher_logits.float().log_softmax(-1)
    if beta == 0:
        return (t.exp() * (t - s)).sum(-1)
    if beta == 1:
        return (s.exp() * (s - t)).sum(-1)
    mixture = torch.logsumexp(torch.stack([s + math.log1p(-beta), t + math.log(beta)]), 0)
    return beta * (t.exp() * (t - mixture)).sum(-1) + (1 - beta) * (s.exp() * (s - mixture)).sum(-1)


def top_k_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, k: int) -> torch.Tensor:
    """Per-token ``KL(q || p_S)`` ``[n]`` where ``q`` is the teacher's distribution restricted to its ``k``
    most likely tokens and renormalised, against the student's full distribution at those tokens (sparse
    knowledge distillation: the teacher's tail is dropped, the student's is not)."""
    top, ids = teacher_logits.float().topk(k, -1)
    q = top.log_softmax(-1)
    s = student_logits.float().log_softmax(-1).gather(-1, ids)
    return (q.exp() * (q - s)).sum(-1)


def bradley_terry_loss(
    chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, margin: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-pair ``-log sigmoid(r_chosen - r_rejected - margin)``."""
    diff = chosen_scores - rejected_scores
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff)


def _scored_stats(values: torch.Tensor, dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and Bessel-corrected std of ``values`` along ``dim`` (all when None), over the scored ones: a
    NaN is a sample no source scored, left out (the std of fewer than two values is NaN)."""
    keep = dict(dim=dim, keepdim=True) if dim is not None else {}
    if not values.isnan().any():  # every sample scored: the plain statistics
        return values.mean(**keep), values.std(**keep)
    mean = values.nanmean(**keep)
    count = (~values.isnan()).sum(**keep)
    return mean, (((values - mean) ** 2).nansum(**keep) / (count - 1)).sqrt()


def _unscored_zero(advantages: torch.Tensor) -> torch.Tensor:
    return torch.where(advantages.isnan(), 0.0, advantages)


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4
) -> torch.Tensor:
    """GRPO: each reward minus its group's mean (optionally over the group's std); groups are consecutive.
    A NaN reward (a sample no reward source scored) is left out of its group's mean and std and gets
    advantage 0, as TRL 1.16 does.

    Source: Shao et al. 2024 (DeepSeekMath, arXiv:2402.03300) §4.1.2, outcome supervision; ``scale=False``
    is Dr.GRPO's unbiased form (Liu et al. 2025, arXiv:2503.20783), which drops the std that over-weights
    groups of nearly equal rewards."""
    groups = rewards.view(-1, group_size)
    mean, std = _scored_stats(groups, 1)
    centred = groups - mean
    if scale:
        centred = centred / (std + eps)
    return _unscored_zero(centred.flatten())


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO: each reward minus the mean of the *other* ``G - 1`` rewards of its group, a baseline that does
    not see the sample it judges; equal to ``G / (G - 1) (r - group mean)``. Unscored samples (NaN) are
    left out of the others' mean and get advantage 0 (so does a group's only scored sample).

    Source: Ahmadian et al. 2024, "Back to Basics" (arXiv:2402.14740) §3.2, after Kool et al. 2019; TRL's
    ``RLOOTrainer`` computes the same baseline (without its optional batch whitening)."""
    groups = rewards.view(-1, group_size)
    if not groups.isnan().any():
        others = (groups.sum(1, keepdim=True) - groups) / (group_size - 1)
    else:
        count = (~groups.isnan()).sum(1, keepdim=True)
        others = (groups.nansum(1, keepdim=True) - groups) / (count - 1)
    return _unscored_zero((groups - others).flatten())


def reinforce_pp_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """REINFORCE++-baseline: the group mean as baseline, then one normalisation over the whole rollout
    ("global advantage normalisation") instead of each group's std, which is noisy for small groups.
    Unscored samples (NaN) are left out of every mean and std and get advantage 0.

    Source: Hu et al. 2025, "REINFORCE++" (arXiv:2501.03262), the ``-baseline`` variant for reasoning
    tasks (OpenRLHF ``advantage_estimator: reinforce_baseline``). The rollout's mean and std are taken over
    sequences (each sample counts once, like the group mean); OpenRLHF weights them by tokens."""
    groups = rewards.view(-1, group_size)
    centred = (groups - _scored_stats(groups, 1)[0]).flatten()
    if (~centred.isnan()).sum() < 2:
        return _unscored_zero(centred - centred)
    mean, spread = _scored_stats(centred)
    return _unscored_zero((centred - mean) / (spread + eps))


def constant_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Which groups (``[n_groups]`` bools) have all (scored) rewards equal: every group-relative advantage of
    such a group is 0, so it carries no gradient (a group with fewer than two scored samples neither). DAPO's
    dynamic sampling drops and refills them (Yu et al. 2025, arXiv:2503.14476, §3.2, Eq. 11: keep groups
    with ``0 < #correct < G``)."""
    groups = rewards.view(-1, group_size)
    return groups.nan_to_num(-math.inf).amax(1) <= groups.nan_to_num(math.inf).amin(1)


def soft_overlong_penalty(
    lengths: torch.Tensor, max_length: int, buffer: int, factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment, a reward term: 0 up to ``max_length - buffer`` tokens, then falling
    linearly to ``-factor`` at ``max_length`` (and beyond).

    Source: Yu et al. 2025 (DAPO, arXiv:2503.14476) Eq. 13; TRL's ``get_soft_overlong_punishment`` is
    the case ``factor = 1``, verl's ``overlong_buffer.penalty_factor`` the factor."""
    if not 0 < buffer <= max_length:
        raise ValueError(f"soft_overlong_penalty: buffer must be in (0, {max_length}], got {buffer}")
    excess = (lengths.float() - (max_length - buffer)).clamp(0, buffer)
    return -factor * excess / buffer


def _weighted(per_token: torch.Tensor, behaviour_weight: torch.Tensor | None) -> torch.Tensor:
    return per_token if behaviour_weight is None else per_token * behaviour_weight.detach()


def _clip_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).detach()


def clipped_policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    behaviour_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO surrogate ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``, ``r = pi / pi_old`` per
    token, and whether the clip was active.

    Source: Schulman et al. 2017 (PPO, arXiv:1707.06347) Eq. 7; the asymmetric clip is DAPO's clip-higher
    (arXiv:2503.14476 §3.1). GRPO, Dr.GRPO and DAPO share this per-token term and differ only in how it is
    summed (:func:`policy_loss_units`). ``behaviour_weight``: an optional per-token factor ``[T]`` (taken
    without gradient) multiplied into the loss, where a rollout-vs-trainer importance-sampling correction
    (e.g. truncated ``pi_old / pi_sampler``) enters; None means 1."""
    per_token, clipped = _clip_surrogate(torch.exp(logps - old_logps), advantages, eps_low, eps_high)
    return _weighted(per_token, behaviour_weight), clipped


def sequence_mean(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean of ``values`` (sequences' targets concatenated, ``lengths`` each), repeated on
    each of its targets; differentiable."""
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=values.device), lengths)
    sums = values.new_zeros(len(lengths)).index_add(0, seq, values)
    return (sums / lengths.clamp(min=1).to(values.dtype))[seq]


def gspo_policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    lengths: torch.Tensor,
    eps_low: float,
    eps_high: float,
    behaviour_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO: the clipped surrogate on one ratio per sequence, the length-normalised sequence likelihood
    ratio ``s = exp(mean_t log(pi / pi_old))``, repeated on each of its ``lengths`` targets.

    Source: Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071) Eq. 5-7; TRL's
    ``importance_sampling_level: sequence``. The gradient flows through ``s`` (every token of a sequence
    is pushed by the same clipped sequence weight). Its clip ranges are far smaller than per-token ones
    (the paper: 3e-4 / 4e-4). ``behaviour_weight`` as in :func:`clipped_policy_loss`."""
    ratio = torch.exp(sequence_mean(logps - old_logps, lengths))
    per_token, clipped = _clip_surrogate(ratio, advantages, eps_low, eps_high)
    return _weighted(per_token, behaviour_weight), clipped


def cispo_policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    max_ratio: float,
    behaviour_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO: REINFORCE on every token weighted by its importance ratio capped at ``max_ratio`` and taken
    without gradient, ``-sg(min(r, max_ratio)) A log pi``: no token drops out of the gradient, as tokens
    do when PPO's clip is active. Returns the per-token loss and where the cap was active.

    Source: MiniMax-M1 report (arXiv:2506.13585) §3.1, Eq. 4-5 (no lower bound); ScaleRL (arXiv:2510.13786)
    calls the cap epsilon_max and recommends 5; TRL ``loss_type: cispo`` (its ``epsilon_high`` is the
    cap). ``behaviour_weight`` as in :func:`clipped_policy_loss`."""
    ratio = torch.exp(logps - old_logps)
    per_token = -ratio.clamp(max=max_ratio).detach() * advantages * logps
    return _weighted(per_token, behaviour_weight), (ratio > max_ratio).detach()


def policy_loss_units(lengths: list[int], loss_type: str, max_new_tokens: int) -> float:
    """A micro-batch's share of the step's global normaliser for a GRPO-family ``loss_type``; sequences'
    losses are summed with :func:`policy_token_weights` and divided by the step's total of these units.

    - ``dapo`` / ``cispo``: target tokens, a token-mean over the whole step (DAPO arXiv:2503.14476 Eq. 8,
      the token-level policy gradient loss; TRL's default);
    - ``grpo``: sequences with targets, each weighing its own token-mean (DeepSeekMath Eq. 3);
    - ``dr_grpo``: every sequence times ``max_new_tokens``, a constant per step (Dr.GRPO
      arXiv:2503.20783 §3.1, as in TRL: ``max_completion_length`` per sequence) that removes the
      length bias of ``grpo`` and the dependence of ``dapo`` on how many tokens the step holds; for a
      multi-turn episode, the most model tokens of the whole episode, not of one turn
      (``RolloutSettings.model_token_budget``).
    """
    if loss_type in ("dapo", "cispo"):
        return float(sum(lengths))
    if loss_type == "grpo":
        return float(sum(n > 0 for n in lengths))
    if loss_type == "dr_grpo":
        return float(len(lengths) * max_new_tokens)
    raise ValueError(f"unknown loss_type {loss_type!r}; choose dapo, grpo, dr_grpo or cispo")


def policy_token_weights(lengths: torch.Tensor, loss_type: str) -> torch.Tensor:
    """Per-target weights ``[T]`` to go with :func:`policy_loss_units`: ``1 / length`` of its sequence
    for ``grpo`` (each sequence's mean), 1 otherwise."""
    if loss_type == "grpo":
        return torch.repeat_interleave(1.0 / lengths.clamp(min=1).double(), lengths)
    return torch.ones(int(lengths.sum()), device=lengths.device, dtype=torch.float64)


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
