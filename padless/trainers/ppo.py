"""PPO: a policy and a value model trained together (one engine: a checkpoint is the policy in Hugging Face
format with the value model in ``value/``) on sampled completions, with per-token KL to a frozen
reference folded into the reward, GAE advantages, and clipped policy and value losses."""

from __future__ import annotations

import torch

from padless.config.schema import PPOConfig
from padless.forward.packing import pack
from padless.forward.vision import require_same_inputs
from padless.losses import clipped_policy_loss, clipped_value_loss, gae, whiten
from padless.rl.sample import Sample, per_target
from padless.rl.setup import RolloutSetup, start_rl, without_dropout
from padless.run.loop import MicroBatch, Trainer
from padless.trainers.rl import Pass, RolloutRecipe


class PPORecipe(RolloutRecipe):
    def __init__(self, setup: RolloutSetup):
        super().__init__(setup)
        p = self.cfg.ppo
        self.updates, self.mini_batches = p.updates_per_rollout, p.mini_batches_per_rollout

    def passes(self) -> dict[str, Pass]:
        return {
            "old_logps": self.logps_pass(self.policy),
            "ref_logps": self.reference_pass(),
            "old_values": lambda b: self.policy(b, values=True).values,
        }

    def process(self, samples: list[Sample], epoch: int) -> dict[str, float]:
        """Per-target rewards (score at the last target, minus the KL penalty), GAE, whitened advantages."""
        p = self.cfg.ppo
        for s in samples:
            s.algorithm.advantages, s.algorithm.returns = [], []
        live = [(s, s.scored.reward) for s in samples if s.num_targets]
        kls: list[float] = []
        if live:  # every sequence in one vectorised GAE over the concatenated targets
            lengths = [s.num_targets for s, _ in live]
            passes = [s.passes for s, _ in live]
            old = torch.tensor([x for stored in passes for x in stored.old_logps or ()])
            ref = torch.tensor([x for stored in passes for x in stored.ref_logps or ()])
            old_values = torch.tensor([x for stored in passes for x in stored.old_values or ()])
            kl = old - ref
            token_rewards = -p.kl_coef * kl
            token_rewards[torch.tensor(lengths).cumsum(0) - 1] += torch.tensor([score for _, score in live])
            advantages, returns = gae(token_rewards, old_values, p.gamma, p.lam, lengths)
            if p.whiten_advantages:
                advantages = whiten(advantages)
            for (s, _), adv, ret in zip(live, advantages.split(lengths), returns.split(lengths), strict=True):
                s.algorithm.advantages, s.algorithm.returns = adv.tolist(), ret.tolist()
            kls = [k.sum().item() for k in kl.split(lengths)]
        policy_weight = 0.0 if epoch < p.critic_warmup_steps else 1.0  # warm-up: only the critic learns
        for s in samples:
            s.algorithm.policy_weight = policy_weight
        return {"rollout/kl": sum(kls) / max(len(kls), 1)}

    def loss(
        self, model: torch.nn.Module, micro: MicroBatch, normaliser: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        samples: list[Sample] = micro.data
        batch = pack(samples, device=self.device)
        out = model(batch, logps=True, entropy=True, values=True, temperature=self.cfg.rollout.temperature)
        mask = batch.loss_mask[0]
        logps, values = out.logps[mask], out.values[mask]
        p = self.cfg.ppo
        policy_loss, clipped = clipped_policy_loss(
            logps,
            per_target([s.passes.old_logps for s in samples], self.device),
            per_target([s.algorithm.advantages for s in samples], self.device),
            p.cliprange,
            p.cliprange,
        )
        if (is_weight := self.is_weights(samples)) is not None:  # rollout-trainer correction
            policy_loss = policy_loss * is_weight
        value_loss = clipped_value_loss(
            values,
            per_target([s.passes.old_values for s in samples], self.device),
            per_target([s.algorithm.returns for s in samples], self.device),
            p.cliprange_value,
        )
        weight = samples[0].algorithm.policy_weight
        loss = (weight * policy_loss + p.vf_coef * value_loss).sum() / normaliser
        return loss, {
            "loss": loss.item(),
            "policy_loss": policy_loss.detach().sum().item() / normaliser,
            "value_loss": value_loss.detach().sum().item() / normaliser,
            "entropy": out.entropy[mask].sum().item() / normaliser,
            "clip_fraction": clipped.float().sum().item() / normaliser,
        }


def run_ppo(cfg: PPOConfig) -> dict[str, float]:
    session, setup = start_rl(cfg, reference=True)
    value_model = session.companion(cfg.ppo.value_model, task="score", trainable=True)
    role = f"ppo.value_model {cfg.ppo.value_model or cfg.model.name}"
    require_same_inputs(session.model, value_model, role)
    without_dropout(value_model, "value model")
    recipe = PPORecipe(setup)
    model = session.engine(value=value_model)  # one optimizer, wrapper and checkpoint for both
    value_lr = cfg.ppo.value_learning_rate
    rates = {"value.": value_lr} if value_lr is not None else None
    saved = setup.images.processor if setup.images else session.tokenizer  # beside each checkpoint
    return Trainer(recipe, model, saved, cfg.train, session.accelerator, rates).train()
