"""GRPO: sample a group of completions per prompt, score them, and push up the ones better than their
group, with a clipped policy loss and a k3 KL to a frozen reference."""

from __future__ import annotations

import torch

from padless.config import GRPOConfig
from padless.engine import ModelEngine
from padless.losses import clipped_policy_loss, group_advantages, kl_k3
from padless.packing import Example, pack
from padless.trainers.loop import MicroBatch, Trainer
from padless.trainers.rl import Pass, RolloutRecipe, per_target, start_rl


class GRPORecipe(RolloutRecipe):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        g = self.cfg.grpo
        self.kl = g.beta > 0
        self.updates, self.mini_batches = g.updates_per_rollout, g.mini_batches_per_rollout
        self.per_sequence_units = g.loss_normalisation == "sequence"
        self.eps_low, self.eps_high = g.epsilon, g.epsilon if g.epsilon_high is None else g.epsilon_high
        # with one update on one mini-batch the policy has not moved: old log-probs = current, detached
        self.store_old = self.updates > 1 or self.mini_batches > 1

    def passes(self) -> dict[str, Pass]:
        passes = {}
        if self.kl:
            passes["ref_logps"] = self.reference_pass()
        if self.store_old:
            passes["old_logps"] = self.logps_pass(self.policy)
        return passes

    def process(self, examples: list[Example], rewards: torch.Tensor, epoch: int) -> dict[str, float]:
        advantages = group_advantages(rewards, self.cfg.rollout.num_generations, self.cfg.grpo.scale_rewards)
        for e, a in zip(examples, advantages.tolist(), strict=True):
            e.meta["advantage"] = a
        return {}

    def loss(
        self, model: torch.nn.Module, micro: MicroBatch, normaliser: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        examples: list[Example] = micro.data
        batch = pack(examples, device=self.device)
        out = model(batch, logps=True, entropy=True, temperature=self.cfg.rollout.temperature)
        mask = batch.loss_mask[0]
        logps = out.logps[mask]
        counts = torch.tensor([e.num_targets for e in examples], device=self.device)
        advantages = torch.repeat_interleave(
            torch.tensor([e.meta["advantage"] for e in examples], device=self.device, dtype=torch.float32),
            counts,
        )
        old = per_target(examples, "old_logps", self.device) if self.store_old else logps.detach()
        per_token, clipped = clipped_policy_loss(logps, old, advantages, self.eps_low, self.eps_high)
        if (weight := self.is_weights(examples)) is not None:  # rollout-trainer correction, before the KL
            per_token = per_token * weight
        kl = kl_k3(logps, per_target(examples, "ref_logps", self.device)) if self.kl else None
        if kl is not None:
            per_token = per_token + self.cfg.grpo.beta * kl
        if self.per_sequence_units:  # each sequence's mean, then over sequences
            weights = torch.repeat_interleave(1.0 / counts.clamp(min=1).float(), counts)
        else:
            weights = torch.ones_like(per_token)
        loss = (per_token * weights).sum() / normaliser
        metrics = {
            "loss": loss.item(),
            "entropy": (out.entropy[mask] * weights).sum().item() / normaliser,
            "clip_fraction": (clipped.float() * weights).sum().item() / normaliser,
        }
        if kl is not None:
            metrics["kl"] = (kl.detach() * weights).sum().item() / normaliser
        return loss, metrics


def run_grpo(cfg: GRPOConfig) -> dict[str, float]:
    session, parts = start_rl(cfg, reference=cfg.grpo.beta > 0)
    recipe = GRPORecipe(**parts)
    engine = ModelEngine(session.model)
    saved = parts["images"].processor if parts["images"] else session.tokenizer  # beside each checkpoint
    return Trainer(recipe, engine, saved, cfg.train, session.accelerator).train()
