"""What GRPO and PPO share: prompts in seeded order, sampled rollouts, rewards, stored per-target values,
and mini-batch steps. Padding exists only inside the sampling engine; every scoring pass and update runs
on packed token-budget micro-batches. One "epoch" of the shared loop is one rollout.

With several data-parallel ranks, each rank samples, scores and runs the no-grad passes for its own slice
of the rollout's prompts (equal slices, fillers where prompts run out: every rank runs the same passes);
the slices are then gathered so every rank plans the same global steps. Every pass — sampling included —
goes through the prepared engine the recipe is bound to.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from padless.data import PromptExample, load_rows, reward_inputs
from padless.data.images import ImageInputs, from_png_text, png_text
from padless.data.prompts import PromptLayout
from padless.data.sources import require_scoring_model
from padless.data.tokenized import ExampleSet, load_set
from padless.errors import InputError
from padless.forward.engine import as_engine, inner_engine, reference_engine, unwrap
from padless.forward.packing import Example, PackedBatch, budget_batches, concat_vision, pack
from padless.forward.ranks import agreed, equal_share, gather_shares, lockstep
from padless.forward.vision import require_same_inputs
from padless.losses import soft_overlong_penalty
from padless.proof.load import disable_dropout, load_model, load_tokenizer, pad_token_id
from padless.rl.ahead import AheadSampler
from padless.rl.correction import importance_weights, mismatch_metrics
from padless.rl.episodes import EpisodeRunner, make_runner
from padless.rl.generate import Completion, Engine, HFEngine, eos_token_ids, row_seed
from padless.rl.rewards import RewardComposer, scored_mean
from padless.run.loop import MicroBatch, Recipe
from padless.run.reporting import report_data
from padless.run.session import Session, start_session
from padless.trainers.rm import score_examples

Pass = Callable[[PackedBatch], torch.Tensor]
log = logging.getLogger(__name__)


def per_target(examples: list[Example], key: str, device: torch.device) -> torch.Tensor:
    """Concatenate per-target values stored in ``meta[key]``, in packed target order."""
    return torch.tensor([v for e in examples for v in e.meta[key]], device=device, dtype=torch.float32)


class RolloutRecipe(Recipe):
    """Subclasses set ``updates`` and ``mini_batches`` and implement ``passes``, ``process`` and ``loss``."""

    updates: int = 1
    mini_batches: int = 1

    def __init__(
        self,
        prompts: Sequence[PromptExample],
        cfg: Any,
        tokenizer: Any,
        policy: torch.nn.Module,
        engine: Engine,
        device: torch.device,
        rewards: RewardComposer | None = None,
        reward_model: torch.nn.Module | None = None,
        eval_prompts: Sequence[PromptExample] | None = None,
        ref_model: torch.nn.Module | None = None,
        images: ImageInputs | None = None,
    ):
        """``policy``: the trained engine, replaced by its prepared form in :meth:`bind`; ``ref_model`` and
        ``reward_model``: prepared frozen engines; ``ref_model`` None for a LoRA policy (its adapters
        switched off) or when the recipe uses no reference; ``images``: the policy's image side
        (vision-language models), so each sample keeps its prompt's images in every pass."""
        self.prompts, self.cfg, self.tokenizer, self.policy = prompts, cfg, tokenizer, policy
        self.engine, self.device, self.rewards, self.reward_model = engine, device, rewards, reward_model
        self.eval_prompts, self.ref_model, self.images = eval_prompts or [], ref_model, images
        self.metrics: dict[int, dict[str, float]] = {}
        self.rollout: tuple[int, list[Example]] | None = None  # the current epoch's sampled data
        self._order: tuple[int, np.ndarray] | None = None
        # rollout.max_staleness > 0: samples the next rollouts, from a copy made before the policy is
        # prepared (whole, even where FSDP2 / ZeRO-3 will shard the trained one)
        self.ahead: AheadSampler | None = None
        if cfg.rollout.max_staleness > 0:
            self.ahead = AheadSampler(unwrap(inner_engine(as_engine(policy)).model), tokenizer, cfg.rollout)
        self.episodes: EpisodeRunner | None = None  # multi-turn episodes (rollout.environment / tools)
        self.rows: dict[tuple[str, int], dict[str, Any]] = {}  # the prompts' data rows, for environments
        if cfg.rollout.episodes():  # a vision-language policy's episodes keep their prompt's images
            self.episodes = make_runner(
                tokenizer,
                cfg.rollout,
                eos_token_ids(unwrap(inner_engine(as_engine(policy)).model), tokenizer),
                images,
            )

    def prompts_for(self, rollout: int) -> list[PromptExample]:
        """The rollout's prompts: consecutive slices of a fresh seeded permutation per pass over the data."""
        n, k = len(self.prompts), self.cfg.rollout.prompts_per_step
        return [
            self.prompts[self.order(position // n)[position % n]]
            for position in range(rollout * k, (rollout + 1) * k)
        ]

    def order(self, data_pass: int) -> np.ndarray:
        """The permutation of the prompts for one pass over them (the last one is kept)."""
        if self._order is None or self._order[0] != data_pass:
            order = list(range(len(self.prompts)))
            random.Random(self.cfg.train.seed + data_pass).shuffle(order)
            self._order = (data_pass, np.array(order))
        return self._order[1]

    def collect(
        self,
        prompts: list[PromptExample],
        group: int,
        seed: int,
        greedy: bool = False,
        epoch: int | None = None,
    ) -> list[Example]:
        """Sample ``group`` completions per prompt, score them and run the no-grad passes, each rank on its
        own contiguous slice of ``prompts``; returns every rank's examples in prompt order.

        Each example's meta holds ``reward``, ``reward/<source>``, ``length``, ``finished`` and (when
        the engine gives them) the sampler's per-target log-probs ``sampler_logps``; targets are the
        completion, or nothing when it was truncated and ``rollout.mask_truncated`` is set.
        """
        mine, real = equal_share(prompts, inner_engine(self.policy).topology)
        seeds = self.prompt_seeds(len(mine), seed)
        vision = [p.vision for p in mine] if self.images is not None else None
        if epoch is not None and self.cfg.rollout.max_staleness > 0:
            completions, elapsed, staleness = self.stale_completions(epoch, mine, group, seeds, vision)
        else:
            started = time.perf_counter()
            self.engine.sync_weights()
            if self.episodes is not None:
                completions = self.run_episodes(mine, group, seeds, greedy)
            else:
                completions = self.engine.complete([p.prompt_ids for p in mine], group, seeds, greedy, vision)
            elapsed, staleness = time.perf_counter() - started, None
        if not greedy and self.cfg.rollout.correction() and any(c.logprobs is None for c in completions):
            raise InputError(
                f"rollout.engine: {self.cfg.rollout.engine} returned no sampled-token log-probs, so the "
                "importance-sampling correction (on by default for this engine) cannot run; use "
                "rollout.engine: hf, or rollout.importance_sampling_correction: false to train uncorrected"
            )
        examples = []
        for j, c in enumerate(completions):
            prompt = mine[j // group]
            trained = c.finished or not self.cfg.rollout.mask_truncated
            model = c.model_mask or [True] * len(c.completion_ids)  # episodes: the environment's are context
            targets = [False] * len(c.prompt_ids) + [trained and m for m in model]
            meta = {
                "length": sum(model),
                "finished": c.finished,
                "sampling_s": elapsed,
                "prompt_row": prompt.meta["row"],  # finds the prompt's images again on resume
            }
            if c.logprobs is not None and not greedy:
                meta["sampler_logps"] = c.logprobs if trained else []
            if staleness is not None:
                meta["staleness"] = staleness
            if c.episode is not None:
                meta["episode"] = c.episode
            if c.env_images:  # saved with a rollout checkpointed mid-way (the prompt's are found again)
                meta["env_images"] = [png_text(image) for image in c.env_images]
            vision = prompt.vision if c.vision is None else c.vision  # an episode's: with its env's images
            examples.append(self.example(c.prompt_ids + c.completion_ids, targets, meta, vision))
        filler, examples = examples[0], examples[: real * group]
        self.score(mine[:real], examples, completions[: real * group], group, filler)
        if not greedy:
            passes = self.passes()
            if "sampler_logps" in filler.meta:  # the trainer's side of the mismatch, at sampling time
                passes.setdefault("old_logps", self.logps_pass(self.policy))
            self.store(examples, passes, filler)
        return gather_shares(examples, inner_engine(self.policy).topology)

    def run_episodes(
        self, prompts: list[PromptExample], group: int, seeds: list[int], greedy: bool
    ) -> list[Completion]:
        """``group`` multi-turn episodes per prompt (a prompt's consecutive), each built from the prompt's
        data row; logs how many were truncated and why (they are masked unless mask_truncated is off)."""
        assert self.episodes is not None
        rows = [self.row_of(p) for p in prompts for _ in range(group)]
        episode_seeds = [row_seed(s, k) for s in seeds for k in range(group)]
        starts = [p for p in prompts for _ in range(group)]
        episodes = self.episodes.run(self.engine, rows, episode_seeds, greedy, starts)
        cut = Counter(e.truncated for e in episodes if e.truncated is not None)
        if cut:
            what = (
                "masked from the loss" if self.cfg.rollout.mask_truncated else "trained (mask_truncated off)"
            )
            reasons = ", ".join(f"{n} by {why}" for why, n in sorted(cut.items()))
            log.warning(
                "rollout: %d of %d episodes truncated (%s); %s", cut.total(), len(episodes), reasons, what
            )
        return [e.completion(greedy) for e in episodes]

    def row_of(self, prompt: PromptExample) -> dict[str, Any]:
        """The data row a prompt was read from, as the environment receives it."""
        key = (prompt.meta["source"], prompt.meta["row"])
        if key not in self.rows:
            specs = [self.cfg.data.train] + ([self.cfg.data.eval] if self.cfg.data.eval else [])
            for spec in specs:
                self.rows.update({(r.source, r.index): r.data for r in load_rows(spec)})
        return self.rows[key]

    def prompt_seeds(self, count: int, seed: int) -> list[int]:
        """This rank's prompts' sampling seeds: a function of each prompt's place in the rollout."""
        first = inner_engine(self.policy).topology.rank * count  # this rank's first prompt
        return [seed + 104_729 * (first + i) for i in range(count)]

    def rollout_seed(self, epoch: int) -> int:
        return self.cfg.train.seed * 1_000_003 + epoch

    def stale_completions(
        self,
        epoch: int,
        mine: list[PromptExample],
        group: int,
        seeds: list[int],
        vision: list[dict[str, Any] | None] | None,
    ) -> tuple[list[Completion], float, int]:
        """``rollout.max_staleness`` k: queue the rollouts of the next k epochs (not yet queued) from the
        weights as they are now, then take this epoch's (sampled now, on-policy, when none was queued: the
        first rollout, or the first after a resume). Returns completions, seconds waited or spent sampling,
        and their staleness (updates between the weights they came from and now)."""
        k = self.cfg.rollout.max_staleness
        model = unwrap(inner_engine(self.policy).model)
        assert self.ahead is not None, "max_staleness > 0 builds the sampler with the recipe"
        steps = self.cfg.train.max_steps
        last = math.ceil(steps / self.steps_per_epoch()) - 1 if steps else epoch + k
        for later in range(epoch + 1, min(epoch + k, last) + 1):
            if not self.ahead.queued(later):
                share, _ = equal_share(self.prompts_for(later), inner_engine(self.policy).topology)
                self.ahead.queue(
                    later,
                    epoch,
                    model,
                    [p.prompt_ids for p in share],
                    group,
                    self.prompt_seeds(len(share), self.rollout_seed(later)),
                    [p.vision for p in share] if self.images is not None else None,
                )
        started = time.perf_counter()
        if self.ahead.queued(epoch):
            completions, _, version = self.ahead.take(epoch)
        else:
            self.engine.sync_weights()
            prompt_ids = [p.prompt_ids for p in mine]
            completions, version = self.engine.complete(prompt_ids, group, seeds, False, vision), epoch
        staleness = epoch - version
        if not 0 <= staleness <= k:
            raise RuntimeError(f"rollout {epoch} was sampled {staleness} updates ago, max_staleness is {k}")
        return completions, time.perf_counter() - started, staleness

    def score(
        self,
        prompts: list[PromptExample],
        examples: list[Example],
        completions: list[Completion],
        group: int,
        filler: Example,
    ) -> None:
        """Total reward per completion and each source's part, into meta."""
        totals = torch.zeros(len(examples))
        sources: dict[str, list[float | None]] = {}
        rewards = self.rewards

        def call() -> tuple[torch.Tensor, dict[str, list[float | None]]]:
            assert rewards is not None
            if not examples:  # a rank with only fillers still joins the agreement
                return torch.zeros(0), {}
            texts = [
                c.text
                if c.text is not None
                else self.tokenizer.decode(c.completion_ids, skip_special_tokens=True)
                for c in completions
            ]
            prompt_texts, fields = reward_inputs(prompts, group)
            return rewards(prompt_texts, texts, fields)

        if rewards is not None:  # a failure on one rank stops every rank here, together
            functions, sources = agreed(call, "a reward function")
            totals += functions
        if self.reward_model is not None:  # scored at each sequence's last token, on packed batches
            budget = self.cfg.train.max_tokens_per_batch
            scores = score_examples(self.reward_model, examples, max_tokens=budget, filler=filler)
            totals += self.cfg.reward.model_weight * torch.tensor(scores)
            sources["reward_model"] = scores
        if completions and completions[0].episode is not None:  # what the environments gave
            environment = [c.episode["env_reward"] for c in completions]
            totals += torch.tensor(environment)
            sources["environment"] = environment
        if self.cfg.reward.overlong_buffer:
            lengths = torch.tensor([len(c.completion_ids) for c in completions])
            penalty = soft_overlong_penalty(
                lengths,
                self.cfg.rollout.max_new_tokens,
                self.cfg.reward.overlong_buffer,
                self.cfg.reward.overlong_factor,
            )
            totals += penalty
            sources["overlong"] = penalty.tolist()
        for i, e in enumerate(examples):
            e.meta["reward"] = totals[i].item()
            e.meta.update({f"reward/{name}": values[i] for name, values in sources.items()})

    @torch.no_grad()
    def store(self, examples: list[Example], passes: dict[str, Pass], filler: Example) -> None:
        """Run each no-grad pass (per-token values ``[T]``) on packed micro-batches; keep targets in meta."""
        budget = self.cfg.train.max_tokens_per_batch
        groups = budget_batches([len(e) for e in examples], budget, shuffle=False) if examples else []
        for chunk, real in lockstep([[examples[i] for i in g] for g in groups], [filler]):
            batch = pack(chunk, device=self.device)
            for key, run in passes.items():
                values = run(batch)[batch.loss_mask[0]].tolist()
                if not real:
                    continue
                start = 0
                for e in chunk:
                    e.meta[key] = values[start : start + e.num_targets]
                    start += e.num_targets

    def bind(self, model: torch.nn.Module) -> None:
        """Sample and score through the prepared engine from now on."""
        self.policy = model
        if isinstance(self.engine, HFEngine):
            self.engine.policy = model

    def logps_pass(self, model: torch.nn.Module) -> Pass:
        temperature = self.cfg.rollout.temperature
        return lambda batch: model(batch, logps=True, temperature=temperature).logps

    def reference_pass(self) -> Pass:
        """Reference log-probs: from the frozen copy, or from the LoRA policy with its adapters off (the
        starting policy, without a second copy of the weights)."""

        def reference(batch: PackedBatch) -> torch.Tensor:
            with reference_engine(self.policy, self.ref_model) as model:
                return self.logps_pass(model)(batch)

        return reference

    def correct(self, examples: list[Example]) -> dict[str, float]:
        """Sampler vs trainer log-probs of the rollout: the mismatch metrics, and with
        ``rollout.importance_sampling_correction`` each target's weight ``is_weight`` for the policy loss."""
        if not examples or "sampler_logps" not in examples[0].meta:
            return {}
        r = self.cfg.rollout
        trainer, sampler = (
            torch.tensor([v for e in examples for v in e.meta[k]]) for k in ("old_logps", "sampler_logps")
        )
        if not r.correction():
            return mismatch_metrics(trainer, sampler)
        lengths = [e.num_targets for e in examples]
        weights, changed = importance_weights(
            trainer,
            sampler,
            lengths,
            r.importance_sampling_mode,
            r.importance_sampling_clip_min,
            r.importance_sampling_clip_max,
        )
        for e, w in zip(examples, weights.split(lengths), strict=True):
            e.meta["is_weight"] = w.tolist()
        return mismatch_metrics(trainer, sampler, weights, changed)

    def is_weights(self, examples: list[Example]) -> torch.Tensor | None:
        """The policy loss's per-target importance weights, None when the correction is off."""
        if "is_weight" not in examples[0].meta:
            return None
        return per_target(examples, "is_weight", self.device)

    def passes(self) -> dict[str, Pass]:
        """The no-grad per-token passes the loss needs, by meta key (old / reference log-probs, values)."""
        raise NotImplementedError

    def process(self, examples: list[Example], rewards: torch.Tensor, epoch: int) -> dict[str, float]:
        """Advantages and whatever else the loss needs, into each example's meta; returns rollout metrics."""
        raise NotImplementedError

    def steps_per_epoch(self) -> int:
        return self.updates * self.mini_batches

    def plan(self, epoch: int) -> list[MicroBatch]:
        if self.rollout is None or self.rollout[0] != epoch:
            examples, sampling = self.sample(epoch)
            rewards = torch.tensor([e.meta["reward"] for e in examples])
            self.metrics[epoch] = {
                **summary(examples, "rollout/"),
                **sampling,
                **self.correct(examples),
                **self.process(examples, rewards, epoch),
            }
            self.rollout = (epoch, examples)
        return self.micro_batches(self.rollout[1], epoch)

    def sample(self, epoch: int) -> tuple[list[Example], dict[str, float]]:
        """The rollout's scored examples (every rank's, in prompt order) and any sampling metrics."""
        seed = self.rollout_seed(epoch)
        return self.collect(self.prompts_for(epoch), self.cfg.rollout.num_generations, seed, epoch=epoch), {}

    def plan_state(self, epoch: int) -> list[dict[str, Any]]:
        """The sampled rollout with everything ``process`` stored, for a checkpoint taken mid-rollout."""
        assert self.rollout is not None and self.rollout[0] == epoch, "plan_state of a rollout not planned"
        return [{"input_ids": e.input_ids, "loss_mask": e.loss_mask, "meta": e.meta} for e in self.rollout[1]]

    def restore_plan(self, epoch: int, state: list[dict[str, Any]]) -> None:
        """The saved rollout back; image inputs come from the prompts (a checkpoint's plan holds tokens),
        followed by those of the images an episode's environment showed (saved as PNG)."""
        vision = {p.meta["row"]: p.vision for p in self.prompts} if self.images is not None else {}
        examples = []
        for e in state:
            images = vision.get(e["meta"]["prompt_row"])
            if self.images is not None and e["meta"].get("env_images"):
                shown = [from_png_text(text) for text in e["meta"]["env_images"]]
                images = concat_vision([images, self.images.inputs(shown)])
            examples.append(self.example(e["input_ids"], e["loss_mask"], e["meta"], images))
        self.rollout = (epoch, examples)

    def ahead_state(self) -> list[dict[str, Any]] | None:
        """The rollouts sampled ahead, not yet trained (``rollout.max_staleness``), for each checkpoint."""
        return self.ahead.pending() if self.ahead is not None and self.ahead.jobs else None

    def restore_ahead(self, state: list[dict[str, Any]]) -> None:
        """Take back what :meth:`ahead_state` saved: the resumed run trains on those very samples."""
        assert self.ahead is not None, "the contract drops rollouts sampled ahead when max_staleness changed"
        self.ahead.restore(state)

    def plan_settings(self) -> dict[str, Any]:
        """The RL settings a rollout is sampled, scored and trained with (the resume contract compares
        them): every key of ``data`` (the prompts), ``rollout``, ``reward`` and the trainer's section
        (``grpo`` / ``ppo``) except those that change no number (where and how the prompts are tokenized
        and cached, how many sequences one ``generate`` call takes, vLLM's memory share) and the value
        model's learning rate (the contract applies it to its parameter group)."""
        inert = {
            "data.cache_dir",
            "data.num_proc",
            "rollout.generation_batch_size",
            "rollout.vllm_gpu_memory_utilization",
            "ppo.value_learning_rate",
        }
        sections = [s for s in ("data", "rollout", "reward", "grpo", "ppo") if hasattr(self.cfg, s)]
        flat = {
            f"{s}.{k}": v for s in sections for k, v in getattr(self.cfg, s).model_dump(mode="json").items()
        }
        return {k: v for k, v in flat.items() if k not in inert}

    def example(
        self, ids: list[int], targets: list[bool], meta: dict[str, Any], vision: dict[str, Any] | None
    ) -> Example:
        """A sampled sequence; with a vision-language policy it carries its prompt's images and positions."""
        if self.images is None:
            return Example(ids, targets, meta)
        return self.images.example(ids, targets, vision, meta)

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
                    micros.append(MicroBatch(chunk, self.units(chunk), sum(len(e) for e in chunk), step=step))
                step += 1
        return micros

    def units(self, chunk: list[Example]) -> float:
        """A micro-batch's share of its step's loss normaliser: target tokens unless overridden."""
        return float(sum(e.num_targets for e in chunk))

    def plan_metrics(self, epoch: int) -> dict[str, float]:
        return self.metrics.pop(epoch, {})

    def on_evaluate(self, model: torch.nn.Module, step: int) -> dict[str, float]:
        """Greedy completions of the eval prompts (sharded over ranks), scored by the same rewards."""
        if not self.eval_prompts:
            return {}
        return summary(self.collect(self.eval_prompts, group=1, seed=0, greedy=True))


def summary(examples: list[Example], prefix: str = "") -> dict[str, float]:
    """Reward mean / std and per source, completion lengths, truncation, sampling tokens/s."""
    rewards = torch.tensor([e.meta["reward"] for e in examples])
    lengths = [e.meta["length"] for e in examples]
    sources = [k for k in examples[0].meta if k.startswith("reward/")]
    sampling_s = max(e.meta["sampling_s"] for e in examples)  # ranks sample at once: the slowest counts
    return {
        f"{prefix}reward": rewards.mean().item(),
        f"{prefix}reward_std": rewards.std().item() if len(examples) > 1 else 0.0,
        **{f"{prefix}{k}": scored_mean([e.meta[k] for e in examples]) for k in sources},
        f"{prefix}completion_length": sum(lengths) / len(lengths),
        f"{prefix}completion_length_max": max(lengths),
        f"{prefix}truncated_fraction": sum(not e.meta["finished"] for e in examples) / len(examples),
        f"{prefix}tokens_per_s": sum(lengths) / sampling_s,
        **staleness(examples, prefix),
        **episode_metrics(examples, prefix),
    }


def episode_metrics(examples: list[Example], prefix: str) -> dict[str, float]:
    """Multi-turn episodes: turns, tool calls and their success rate, environment tokens (masked from the
    loss), and the share of episodes truncated (by max_turns, the token budget or a turn's length)."""
    if "episode" not in examples[0].meta:
        return {}
    stats = [e.meta["episode"] for e in examples]
    n, calls = len(stats), sum(s["tool_calls"] for s in stats)
    failed = sum(s["failed_tool_calls"] for s in stats)
    return {
        f"{prefix}turns": sum(s["turns"] for s in stats) / n,
        f"{prefix}tool_calls": calls / n,
        f"{prefix}tool_call_success": (calls - failed) / calls if calls else math.nan,
        f"{prefix}env_tokens": sum(s["env_tokens"] for s in stats) / n,
        f"{prefix}truncated_episodes": sum(s["truncated_by"] is not None for s in stats) / n,
    }


def staleness(examples: list[Example], prefix: str) -> dict[str, float]:
    """How many updates old the weights were that sampled the rollout (``rollout.max_staleness``)."""
    if "staleness" not in examples[0].meta:
        return {}
    ages = [e.meta["staleness"] for e in examples]
    return {f"{prefix}staleness_mean": sum(ages) / len(ages), f"{prefix}staleness_max": float(max(ages))}


def make_engine(
    cfg: Any, policy: torch.nn.Module, tokenizer: Any, images: ImageInputs | None = None
) -> Engine:
    if cfg.rollout.max_staleness > 0 and cfg.rollout.engine == "vllm":
        raise InputError(
            f"rollout.max_staleness: {cfg.rollout.max_staleness} with rollout.engine: vllm: padless samples "
            "ahead on a copy of the policy in a thread beside training, and its vLLM engine holds one set of "
            "weights that every sync replaces (and, in process on CPU, pins torch to 1 thread, which would "
            "starve the training beside it); use rollout.engine: hf, or rollout.max_staleness: 0"
        )
    if cfg.rollout.engine == "vllm":
        if images is not None:
            raise ValueError(
                f"rollout.engine: vllm with {cfg.model.name}, a vision-language model: padless does not hand "
                "images to vLLM yet, so the samples would ignore them (vLLM's Qwen2-VL / Qwen2.5-VL code "
                "imports transformers' torchvision image processor, and no CPU build of torchvision installs "
                "here, so the path could not be tested; docs/guides/sampling.md: vLLM on CPU); set "
                "rollout.engine: hf"
            )
        from padless.rl.vllm_engine import VLLMEngine

        return VLLMEngine(policy, tokenizer, cfg.rollout, cfg.data.max_prompt_length, cfg.train.seed)
    return HFEngine(policy, tokenizer, cfg.rollout)


def without_dropout(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """RL models train without dropout (said in the log when some was on)."""
    if changed := disable_dropout(model):
        log.info("%s: %d dropout layers set to 0 (log-prob ratios compare like with like)", name, changed)
    return model


R = TypeVar("R", bound=RolloutRecipe)


@dataclass
class RolloutSetup:
    """What :func:`start_rl` builds and a rollout recipe is built from (see :class:`RolloutRecipe`)."""

    prompts: ExampleSet[PromptExample]
    cfg: Any
    tokenizer: Any
    policy: torch.nn.Module
    engine: Engine
    device: torch.device
    rewards: RewardComposer | None
    reward_model: torch.nn.Module | None
    eval_prompts: ExampleSet[PromptExample] | None
    ref_model: torch.nn.Module | None
    images: ImageInputs | None

    def recipe(self, cls: type[R]) -> R:
        """A ``cls`` recipe on this setup."""
        return cls(
            self.prompts,
            self.cfg,
            self.tokenizer,
            self.policy,
            self.engine,
            self.device,
            rewards=self.rewards,
            reward_model=self.reward_model,
            eval_prompts=self.eval_prompts,
            ref_model=self.ref_model,
            images=self.images,
        )


def start_rl(cfg: Any, reference: bool) -> tuple[Session, RolloutSetup]:
    """The session and everything a rollout recipe is built from: prompts, engine, rewards, and (if
    ``reference``, and the policy has no LoRA adapters to switch off) a frozen reference copy."""
    session = start_session(cfg.model, cfg.train.seed, cfg.train.output_dir, cfg)
    without_dropout(session.model, "policy")
    tokenizer, device, data = session.tokenizer, session.accelerator.device, cfg.data
    images = session.images

    def prompts(spec: str, role: str) -> ExampleSet[PromptExample]:
        layout = PromptLayout(
            max_prompt_length=data.max_prompt_length,
            chat_template=data.chat_template,
            skip_bad_rows=data.skip_bad_rows,
        )
        examples, stats = load_set(
            spec, layout, tokenizer, images=images, cache_dir=data.cache_dir, num_proc=data.num_proc
        )
        report_data(stats, role, spec, cfg.train.output_dir)
        return examples

    reward_model = None
    if cfg.reward.model:
        require_scoring_model(cfg.reward.model)
        trust = cfg.model.trust_remote_code
        pad_id = pad_token_id(load_tokenizer(cfg.reward.model, trust))  # where its scores are read
        scorer = load_model(
            cfg.reward.model,
            task="score",
            device=device,
            pad_id=pad_id,
            trust_remote_code=trust,
            varlen_kernel=session.settings.varlen_kernel,
        )
        require_same_inputs(session.model, scorer, f"reward.model {cfg.reward.model}")
        reward_model = session.frozen(scorer)
    return session, RolloutSetup(
        prompts=prompts(data.train, "train"),
        cfg=cfg,
        tokenizer=tokenizer,
        policy=session.model,
        engine=make_engine(cfg, session.model, tokenizer, images),
        device=device,
        rewards=RewardComposer(cfg.reward.functions, cfg.reward.weights) if cfg.reward.functions else None,
        reward_model=reward_model,
        eval_prompts=prompts(data.eval, "eval") if data.eval else None,
        ref_model=session.frozen(session.companion()) if reference and cfg.model.lora is None else None,
        images=images,
    )
