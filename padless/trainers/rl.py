"""What GRPO and PPO share: prompts in seeded order, sampled and scored rollouts, the no-grad passes that
store per-target values, and mini-batch steps. Padding exists only inside the sampling engine; every scoring
pass and update runs on packed token-budget micro-batches. One "epoch" of the shared loop is one rollout.

With several data-parallel ranks, each rank samples and scores its own slice of the rollout's prompts
(equal slices, fillers where prompts run out: every rank runs the same passes); the slices are then
gathered so every rank plans the same global steps, and the no-grad passes run on that plan's
micro-batches, dealt out between ranks: every number is the one a single process computes. Every pass —
sampling included — goes through the prepared engine the recipe is bound to. Sampling is the
:class:`Sampler` the factory builds (:mod:`padless.rl.sampling`), scoring the setup's
:class:`~padless.rl.scoring.Scorer`; what the recipe learns about each sample is a typed
:class:`~padless.rl.sample.Sample`.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from padless.forward.engine import inner_engine, reference_engine
from padless.forward.packing import PackedBatch, pack
from padless.forward.passes import lockstep_pass
from padless.forward.ranks import equal_share, gather_shares
from padless.forward.tree import plan_batches
from padless.rl.correction import correct
from padless.rl.sample import Sample, per_target, summary
from padless.rl.sampler import Request, revive
from padless.rl.sampling import Parts, make_sampler
from padless.rl.setup import RolloutSetup
from padless.run.loop import MicroBatch, Recipe

Pass = Callable[[PackedBatch], torch.Tensor]


def unreplayed(run: Pass) -> Pass:
    """``run`` on batches without the sampler's routes (routing replay): the model routes as it does."""
    return lambda batch: run(dataclasses.replace(batch, routes=None))


class RolloutRecipe(Recipe):
    """Subclasses set ``updates`` and ``mini_batches`` and implement ``passes``, ``process`` and ``loss``."""

    updates: int = 1
    mini_batches: int = 1
    tree = False  # whether the bound engine runs tree rows (set in bind)

    def __init__(self, setup: RolloutSetup):
        self.setup, self.cfg, self.prompts, self.policy = setup, setup.cfg, setup.prompts, setup.policy
        self.device, self.scorer, self.images = setup.device, setup.scorer, setup.images
        self.topology = setup.topology  # which share of each rollout this process samples
        self.metrics: dict[int, dict[str, float]] = {}
        self.rollout: tuple[int, list[Sample]] | None = None  # the current epoch's samples
        self._order: tuple[int, np.ndarray] | None = None
        self._vision: dict[int, Any] | None = None  # each training prompt row's image inputs (VLMs)
        self.check_episode_budget()
        self.sampler = make_sampler(
            Parts(self.cfg, setup.engine, setup.tokenizer, setup.policy, setup.images, self.scheduled)
        )

    def check_episode_budget(self) -> None:
        """At start, not after sampling: a prompt as long as ``rollout.max_episode_tokens`` leaves its
        episodes no model turn (each environment's first messages are checked again when an episode
        starts)."""
        budget = self.cfg.rollout.max_episode_tokens
        longest = max(self.prompts, key=len, default=None) if budget is not None else None
        if longest is not None and len(longest) >= budget:
            raise ValueError(  # an input error (exit 2), as every ValueError
                f"rollout.max_episode_tokens={budget}: row {longest.row} of {longest.source} is a prompt of "
                f"{len(longest)} tokens, leaving its episodes no room for the model's turn; fix: raise "
                f"rollout.max_episode_tokens above {len(longest)} (e.g. by max_turns x max_new_tokens), or "
                "shorten the prompts (data.max_prompt_length with data.skip_bad_rows leaves longer ones out)"
            )

    # -- planning: which prompts, which seeds -----------------------------------------------------------

    def prompts_for(self, rollout: int) -> list[Any]:
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

    def rollout_seed(self, epoch: int) -> int:
        return self.cfg.train.seed * 1_000_003 + epoch

    def request(
        self, prompts: list[Any], group: int, seed: int, greedy: bool = False, epoch: int | None = None
    ) -> tuple[Request, int]:
        """This rank's share of ``prompts`` (fillers where it runs out) as a request, and how many of its
        prompts are real. Each prompt's seed is a function of its place among ``prompts`` alone."""
        seeds = [seed + 104_729 * i for i in range(len(prompts))]
        mine, real = equal_share(list(zip(prompts, seeds, strict=True)), self.topology)
        share = [p for p, _ in mine]
        return Request(share, group, [s for _, s in mine], greedy, epoch), real

    def scheduled(self, epoch: int) -> Request | None:
        """Rollout ``epoch``'s request on this rank; None past the last rollout (``train.max_steps``)."""
        steps = self.cfg.train.max_steps
        if steps and epoch > math.ceil(steps / self.steps_per_epoch()) - 1:
            return None
        group = self.cfg.rollout.num_generations
        return self.request(self.prompts_for(epoch), group, self.rollout_seed(epoch), epoch=epoch)[0]

    # -- a rollout: sampled, scored, passes stored ----------------------------------------------------

    def collect(
        self, prompts: list[Any], group: int, seed: int, greedy: bool = False, epoch: int | None = None
    ) -> list[Sample]:
        """Sample ``group`` completions per prompt and score them, each rank on its own contiguous slice of
        ``prompts``; returns every rank's samples in prompt order. Targets are the completion's model
        tokens, or none when it was truncated and ``rollout.mask_truncated`` is set. The no-grad passes run
        later, on the planned rollout (:meth:`store`)."""
        request, real = self.request(prompts, group, seed, greedy, epoch)
        samples = self.sampler.sample(request)
        filler, samples = samples[0], samples[: real * group]
        self.scorer.score(request.prompts[:real], samples, group, filler)
        return gather_shares(samples, self.topology)

    def rollout_passes(self, samples: list[Sample]) -> dict[str, Pass]:
        """The recipe's no-grad passes, and where the sampler reported its log-probs the trainer's side of
        the mismatch (old log-probs; with routing replay also those without the sampler's routes)."""
        passes = self.passes()
        if samples and samples[0].drawn.logps is not None:
            passes.setdefault("old_logps", self.logps_pass(self.policy))
            if self.cfg.rollout.routing_replay:
                passes["unreplayed_logps"] = unreplayed(self.logps_pass(self.policy))
        return passes

    def store(
        self, samples: list[Sample], plan: list[MicroBatch], passes: dict[str, Pass] | None = None
    ) -> None:
        """Run each no-grad pass (per-token values ``[T]``; by default :meth:`rollout_passes`) and keep each
        sample's targets' values in its :class:`~padless.rl.sample.Passes` field of that name, on every rank.

        The passes run on the very micro-batches of ``plan`` (the rollout's global plan) that its first
        pass over the rollout trains, dealt out between ranks in lockstep and gathered
        (:func:`~padless.forward.passes.lockstep_pass`); samples no step of that pass trains (a rollout that
        does not split evenly into mini-batches) are packed on their own.
        A sample's values then come from the same packed row whatever the number of ranks, and at a
        rollout's first step (the weights that ran the passes) the training forward gives them back
        exactly: a round-off difference there (~1e-6, from another packing) is a gradient from nothing
        that Adam, dividing by its running RMS, turns into a step of the whole learning rate."""
        passes = self.rollout_passes(samples) if passes is None else passes
        if not passes or not samples:
            return

        def run(chunk: list[Sample]) -> list[dict[str, list[float]]]:
            batch = pack(chunk, device=self.device)
            out: list[dict[str, list[float]]] = [{} for _ in chunk]
            for key, values in ((k, p(batch)[batch.loss_mask[0]].tolist()) for k, p in passes.items()):
                start = 0
                for kept, s in zip(out, chunk, strict=True):
                    kept[key] = values[start : start + s.num_targets]
                    start += s.num_targets
            return out

        index = {id(s): i for i, s in enumerate(samples)}
        first = [
            [index[id(s)] for s in m.data] for m in plan if m.step is not None and m.step < self.mini_batches
        ]
        lengths, budget = [len(s) for s in samples], self.cfg.train.max_tokens_per_batch
        stored = lockstep_pass(
            samples, lengths, run, budget, share=self.topology, tree=self.tree, planned=first
        )
        for sample, values in zip(samples, stored, strict=True):
            for key, kept in values.items():
                setattr(sample.passes, key, kept)

    def bind(self, model: torch.nn.Module) -> None:
        """Sample and score through the prepared engine from now on; plan micro-batches by the tokens of
        its tree rows where it runs them (a group's prompt once)."""
        self.policy = model
        self.tree = inner_engine(model).tree
        self.sampler.bind(model)

    def logps_pass(self, model: torch.nn.Module) -> Pass:
        temperature = self.cfg.rollout.temperature
        return lambda batch: model(batch, logps=True, temperature=temperature).logps

    def reference_pass(self) -> Pass:
        """Reference log-probs: from the frozen copy, or from the LoRA policy with its adapters off (the
        starting policy, without a second copy of the weights)."""

        def reference(batch: PackedBatch) -> torch.Tensor:
            with reference_engine(self.policy, self.setup.ref_model) as model:
                return self.logps_pass(model)(batch)

        return unreplayed(reference)  # the reference routes its own way

    def is_weights(self, samples: list[Sample]) -> torch.Tensor | None:
        """The policy loss's per-target importance weights, None when the correction is off."""
        if samples[0].algorithm.is_weights is None:
            return None
        return per_target([s.algorithm.is_weights for s in samples], self.device)

    def passes(self) -> dict[str, Pass]:
        """The no-grad per-token passes the loss needs, by :class:`~padless.rl.sample.Passes` field."""
        raise NotImplementedError

    def process(self, samples: list[Sample], epoch: int) -> dict[str, float]:
        """Advantages and whatever else the loss needs, from each sample's ``scored`` and ``passes`` into its
        ``algorithm``; returns metrics."""
        raise NotImplementedError

    def sample(self, epoch: int) -> tuple[list[Sample], dict[str, float]]:
        """The rollout's scored samples (every rank's, in prompt order) and any sampling metrics."""
        seed = self.rollout_seed(epoch)
        return self.collect(self.prompts_for(epoch), self.cfg.rollout.num_generations, seed, epoch=epoch), {}

    # -- the loop's contract --------------------------------------------------------------------------

    def steps_per_epoch(self) -> int:
        return self.updates * self.mini_batches

    def plan(self, epoch: int) -> list[MicroBatch]:
        if self.rollout is not None and self.rollout[0] == epoch:
            return self.micro_batches(self.rollout[1], epoch)
        samples, sampling = self.sample(epoch)
        micros = self.micro_batches(samples, epoch)
        self.store(samples, micros)  # the no-grad passes, on the micro-batches the steps train
        self.metrics[epoch] = {
            **summary(samples, "rollout/"),
            **sampling,
            **correct(samples, self.cfg.rollout),
            **self.process(samples, epoch),
        }
        self.rollout = (epoch, samples)
        return micros

    def plan_metrics(self, epoch: int) -> dict[str, float]:
        return self.metrics.pop(epoch, {})

    def state(self, epoch: int, mid_epoch: bool) -> dict[str, Any] | None:
        """The rollout being trained when a checkpoint is taken mid-way through it (with everything
        ``process`` stored), and the rollouts sampled ahead, not yet trained (``rollout.max_staleness``)."""
        rollout = None
        if mid_epoch:
            assert self.rollout is not None and self.rollout[0] == epoch, (
                "a checkpoint of a rollout not planned"
            )
            rollout = [s.state() for s in self.rollout[1]]
        ahead = self.sampler.state()
        return None if rollout is None and ahead is None else {"rollout": rollout, "ahead": ahead}

    def restore(self, epoch: int, state: dict[str, Any]) -> None:
        """Take back what :meth:`state` saved: a resumed run trains on those very samples. Image inputs come
        from the prompts (a checkpoint holds tokens), then those of the images an environment showed. What
        does not fit this run is refused (``ValueError``): a rollout of another size, a sample whose values
        do not match its targets, rollouts queued ahead other than the next ``max_staleness`` or of another
        size."""
        if not isinstance(state, dict) or set(state) != {"rollout", "ahead"}:
            raise ValueError("it is not a rollout state ({'rollout': ..., 'ahead': ...})")
        rollout = self.cfg.rollout
        if state["rollout"] is not None:
            size = rollout.prompts_per_step * rollout.num_generations
            if len(state["rollout"]) != size:
                raise ValueError(
                    f"its rollout holds {len(state['rollout'])} samples; this run's rollouts hold {size} "
                    "(rollout.prompts_per_step x rollout.num_generations)"
                )
            self.rollout = (epoch, [self.revive(s).check() for s in state["rollout"]])
        if rollout.max_staleness > 0:
            self.check_ahead(epoch + 1 if state["rollout"] is not None else epoch, state["ahead"] or [])
        if state["ahead"] is not None:
            self.sampler.restore(state["ahead"], lambda s: self.revive(s).check())

    def check_ahead(self, first: int, ahead: list[dict[str, Any]]) -> None:
        """The rollouts sampled ahead in a checkpoint must be the queue this run keeps from rollout ``first``
        on (the next ``max_staleness`` scheduled ones: queued when the one before ``first`` was sampled), each
        of this rank's size and at most ``max_staleness`` updates old."""
        k, group = self.cfg.rollout.max_staleness, self.cfg.rollout.num_generations
        wanted = [e for e in range(first, first + k) if self.scheduled(e) is not None]
        queued = [r["epoch"] for r in ahead]
        if queued != wanted:
            raise ValueError(
                f"it holds the rollouts {queued} sampled ahead; with rollout.max_staleness={k} the queue "
                f"there holds {wanted}"
            )
        for r in ahead:
            size = len(self.scheduled(r["epoch"]).prompts) * group
            if not 0 <= r["epoch"] - r["version"] <= k or len(r["samples"]) != size:
                raise ValueError(
                    f"its rollout {r['epoch']} sampled ahead holds {len(r['samples'])} samples from the "
                    f"weights of rollout {r['version']}; this rank samples {size}, at most {k} updates old"
                )

    def revive(self, state: dict[str, Any]) -> Sample:
        """A saved sample back, with its training prompt's image inputs (vision-language policies)."""
        if self.images is not None and self._vision is None:
            self._vision = {p.row: p.vision for p in self.prompts}
        row = state["drawn"]["prompt_row"]
        return revive(state, self.images, None if self._vision is None else self._vision.get(row))

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

    def micro_batches(self, samples: list[Sample], epoch: int) -> list[MicroBatch]:
        """``updates`` passes over the rollout, each split into ``mini_batches`` optimizer steps."""
        micros, step = [], 0
        budget = self.cfg.train.max_tokens_per_batch
        for update in range(self.updates):
            order = list(range(len(samples)))
            random.Random(self.cfg.train.seed + 7919 * epoch + update).shuffle(order)
            size = len(order) // self.mini_batches
            for m in range(self.mini_batches):
                mini = [samples[i] for i in order[m * size : (m + 1) * size]]
                for b in plan_batches(mini, budget, self.tree, seed=epoch + update + m, shuffle=True):
                    chunk = [mini[i] for i in b]
                    micros.append(MicroBatch(chunk, self.units(chunk), sum(len(s) for s in chunk), step=step))
                step += 1
        return micros

    def units(self, chunk: list[Sample]) -> float:
        """A micro-batch's share of its step's loss normaliser: target tokens unless overridden."""
        return float(sum(s.num_targets for s in chunk))

    def on_evaluate(self, model: torch.nn.Module, step: int) -> dict[str, float]:
        """Greedy completions of the eval prompts (sharded over ranks), scored by the same rewards."""
        if not self.setup.eval_prompts:
            return {}
        return summary(self.collect(list(self.setup.eval_prompts), group=1, seed=0, greedy=True))
