"""What GRPO and PPO share: prompts in seeded order, sampled rollouts, rewards, stored per-target values,
and mini-batch steps. Padding exists only inside ``generate``; every scoring pass and update runs on
packed token-budget micro-batches. One "epoch" of the shared loop is one rollout.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import torch

from padless.data import PromptExample, reward_inputs
from padless.packing import Example, PackedBatch, budget_batches, pack
from padless.rewards import RewardComposer
from padless.rollout import Completion, generate
from padless.trainers.loop import MicroBatch
from padless.trainers.rm import score_examples


def per_target(examples: list[Example], key: str, device: torch.device) -> torch.Tensor:
    """Concatenate per-target values stored in ``meta[key]``, in packed target order."""
    return torch.tensor([v for e in examples for v in e.meta[key]], device=device, dtype=torch.float32)


class RolloutRecipe:
    """Subclasses set ``self.updates``, ``self.mini_batches`` and implement ``process`` and ``loss``."""

    updates: int = 1
    mini_batches: int = 1
    per_sequence_units: bool = False

    def __init__(
        self,
        prompts: list[PromptExample],
        cfg: Any,
        tokenizer: Any,
        policy: torch.nn.Module,
        rewards: RewardComposer | None,
        device: torch.device,
        eval_prompts: list[PromptExample] | None = None,
        main_process: bool = True,
        reward_model: torch.nn.Module | None = None,
    ):
        self.prompts, self.cfg, self.tokenizer, self.policy = prompts, cfg, tokenizer, policy
        self.rewards, self.device, self.reward_model = rewards, device, reward_model
        self.eval_prompts, self.main_process = eval_prompts or [], main_process
        self.metrics: dict[int, dict[str, float]] = {}

    def prompts_for(self, rollout: int) -> list[PromptExample]:
        """The rollout's prompts: consecutive slices of a fresh seeded permutation per pass over the data."""
        n, k = len(self.prompts), self.cfg.rollout.prompts_per_step
        chosen = []
        for position in range(rollout * k, (rollout + 1) * k):
            order = list(range(n))
            random.Random(self.cfg.train.seed + position // n).shuffle(order)
            chosen.append(self.prompts[order[position % n]])
        return chosen

    def sample(self, prompts: list[PromptExample], seed: int, group: int, greedy: bool = False):
        """Completions as packed-ready examples (targets: the completion; none if truncated and masked)."""
        r = self.cfg.rollout
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # sampling is seeded per rollout, training RNG untouched
            torch.manual_seed(seed)
            completions = generate(
                self.policy,
                self.tokenizer,
                [p.prompt_ids for p in prompts],
                max_new_tokens=r.max_new_tokens,
                temperature=r.temperature,
                top_p=r.top_p,
                do_sample=not greedy,
                batch_size=max(1, r.generation_batch_size // group),
                num_return_sequences=group,
            )
        examples = []
        for c in completions:
            trained = c.finished or not r.mask_truncated
            targets = [False] * len(c.prompt_ids) + [trained] * len(c.completion_ids)
            examples.append(Example(c.prompt_ids + c.completion_ids, targets, {}))
        return examples, completions

    def score(
        self, prompts: list[PromptExample], examples: list[Example], completions: list[Completion], group: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Total reward per completion ``[N]`` and each source's mean."""
        texts = [self.tokenizer.decode(c.completion_ids, skip_special_tokens=True) for c in completions]
        prompt_texts, fields = reward_inputs(prompts, group)
        total = torch.zeros(len(examples), device=self.device)
        per_source: dict[str, float] = {}
        if self.rewards is not None:
            functions, per_source = self.rewards(prompt_texts, texts, fields)
            total = total + torch.as_tensor(functions, dtype=torch.float32, device=self.device)
        if self.reward_model is not None:  # scored at each sequence's last token, on packed batches
            scores = torch.tensor(score_examples(self.reward_model, examples), device=self.device)
            total = total + self.cfg.reward.model_weight * scores
            per_source["reward_model"] = scores.mean().item()
        return total, per_source

    @torch.no_grad()
    def store(
        self, examples: list[Example], passes: dict[str, Callable[[PackedBatch], torch.Tensor]]
    ) -> None:
        """Run each no-grad pass (per-token values ``[T]``) on packed micro-batches; keep targets in meta."""
        budget = self.cfg.train.max_tokens_per_batch
        for group in budget_batches([len(e) for e in examples], budget, shuffle=False):
            chunk = [examples[i] for i in group]
            batch = pack(chunk, device=self.device)
            for key, run in passes.items():
                values = run(batch)[batch.loss_mask[0]].tolist()
                start = 0
                for e in chunk:
                    e.meta[key] = values[start : start + e.num_targets]
                    start += e.num_targets

    def plan(self, epoch: int) -> list[MicroBatch]:
        started = time.perf_counter()
        prompts = self.prompts_for(epoch)
        group = self.cfg.rollout.num_generations
        examples, completions = self.sample(prompts, self.cfg.train.seed * 1_000_003 + epoch, group)
        generated = time.perf_counter() - started
        total, per_source = self.score(prompts, examples, completions, group)
        lengths = [len(c.completion_ids) for c in completions]
        self.metrics[epoch] = {
            "rollout/reward": total.mean().item(),
            "rollout/reward_std": total.std().item() if total.numel() > 1 else 0.0,
            **{f"rollout/reward/{k}": v for k, v in per_source.items()},
            "rollout/completion_length": sum(lengths) / len(lengths),
            "rollout/completion_length_max": max(lengths),
            "rollout/truncated_fraction": sum(not c.finished for c in completions) / len(completions),
            "rollout/tokens_per_s": sum(lengths) / generated,
            **self.process(examples, total, epoch),
        }
        return self.micro_batches(examples, epoch)

    def process(self, examples: list[Example], rewards: torch.Tensor, epoch: int) -> dict[str, float]:
        """Advantages and whatever else the loss needs, into each example's meta; returns rollout metrics."""
        raise NotImplementedError

    def micro_batches(self, examples: list[Example], epoch: int) -> list[MicroBatch]:
        """``updates`` passes over the rollout, each split into ``mini_batches`` optimizer steps."""
        micros, step = [], 0
        budget = self.cfg.train.max_tokens_per_batch
        for update in range(self.updates):
            order = list(range(len(examples)))
            random.Random(self.cfg.train.seed + 7919 * epoch + update).shuffle(order)
            size = len(order) // self.mini_batches
            for m in range(self.mini_batches):
                mini = [examples[i] for i in order[m * size : (m + 1) * size]]
                for b in budget_batches([len(e) for e in mini], budget, seed=epoch + update + m):
                    chunk = [mini[i] for i in b]
                    if self.per_sequence_units:
                        units = sum(e.num_targets > 0 for e in chunk)
                    else:
                        units = sum(e.num_targets for e in chunk)
                    micros.append(MicroBatch(chunk, units, sum(len(e) for e in chunk), step=step))
                step += 1
        return micros

    def plan_metrics(self, epoch: int) -> dict[str, float]:
        return self.metrics.pop(epoch, {})

    def eval_plan(self) -> list[MicroBatch]:
        return []

    def on_evaluate(self, model: torch.nn.Module, step: int) -> dict[str, float]:
        """Greedy completions of the eval prompts, scored by the same rewards."""
        if not (self.eval_prompts and self.main_process):
            return {}
        examples, completions = self.sample(self.eval_prompts, seed=0, group=1, greedy=True)
        total, per_source = self.score(self.eval_prompts, examples, completions, 1)
        return {"reward": total.mean().item(), **{f"reward/{k}": v for k, v in per_source.items()}}


def check_engine(rollout: Any) -> None:
    """Only the Hugging Face ``generate`` engine exists yet: say so instead of quietly using it."""
    if rollout.engine == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise ValueError(
                "rollout.engine: vllm needs vLLM: pip install 'padless[vllm]', or use engine: hf"
            )
        raise ValueError(
            "rollout.engine: vllm is not implemented in this version of padless (no weight sync yet); "
            "use rollout.engine: hf"
        )


def load_prompts(spec: str, tokenizer: Any, data: Any) -> list[PromptExample]:
    from padless.data import load_rows, tokenize_prompts

    examples, _ = tokenize_prompts(
        load_rows(spec),
        tokenizer,
        max_prompt_length=data.max_prompt_length,
        chat_template=data.chat_template,
        skip_bad_rows=data.skip_bad_rows,
    )
    return examples


def load_rewards(reward: Any, device: torch.device) -> tuple[RewardComposer | None, torch.nn.Module | None]:
    from padless.model import load_model

    model = None
    if reward.model:
        model = load_model(reward.model, task="score", device=device).requires_grad_(False)
    return (RewardComposer(reward.functions, reward.weights) if reward.functions else None), model
