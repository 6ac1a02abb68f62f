"""PPO: a policy and a value model trained together on sampled completions, with per-token KL to a frozen
reference folded into the reward, GAE advantages, and clipped policy and value losses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from padless.config import PPOConfig
from padless.losses import clipped_policy_loss, clipped_value_loss, gae, whiten
from padless.model import (
    captured_forward,
    forward_scores,
    logps_from_hidden,
    score_head,
)
from padless.packing import Example, pack
from padless.trainers.checkpoint import load_hf_weights
from padless.trainers.loop import MicroBatch, Trainer
from padless.trainers.rl import Pass, RolloutRecipe, per_target, start_rl, without_dropout


class ActorCritic(torch.nn.Module):
    """Policy and value model as one module, so one optimizer, one DDP wrapper and one checkpoint hold both.

    A checkpoint is the policy in Hugging Face format with the value model in ``value/``.
    """

    def __init__(self, policy: torch.nn.Module, value: torch.nn.Module):
        super().__init__()
        self.policy, self.value = policy, value
        self.padless_attention = policy.padless_attention
        self.config = policy.config

    def forward(self, logits_to_keep: int = 0, **inputs: Any) -> tuple[Any, Any]:
        return self.policy(**inputs, logits_to_keep=logits_to_keep), self.value(**inputs)

    def save_pretrained(
        self, path: str | Path, state_dict: dict[str, torch.Tensor] | None = None, **kwargs: Any
    ):
        for name, module, where in (
            ("policy", self.policy, Path(path)),
            ("value", self.value, Path(path) / "value"),
        ):
            part = (
                None
                if state_dict is None
                else {
                    k.removeprefix(f"{name}."): v for k, v in state_dict.items() if k.startswith(f"{name}.")
                }
            )
            module.save_pretrained(where, state_dict=part, **kwargs)

    def load_hf_weights(self, path: Path) -> None:
        load_hf_weights(self.policy, path)
        load_hf_weights(self.value, path / "value")


class PPORecipe(RolloutRecipe):
    def __init__(self, *args, value_model: torch.nn.Module, **kwargs):
        super().__init__(*args, **kwargs)
        p = self.cfg.ppo
        self.value_model = value_model
        self.updates, self.mini_batches = p.updates_per_rollout, p.mini_batches_per_rollout

    def passes(self) -> dict[str, Pass]:
        return {
            "old_logps": self.logps_pass(self.policy),
            "ref_logps": self.reference_pass(),
            "old_values": lambda b: forward_scores(self.value_model, b),
        }

    def process(self, examples: list[Example], rewards: torch.Tensor, epoch: int) -> dict[str, float]:
        """Per-target rewards (score at the last target, minus the KL penalty), GAE, whitened advantages."""
        p = self.cfg.ppo
        kls, all_adv = [], []
        for e, score in zip(examples, rewards.tolist(), strict=True):
            if e.num_targets == 0:
                e.meta.update(advantages=[], returns=[])
                continue
            old, ref = torch.tensor(e.meta["old_logps"]), torch.tensor(e.meta["ref_logps"])
            kl = old - ref
            token_rewards = -p.kl_coef * kl
            token_rewards[-1] += score
            advantages, returns = gae(token_rewards, torch.tensor(e.meta["old_values"]), p.gamma, p.lam)
            e.meta.update(advantages=advantages.tolist(), returns=returns.tolist())
            kls.append(kl.sum().item())
            all_adv.append(advantages)
        if p.whiten_advantages and all_adv:
            whitened = whiten(torch.cat(all_adv)).tolist()
            start = 0
            for e in examples:
                e.meta["advantages"] = whitened[start : start + e.num_targets]
                start += e.num_targets
        policy_weight = 0.0 if epoch < p.critic_warmup_steps else 1.0  # warm-up: only the critic learns
        for e in examples:
            e.meta["policy_weight"] = policy_weight
        return {"rollout/kl": sum(kls) / max(len(kls), 1)}

    def loss(
        self, model: torch.nn.Module, micro: MicroBatch, normaliser: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        examples: list[Example] = micro.data
        batch = pack(examples, device=self.device)
        inner = getattr(model, "module", model)
        hidden, values = captured_forward(
            model, batch, [inner.policy.get_decoder(), score_head(inner.value)], logits_to_keep=1
        )
        mask = batch.loss_mask[0]
        out = logps_from_hidden(
            inner.policy,
            hidden.last_hidden_state[0],
            batch.labels[0],
            entropy=True,
            temperature=self.cfg.rollout.temperature,
        )
        logps, values = out.logps[mask], values[0, :, 0].float()[mask]
        p = self.cfg.ppo
        policy_loss, clipped = clipped_policy_loss(
            logps,
            per_target(examples, "old_logps", self.device),
            per_target(examples, "advantages", self.device),
            p.cliprange,
            p.cliprange,
        )
        value_loss = clipped_value_loss(
            values,
            per_target(examples, "old_values", self.device),
            per_target(examples, "returns", self.device),
            p.cliprange_value,
        )
        weight = examples[0].meta["policy_weight"]
        loss = (weight * policy_loss + p.vf_coef * value_loss).sum() / normaliser
        return loss, {
            "loss": loss.item(),
            "policy_loss": policy_loss.detach().sum().item() / normaliser,
            "value_loss": value_loss.detach().sum().item() / normaliser,
            "entropy": out.entropy[mask].sum().item() / normaliser,
            "clip_fraction": clipped.float().sum().item() / normaliser,
        }


def run_ppo(cfg: PPOConfig) -> dict[str, float]:
    session, parts = start_rl(cfg, reference=True)
    value_model = session.companion(cfg.ppo.value_model, task="score", trainable=True)
    without_dropout(value_model, "value model")
    recipe = PPORecipe(**parts, value_model=value_model)
    model = ActorCritic(session.model, value_model)
    value_lr = cfg.ppo.value_learning_rate
    rates = {"value.": value_lr} if value_lr is not None else None
    return Trainer(recipe, model, session.tokenizer, cfg.train, session.accelerator, rates).train()
