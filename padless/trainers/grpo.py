"""GRPO: sample a group of completions per prompt, score them, and push up the ones better than their
group, with a policy loss of the GRPO family (``grpo.loss_type``, ``grpo.importance_sampling_level``),
group-relative advantages (``grpo.advantage``) and a k3 KL to a frozen reference."""

from __future__ import annotations

import logging
import math
import random
from collections import defaultdict

import torch

from padless.config.schema import GRPOConfig
from padless.errors import InputError
from padless.forward.packing import pack
from padless.losses import (
    cispo_policy_loss,
    clipped_policy_loss,
    constant_groups,
    group_advantages,
    gspo_policy_loss,
    kl_k3,
    policy_loss_units,
    policy_token_weights,
    reinforce_pp_advantages,
    rloo_advantages,
    sequence_mean,
)
from padless.rl.sample import Sample, per_target
from padless.rl.setup import RolloutSetup, start_rl
from padless.run.loop import MicroBatch, Trainer
from padless.trainers.rl import Pass, RolloutRecipe

log = logging.getLogger(__name__)


class GRPORecipe(RolloutRecipe):
    def __init__(self, setup: RolloutSetup):
        super().__init__(setup)
        g = self.cfg.grpo
        self.kl = g.beta > 0
        self.updates, self.mini_batches = g.updates_per_rollout, g.mini_batches_per_rollout
        self.eps_low, self.eps_high = g.epsilon, g.epsilon if g.epsilon_high is None else g.epsilon_high
        # with one update on one mini-batch the policy has not moved: old log-probs = current, detached
        self.store_old = self.updates > 1 or self.mini_batches > 1
        self.empty_refills = 0  # dynamic sampling's refill rounds in a row that found no usable group

    def passes(self) -> dict[str, Pass]:
        passes = {}
        if self.kl:
            passes["ref_logps"] = self.reference_pass()
        if self.store_old:
            passes["old_logps"] = self.logps_pass(self.policy)
        return passes

    def sample(self, epoch: int) -> tuple[list[Sample], dict[str, float]]:
        """With ``grpo.dynamic_sampling_rounds`` (DAPO): groups whose rewards are all equal are dropped and
        replaced by groups of fresh prompts (a seeded draw per round), for at most that many rounds; if the
        rollout is still short, the first dropped groups fill it (their advantages are 0) and the log says
        how many, each time. ``grpo.dynamic_sampling_empty_refills`` refill rounds in a row that find no
        group with different rewards stop the run (nothing can be learned). Logs the share of sampled groups
        that were dropped."""
        examples, metrics = super().sample(epoch)
        g = self.cfg.grpo
        if not g.dynamic_sampling_rounds:
            return examples, metrics
        group, wanted = self.cfg.rollout.num_generations, self.cfg.rollout.prompts_per_step
        kept: list[list[Sample]] = []
        dropped: list[list[Sample]] = []
        sampled, done = 0, 0
        while True:
            groups = [examples[i : i + group] for i in range(0, len(examples), group)]
            flat = constant_groups(group_rewards(examples), group).tolist()
            for one, constant in zip(groups, flat, strict=True):
                (dropped if constant else kept).append(one)
            sampled += len(groups)
            if done:  # a refill round: one that finds nothing counts towards the stop
                self.count_refill(found=not all(flat))
            if len(kept) >= wanted or done == g.dynamic_sampling_rounds:
                break
            done += 1
            draw = random.Random(self.cfg.train.seed * 1_000_003 + epoch * 1009 + done)
            prompts = [self.prompts[i] for i in draw.choices(range(len(self.prompts)), k=wanted - len(kept))]
            seed = self.cfg.train.seed * 1_000_003 + epoch + 7_919_011 * done
            examples = self.collect(prompts, group, seed)
        filled = max(wanted - len(kept), 0)
        if filled:
            log.warning(
                "rollout %d: dynamic sampling found %d of %d groups with different rewards after %d refill "
                "round(s); %d groups of equal rewards fill the rollout (advantage 0: no gradient)",
                epoch,
                len(kept),
                wanted,
                done,
                filled,
            )
        chosen = kept[:wanted] + dropped[:filled]
        metrics["dynamic_sampling/dropped_fraction"] = len(dropped) / sampled
        metrics["dynamic_sampling/refill_rounds"] = float(done)
        metrics["dynamic_sampling/constant_groups_kept"] = float(filled)
        return [e for one in chosen for e in one], metrics

    def count_refill(self, found: bool) -> None:
        """Dynamic sampling's refill rounds in a row that found no group with different rewards: at
        ``grpo.dynamic_sampling_empty_refills`` the run stops (every rank alike: they plan on the same
        rewards)."""
        self.empty_refills = 0 if found else self.empty_refills + 1
        most = self.cfg.grpo.dynamic_sampling_empty_refills
        if self.empty_refills < most:
            return
        error = InputError(
            f"grpo.dynamic_sampling_empty_refills={most}: {self.empty_refills} refill rounds in a row found "
            "no group whose rewards differ (every completion of a prompt scored the same), so there is "
            "nothing to learn; fix: check that the reward functions tell completions apart, use prompts of a "
            "difficulty the policy sometimes but not always solves, or raise rollout.num_generations or "
            "rollout.temperature"
        )
        error.every_rank = True  # type: ignore[attr-defined]
        raise error

    def process(self, samples: list[Sample], epoch: int) -> dict[str, float]:
        g, group = self.cfg.grpo, self.cfg.rollout.num_generations
        rewards = group_rewards(samples)
        if g.advantage == "rloo":
            advantages = rloo_advantages(rewards, group)
        elif g.advantage == "reinforce_pp":
            advantages = reinforce_pp_advantages(rewards, group)
        else:
            advantages = group_advantages(rewards, group, g.group_std)
        for s, a in zip(samples, advantages.tolist(), strict=True):
            s.algorithm.advantages = [a] * s.num_targets  # one per sequence, on each of its targets
        return {}

    def units(self, chunk: list[Sample]) -> float:
        lengths = [e.num_targets for e in chunk]
        return policy_loss_units(lengths, self.cfg.grpo.loss_type, self.cfg.rollout.model_token_budget())

    def micro_batches(self, samples: list[Sample], epoch: int) -> list[MicroBatch]:
        """With ``grpo.token_normaliser: rollout`` each step of a dapo / cispo rollout divides by the
        rollout's target tokens over the mini-batches (TRL's count), not by its own tokens: its micro-batches'
        units are scaled so that they sum to that."""
        micros = super().micro_batches(samples, epoch)
        if self.cfg.grpo.token_normaliser == "rollout":
            share = sum(s.num_targets for s in samples) / self.mini_batches
            steps: dict[int, float] = defaultdict(float)
            for m in micros:
                steps[m.step] += m.units
            for m in micros:
                m.units *= share / steps[m.step] if steps[m.step] else 0.0
        return micros

    def loss(
        self, model: torch.nn.Module, micro: MicroBatch, normaliser: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        g = self.cfg.grpo
        samples: list[Sample] = micro.data
        batch = pack(samples, device=self.device)
        out = model(batch, logps=True, entropy=True, temperature=self.cfg.rollout.temperature)
        mask = batch.loss_mask[0]
        logps = out.logps[mask]
        counts = torch.tensor([s.num_targets for s in samples], device=self.device)
        advantages = per_target([s.algorithm.advantages for s in samples], self.device)
        old = (
            per_target([s.passes.old_logps for s in samples], self.device)
            if self.store_old
            else logps.detach()
        )
        weight = self.is_weights(samples)  # the rollout-trainer correction (None: off), before the KL
        eps = (self.eps_low, self.eps_high)
        if g.loss_type == "cispo":
            per_token, clipped = cispo_policy_loss(logps, old, advantages, g.max_ratio, weight)
        elif g.importance_sampling_level == "sequence":
            per_token, clipped = gspo_policy_loss(logps, old, advantages, counts, *eps, weight)
        else:
            per_token, clipped = clipped_policy_loss(logps, old, advantages, *eps, weight)
        kl = kl_k3(logps, per_target([s.passes.ref_logps for s in samples], self.device)) if self.kl else None
        if (
            kl is not None and g.kl_bias_correction
        ):  # TRL's use_bias_correction_kl: times the ratio, with grad
            sequence = g.importance_sampling_level == "sequence" and g.loss_type != "cispo"
            kl = kl * torch.exp(sequence_mean(logps - old, counts) if sequence else logps - old)
        if kl is not None:
            per_token = per_token + g.beta * kl
        weights = policy_token_weights(counts, g.loss_type).to(per_token.dtype)
        loss = (per_token * weights).sum() / normaliser
        # metrics are means over the step: per token (dapo, cispo) or of each sequence's mean (grpo; dr_grpo,
        # whose normaliser counts the model-token budget per sequence)
        shown = weights
        if g.loss_type == "dr_grpo":
            shown = policy_token_weights(counts, "grpo") * self.cfg.rollout.model_token_budget()
        metrics = {
            "loss": loss.item(),
            "entropy": (out.entropy[mask] * shown).sum().item() / normaliser,
            "clip_fraction": (clipped.float() * shown).sum().item() / normaliser,
        }
        if kl is not None:
            metrics["kl"] = (kl.detach() * shown).sum().item() / normaliser
        return loss, metrics


def group_rewards(samples: list[Sample]) -> torch.Tensor:
    """The samples' rewards as the advantages read them: NaN for a sample no source scored (left out of its
    group's statistics, advantage 0)."""
    return torch.tensor([math.nan if s.scored.unscored else s.scored.reward for s in samples])


def run_grpo(cfg: GRPOConfig) -> dict[str, float]:
    session, setup = start_rl(cfg, reference=cfg.grpo.beta > 0)
    recipe = GRPORecipe(setup)
    engine = session.engine()
    saved = setup.images.processor if setup.images else session.tokenizer  # beside each checkpoint
    return Trainer(recipe, engine, saved, cfg.train, session.accelerator).train()
