"""Rollout–trainer mismatch: how far the sampler's log-probs are from the trainer's, and the importance
weights that correct the policy loss for it.

The sampler (vLLM, another precision, or the policy a few updates ago under ``rollout.max_staleness``) is
not the distribution the loss assumes. With ``r = exp(trainer - sampler)`` per token, the policy loss of a
token is multiplied by a weight built from ``r`` as TRL 1.16's ``vllm_importance_sampling_mode`` does (and
verl's ``rollout_is`` token / sequence, truncate / mask): ``token_*`` per token, ``sequence_*`` one ratio
``exp(sum of the sequence's log-ratios)`` for all its tokens; ``*_truncate`` clamps to ``[C_min, C_max]``
(truncated IS, Espeholt et al. 2018), ``*_mask`` zeroes what falls outside (masked IS). With stale samples
the trainer side is the policy at the start of the step, so this is decoupled PPO's behaviour correction
(Hilton et al. 2022; AReaL, Fu et al. 2025).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from padless.errors import InputError
from padless.rl.sample import Sample


def importance_weights(
    trainer: torch.Tensor,
    sampler: torch.Tensor,
    lengths: list[int],
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weights ``[T]`` of concatenated sequences (``lengths`` tokens each) from trainer and
    sampler log-probs ``[T]`` (see the module docstring for ``mode``), and which tokens the bounds
    changed (clamped or zeroed)."""
    diff = trainer - sampler
    if mode.startswith("sequence"):
        sums = torch.stack([d.sum() for d in diff.split(lengths)]) if lengths else diff.new_zeros(0)
        diff = torch.repeat_interleave(sums, torch.tensor(lengths, device=diff.device))
    ratio = diff.exp()
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    outside = (ratio < low) | (ratio > high)
    if mode.endswith("truncate"):
        return ratio.clamp(min=clip_min, max=clip_max), outside
    if mode.endswith("mask"):
        return ratio.masked_fill(outside, 0.0), outside
    raise ValueError(f"importance sampling mode {mode!r}: expected token_/sequence_ + truncate/mask")


def mismatch_metrics(
    trainer: torch.Tensor,
    sampler: torch.Tensor,
    weights: torch.Tensor | None = None,
    changed: torch.Tensor | None = None,
    prefix: str = "mismatch/",
) -> dict[str, float]:
    """What the logs show per rollout: the per-token KL(sampler || trainer) (k3 estimator, on the sampled
    tokens), the largest log-prob gap, the per-token ratio ``trainer / sampler`` (mean, max, min), and, when
    the correction runs, its weights (mean, max) and the share of tokens it changed."""
    if trainer.numel() == 0:
        return {}
    log_ratio = trainer - sampler
    ratio = log_ratio.exp()
    metrics = {
        f"{prefix}kl": (ratio - 1 - log_ratio).mean().item(),
        f"{prefix}logp_diff_max": log_ratio.abs().max().item(),
        f"{prefix}ratio_mean": ratio.mean().item(),
        f"{prefix}ratio_max": ratio.max().item(),
        f"{prefix}ratio_min": ratio.min().item(),
    }
    if weights is not None and changed is not None:
        metrics["mismatch/is_weight_mean"] = weights.mean().item()
        metrics["mismatch/is_weight_max"] = weights.max().item()
        metrics["mismatch/corrected_fraction"] = changed.float().mean().item()
    return metrics


def correct(samples: Sequence[Sample], rollout: Any) -> dict[str, float]:
    """Sampler vs trainer (``old_logps``) log-probs of a rollout's samples: the mismatch metrics and, with
    ``rollout.importance_sampling_correction``, each target's weight (``algorithm.is_weights``) for the
    policy loss. Nothing when the sampler gave no log-probs (greedy), refused when the correction needs
    them and a sampler gave none."""
    if not samples or any(s.drawn.logps is None for s in samples):
        if samples and rollout.correction():
            raise InputError(
                f"rollout.engine: {rollout.engine}: the sampler returned no sampled-token log-probs, so the "
                "importance-sampling correction (on by default for this engine) cannot run; use "
                "rollout.engine: hf, or rollout.importance_sampling_correction: false to train uncorrected"
            )
        return {}
    trainer = torch.tensor([v for s in samples for v in s.passes.old_logps or ()])
    sampler = torch.tensor([v for s in samples for v in s.drawn.logps or ()])
    unreplayed = {}
    if samples[0].passes.unreplayed_logps is not None:  # routing replay: the mismatch without it, beside
        anew = torch.tensor([v for s in samples for v in s.passes.unreplayed_logps or ()])
        unreplayed = mismatch_metrics(anew, sampler, prefix="mismatch/unreplayed_")
    if not rollout.correction():
        return {**mismatch_metrics(trainer, sampler), **unreplayed}
    lengths = [s.num_targets for s in samples]
    weights, changed = importance_weights(
        trainer,
        sampler,
        lengths,
        rollout.importance_sampling_mode,
        rollout.importance_sampling_clip_min,
        rollout.importance_sampling_clip_max,
    )
    for s, w in zip(samples, weights.split(lengths), strict=True):
        s.algorithm.is_weights = w.tolist()
    return {**mismatch_metrics(trainer, sampler, weights, changed), **unreplayed}
