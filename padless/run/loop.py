"""The one training loop every trainer shares.

A trainer is a :class:`Recipe`: it plans the epoch's micro-batches (the same global list on every rank)
and computes a micro-batch's loss as a share of the step's loss. The loop does the rest: sharding
micro-batches across data-parallel ranks, the global normaliser, gradient accumulation, clipping,
optimizer and schedule, logging, evaluation, checkpoints and exact resume.

Every hook the loop calls is declared on :class:`Recipe`, with what it does where a recipe does not
override it: a recipe that runs passes outside ``loss`` (reference precompute, rollouts) overrides ``bind``;
one whose plan is costly and not reproducible from a seed (a sampled rollout) overrides
``steps_per_epoch``, ``state`` / ``restore`` and ``plan_metrics``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm
from transformers import get_scheduler

from padless.errors import DivergenceError, InputError, Terminated, UserCodeError, is_input_error
from padless.faults import FileFault, doing
from padless.forward import ranks
from padless.forward.engine import ModelEngine
from padless.forward.packing import balance_ranks
from padless.run import contract
from padless.run.checkpoint import (
    TrainState,
    load_checkpoint,
    read_recipe_state,
    read_state,
    recipe_file,
    save_checkpoint,
    written_terms,
)
from padless.run.guard import DivergenceGuard
from padless.run.interrupts import deferred, take_held
from padless.run.reporting import Reporter
from padless.run.rundir import branch, checkpoints, end_run, resume_checkpoint, rotate_checkpoints
from padless.run.strategy import expected_strategy, verify_strategy
from padless.run.verify import verify_checkpoint

log = logging.getLogger(__name__)
IDLE_LIMIT = 3  # epochs / rollouts in a row with nothing to train before the run stops

SCHEDULERS = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}


@dataclass
class MicroBatch:
    """One forward / backward. ``units`` count into the step's normaliser (target tokens, pairs, ...)."""

    data: Any
    units: float
    tokens: int
    scale: float = 1.0  # 0 for a filler that keeps a rank without data in step with the others
    step: int | None = None  # set by recipes whose steps are fixed sets of data (RL mini-batches)

    def read(self) -> MicroBatch:
        """This micro-batch with its data in memory: a selection of an on-disk set is read here, once, right
        before its forward, and dropped after (a plan holds only indices)."""
        return self if isinstance(self.data, list) else replace(self, data=list(self.data))


class Recipe:
    """What a trainer gives the loop: every hook the loop calls, each with its behaviour where a recipe
    does not override it. Every recipe overrides :meth:`plan` and :meth:`loss`."""

    def plan(self, epoch: int) -> list[MicroBatch]:
        """The epoch's micro-batches in order: the same global list on every rank, seeded by epoch."""
        raise NotImplementedError(f"{type(self).__name__} plans no micro-batches")

    def loss(
        self, model: torch.nn.Module, micro: MicroBatch, normaliser: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss of ``micro`` as its share of the step loss, plus metric shares that sum to step metrics."""
        raise NotImplementedError(f"{type(self).__name__} computes no loss")

    def eval_plan(self) -> list[MicroBatch]:
        """Evaluation micro-batches (the loop sums ``loss`` metrics over them); none by default."""
        return []

    def on_evaluate(self, model: torch.nn.Module, step: int) -> dict[str, float]:
        """Evaluation beyond the loss metrics (e.g. generation), run on every rank; none by default."""
        return {}

    def bind(self, model: torch.nn.Module) -> None:
        """Hand the recipe the prepared engine, once, before training: the only model object every pass
        outside ``loss`` (reference precompute, rollouts) may go through."""

    def steps_per_epoch(self) -> int | None:
        """Optimizer steps per epoch, said without planning (a sampled rollout is costly to plan); None:
        the loop counts them on the plans."""
        return None

    def state(self, epoch: int, mid_epoch: bool) -> Any | None:
        """What a checkpoint at ``epoch`` (``mid_epoch``: some of its steps trained) must keep for the run
        to continue on the same data, as JSON data saved by each rank: a plan that cannot be rebuilt from
        its seed (a sampled rollout), data prepared ahead and not yet trained (rollouts sampled ahead).
        None: nothing, the plan is rebuilt from its seed."""
        return None

    def restore(self, epoch: int, state: Any) -> None:
        """Take back what :meth:`state` saved, so a resumed run continues on the same data."""
        raise NotImplementedError(f"{type(self).__name__} saves no state to restore")

    def plan_metrics(self, epoch: int) -> dict[str, float]:
        """Metrics of the epoch's planning (what a rollout measured), logged once per epoch; none by
        default."""
        return {}

    def plan_settings(self) -> dict[str, Any]:
        """Settings beyond ``train``'s that the plan is built from (RL: rollout, reward and loss keys); the
        resume contract compares them like the data plan. None by default."""
        return {}


@dataclass
class Step:
    micros: list[MicroBatch]  # this rank's share
    normaliser: float  # loss units of the whole step, all ranks
    tokens: int  # real tokens of the whole step, all ranks


def plan_steps(micros: list[MicroBatch], accumulation: int, num_ranks: int, rank: int) -> list[Step]:
    """Group an epoch's micro-batches into optimizer steps and take this rank's share of each.

    Steps hold ``accumulation`` micro-batches per rank, unless the recipe numbered its micro-batches'
    ``step`` itself (then each numbered group is one step, whatever its size). Every rank gets the same
    number of micro-batches in every step — zero-weight fillers make up a short share — because sharded
    engines (FSDP2, ZeRO-3) gather and reduce in every forward and backward: uneven counts deadlock.
    """
    if micros and micros[0].step is not None:
        groups = [list(g) for _, g in itertools.groupby(micros, key=lambda m: m.step)]
    else:
        per_step = accumulation * num_ranks
        groups = [micros[i : i + per_step] for i in range(0, len(micros), per_step)]
    steps = []
    for group in groups:
        per_rank = math.ceil(len(group) / num_ranks)
        mine = [group[i] for i in balance_ranks([m.tokens for m in group], num_ranks, per_rank)[rank]]
        filler = replace(min(group, key=lambda m: m.tokens), scale=0.0)
        mine += [filler] * (per_rank - len(mine))
        steps.append(Step(mine, max(sum(m.units for m in group), 1e-12), sum(m.tokens for m in group)))
    return steps


def parameter_groups(
    model: torch.nn.Module, lr: float, weight_decay: float, learning_rates: dict[str, float]
) -> list[dict[str, Any]]:
    """AdamW groups: no weight decay on biases and norms; prefixes in ``learning_rates`` get their own lr.
    Groups are keyed by prefix, not rate, so their layout (which the optimizer state follows) stays the same
    whatever the rates are (the resume contract rescales each on its own)."""
    groups: dict[tuple[str, float], list[torch.nn.Parameter]] = defaultdict(list)
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        prefix = next((k for k in learning_rates if name.startswith(k)), contract.DEFAULT_GROUP)
        groups[(prefix, weight_decay if param.dim() >= 2 else 0.0)].append(param)
    rates = {contract.DEFAULT_GROUP: lr, **learning_rates}
    return [
        {"params": p, "lr": rates[prefix], "weight_decay": wd, "name": prefix}
        for (prefix, wd), p in groups.items()
    ]


class Trainer:
    def __init__(
        self,
        recipe: Recipe,
        model: torch.nn.Module,
        tokenizer: Any,
        settings: Any,
        accelerator: Accelerator,
        learning_rates: dict[str, float] | None = None,
    ):
        """``learning_rates`` maps parameter-name prefixes (e.g. ``"value."``) to their own learning rate;
        the rest train at ``settings.learning_rate``. The schedule scales every group alike."""
        self.recipe, self.tokenizer, self.cfg, self.acc = recipe, tokenizer, settings, accelerator
        groups = parameter_groups(model, settings.learning_rate, settings.weight_decay, learning_rates or {})
        # the rates as configured: the scheduler rewrites each group's lr in place (0 at the start of warmup)
        configured = [{"name": g["name"], "lr": g["lr"]} for g in groups]
        optimizer = torch.optim.AdamW(
            groups,
            lr=settings.learning_rate,
            betas=(settings.adam_beta1, settings.adam_beta2),
            eps=settings.adam_epsilon,
        )
        # which share of each step this process trains: the engine's (made at run start)
        self.topology = model.topology if isinstance(model, ModelEngine) else ranks.start()
        self.planned: tuple[int, list[Step]] | None = None
        self.total_steps = self._count_steps()
        warmup = settings.warmup_steps or math.ceil(settings.warmup_ratio * self.total_steps)
        # The scheduler is not passed to prepare(): accelerate would step it once per process.
        self.scheduler = get_scheduler(
            SCHEDULERS[settings.lr_scheduler],
            optimizer,
            num_warmup_steps=warmup,
            num_training_steps=self.total_steps,
        )
        digest = None if recipe.steps_per_epoch() is not None else contract.plan_digest(self.steps_of(0))
        self.terms = contract.terms(
            recipe, getattr(model, "model", model), settings, self.topology.world, digest, configured
        )
        self.terms["total_steps"] = self.total_steps
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        float16 = any(p.dtype == torch.float16 for p in model.parameters())
        self.guard = DivergenceGuard(settings.on_nonfinite, accelerator, float16)
        self.strategy = expected_strategy(accelerator)
        verify_strategy(accelerator, self.model, self.strategy)
        recipe.bind(self.model)

    def steps_of(self, epoch: int) -> list[Step]:
        """The epoch's steps for this rank; one epoch's plan is kept at a time (a rollout's data is large)."""
        if self.planned is None or self.planned[0] != epoch:
            micros = self.recipe.plan(epoch)
            rank, world = self.topology.rank, self.topology.world  # a sequence-parallel group shares one
            steps = plan_steps(micros, self.cfg.gradient_accumulation_steps, world, rank)
            stated = self.recipe.steps_per_epoch()
            if stated is not None and stated != len(steps):
                raise RuntimeError(
                    f"{type(self.recipe).__name__} stated {stated} steps per epoch but planned "
                    f"{len(steps)} for epoch {epoch}: the schedule would be wrong"
                )
            self._check_trainable(epoch, micros)
            self.planned = (epoch, steps)
        return self.planned[1]

    def _check_trainable(self, epoch: int, micros: list[MicroBatch]) -> None:
        """An epoch whose data has no target at all (a rollout whose every completion was truncated and
        masked) trains nothing: said each time, and after :data:`IDLE_LIMIT` in a row the run stops."""
        if not micros or any(m.units > 0 for m in micros):
            self._idle = 0
            return
        self._idle = getattr(self, "_idle", 0) + 1
        why = (
            "every target token is masked (in RL: every completion hit rollout.max_new_tokens without EOS "
            "and rollout.mask_truncated is true)"
        )
        fix = "raise rollout.max_new_tokens, or set rollout.mask_truncated=false to train on truncated ones"
        if self._idle >= IDLE_LIMIT:
            raise InputError(
                f"{self._idle} epochs / rollouts in a row had nothing to train on: {why}; fix: {fix}"
            )
        log.warning(
            "epoch %d has nothing to train on: %s; its steps change nothing. Fix: %s", epoch, why, fix
        )

    def _count_steps(self) -> int:
        """Total optimizer steps: ``max_steps`` if set, else those of ``num_epochs`` epochs (the last may be
        partial), each epoch counted on its own plan: token-budget packing differs from epoch to epoch."""
        cfg = self.cfg

        def per_epoch(epoch: int) -> int:
            stated = self.recipe.steps_per_epoch()  # recipes with costly plans say it
            return stated if stated is not None else len(self.steps_of(epoch))

        if per_epoch(0) == 0:
            raise ValueError("the training data produced no micro-batch: is the dataset empty?")
        if cfg.max_steps > 0:
            return cfg.max_steps
        whole, part = divmod(cfg.num_epochs, 1)
        total = sum(per_epoch(epoch) for epoch in range(int(whole)))
        if part:
            total += math.ceil(part * per_epoch(int(whole)))
        return max(1, total)

    def _train_step(self, step: Step) -> dict[str, float]:
        """One optimizer step through accelerate's own accumulation switch: DDP and FSDP2 skip the
        gradient sync and DeepSpeed its engine step on every micro-batch but the last."""
        sums: dict[str, float] = defaultdict(float)
        world = self.acc.num_processes
        for k, micro in enumerate(step.micros):
            last = k == len(step.micros) - 1
            self.acc.sync_gradients = last
            with contextlib.nullcontext() if last else self.acc.no_sync(self.model):
                with self._routed() as routed:
                    loss, metrics = self.recipe.loss(self.model, micro.read(), step.normaliser)
                if routed is not None and routed.weighted is not None:
                    # a MoE's load-balancing loss, each forward weighted by its share of the step's tokens
                    loss = loss + routed.weighted / step.tokens
                    metrics = {**metrics, "aux_loss": routed.plain / step.tokens}
                self.guard.watch(loss, k, len(step.micros))
                # Ranks average gradients; the normaliser is already global, so undo the mean. Under
                # sequence parallelism each rank's gradient is its chunk's share: the sum over all
                # processes is then the sum over data-parallel groups of whole-row gradients.
                self.acc.backward(loss * (micro.scale * world))
            for key, value in metrics.items():
                sums[key] += value * micro.scale
        if self.cfg.max_grad_norm > 0:
            sums["grad_norm"] = float(
                self.acc.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
            )
        if self.guard.allow_step(sums.get("grad_norm")):
            self.optimizer.step()
        else:
            sums.clear()  # a skipped step adds nothing to the metrics
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = self._sum_over_ranks(sums)
        if "grad_norm" in metrics:  # the same on every rank, not a share to sum
            metrics["grad_norm"] /= self.topology.world
        return metrics

    def _routed(self) -> contextlib.AbstractContextManager:
        """The engine's record of the router load-balancing terms of a micro-batch's training forwards
        (:mod:`padless.forward.routers`); yields ``None`` where there are none."""
        engine = getattr(self.model, "module", self.model)
        return engine.recording() if isinstance(engine, ModelEngine) else contextlib.nullcontext()

    def train(self) -> dict[str, float]:
        cfg, acc = self.cfg, self.acc
        resume = resume_checkpoint(cfg.output_dir, cfg.resume_from_checkpoint)
        state = TrainState(strategy=self.strategy, world_size=acc.num_processes)
        if resume:
            with doing(
                f"checking checkpoint {resume}", resume, corrupt_fix=f"resume from another or delete {resume}"
            ):
                contract.check_trainer(resume, written_terms(resume), self.terms)  # named before its files
                verify_checkpoint(resume, self.model)
            saved = read_state(resume)
            applied = contract.check(
                resume, saved.terms, self.terms, saved.step, self.total_steps, saved.step_in_epoch > 0
            )
            state = load_checkpoint(acc, self.model, self.optimizer, self.scheduler, resume, self.strategy)
            contract.rescale_learning_rates(self.optimizer, self.scheduler, saved.terms, self.terms)
            for change in applied:
                log.warning("resuming %s with a change: %s", resume, change)
            self._restore_recipe(resume, saved)
            state.strategy, state.world_size = self.strategy, acc.num_processes
            if acc.is_main_process:
                with doing("setting newer checkpoints aside", cfg.output_dir, setting="train.output_dir"):
                    branch(cfg.output_dir, resume)
        reporter = Reporter(
            cfg.output_dir,
            cfg.report_to,
            acc.is_main_process,
            state.step if resume else None,
            cfg.run_name,
            cfg.project,
        )
        bar = tqdm(
            total=self.total_steps,
            initial=state.step,
            disable=not (cfg.progress_bar and acc.is_main_process),
            desc="train",
            dynamic_ncols=True,
        )
        window: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)  # steps that reported each metric (skipped ones do not)
        last: dict[str, float] = {}
        state.terms = self.terms
        self.model.train()
        self._saved_step, self._in_step = state.step, False
        # several processes: a signal waits for a step boundary every rank reaches (see _stop_together)
        held = deferred() if acc.num_processes > 1 else contextlib.nullcontext()
        try:
            with held:
                self._loop(state, reporter, bar, window, counts, last)
        except BaseException as e:  # Ctrl-C and SIGTERM too: the trained steps are checkpointed first
            self._stop_on(e, state)
            if isinstance(e, KeyboardInterrupt):  # resume advice only where a checkpoint exists
                found = checkpoints(cfg.output_dir)
                e.checkpoint = found[-1] if found else None  # type: ignore[attr-defined]
            reporter.close(failed=True)
            raise
        bar.close()
        reporter.plot()
        reporter.close()
        end_run(cfg.output_dir)
        return last

    def _restore_recipe(self, resume: Path, saved: TrainState) -> None:
        """The recipe's state in the checkpoint back into the recipe, unless it was saved for another world
        size or other settings: then (only at an epoch boundary: mid-epoch the contract refused it) it can
        only hold data prepared ahead (rollouts sampled ahead), which is dropped, said in the log, and
        prepared again from the checkpoint's weights."""
        kept = read_recipe_state(resume, self.acc.process_index)
        if kept is None:
            return
        if saved.world_size != self.acc.num_processes or saved.terms.get("plan_settings") != self.terms.get(
            "plan_settings"
        ):
            log.warning(
                "%s holds data prepared ahead (rollouts sampled ahead) for another world size or other "
                "settings: dropped, and prepared again from the checkpoint's weights",
                resume,
            )
            return
        try:
            self.recipe.restore(saved.epoch, kept)
        except (ValueError, KeyError, TypeError) as e:  # the file is whole, its contents do not fit this run
            file = recipe_file(resume, self.acc.process_index)
            raise InputError(
                f"{file}: {e}; fix: resume from another checkpoint (train.resume_from_checkpoint=<its path>) "
                f"or delete {resume}"
            ) from None

    def _stop_together(self) -> None:
        """With several processes a signal is held until here, a step boundary every rank reaches (the loop
        runs inside :func:`~padless.run.interrupts.deferred`): the ranks agree whether any of them received
        one, and if so all stop, together, so that they checkpoint the trained steps first, as one process
        does wherever a signal arrives. A rank that received none stops with the others' signal."""
        if self.acc.num_processes == 1:
            return
        held = take_held()
        kind = 0 if held is None else 2 if isinstance(held, Terminated) else 1
        agreed = int(self.acc.gather(torch.tensor([kind], device=self.acc.device)).max().item())
        if agreed:
            error = held or (Terminated() if agreed == 2 else KeyboardInterrupt())
            error.every_rank = True  # type: ignore[attr-defined]
            raise error

    def _stop_on(self, error: BaseException, state: TrainState) -> None:
        """The run stops on ``error``: name the step in the message of a failure in user code or evaluation,
        and first checkpoint the steps trained since the last checkpoint (unless the failure was inside a
        step or the weights diverged): an evaluation, a reward function, Ctrl-C or SIGTERM (between steps:
        during a rollout, say) never costs trained steps."""
        saved = ""
        if (
            not isinstance(error, (DivergenceError, FileFault))  # a full disk would fail a checkpoint too
            and not self._in_step
            and state.step > self._saved_step
            # a checkpoint needs every rank: with several, only after a failure they stopped on together
            and (self.acc.num_processes == 1 or getattr(error, "every_rank", False))
        ):
            try:
                self._save(state)
                saved = f"; the {state.step} trained steps are saved in checkpoint-{state.step}"
            except Exception as e:  # the first error is the one to report
                log.error("could not checkpoint the trained steps before stopping: %s", e)
        elif state.step > self._saved_step:
            log.warning("the steps after %d are not checkpointed", self._saved_step)
        if isinstance(error, (UserCodeError, InputError)):
            if error.args and isinstance(error.args[0], str):
                error.args = (f"at step {state.step + 1}: {error.args[0]}{saved}", *error.args[1:])
        elif saved:
            log.warning("stopping on %s%s", type(error).__name__, saved)

    def _save(self, state: TrainState) -> None:
        kept = self.recipe.state(state.epoch, mid_epoch=state.step_in_epoch > 0)
        self.guard.check_weights(self.model)
        with deferred():  # Ctrl-C / SIGTERM now: the checkpoint is finished first, then the run stops
            save_checkpoint(
                self.acc,
                self.model,
                self.optimizer,
                self.scheduler,
                self.tokenizer,
                state,
                self.cfg.output_dir,
                kept,
            )
            self._saved_step = state.step
            if self.acc.is_main_process:
                rotate_checkpoints(self.cfg.output_dir, self.cfg.save_total_limit)

    def _loop(
        self,
        state: TrainState,
        reporter: Reporter,
        bar: Any,
        window: dict[str, float],
        counts: dict[str, int],
        last: dict[str, float],
    ) -> None:
        cfg = self.cfg
        window_tokens, window_time = 0, 0.0
        planned: dict[str, float] = {}  # what planning the latest epoch measured (a rollout's metrics)
        while state.step < self.total_steps:
            self._stop_together()
            steps = self.steps_of(state.epoch)
            self._stop_together()  # a signal during a rollout: its samples are drawn again on resume
            if state.step_in_epoch == 0 and (measured := self.recipe.plan_metrics(state.epoch)):
                reporter.log(state.step + 1, measured)  # e.g. what a rollout measured
                planned = measured
            started = time.perf_counter()
            self.guard.step = state.step + 1
            self._in_step = True
            metrics = self._train_step(steps[state.step_in_epoch])
            elapsed = time.perf_counter() - started
            tokens = steps[state.step_in_epoch].tokens
            state.step += 1
            state.step_in_epoch += 1
            state.tokens_seen += tokens
            if state.step_in_epoch == len(steps):  # a checkpoint here resumes at the next epoch's start
                state.epoch += 1
                state.step_in_epoch = 0
            self._in_step = False
            for key, value in metrics.items():
                window[key] += value
                counts[key] += 1
            window_tokens, window_time = window_tokens + tokens, window_time + elapsed
            lr = self.scheduler.get_last_lr()[0]
            bar.update(1)
            loss = metrics.get("loss", float("nan"))
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens / elapsed:.0f}")
            if state.step % cfg.logging_steps == 0 or state.step == self.total_steps:
                logged = {f"train/{k}": v / counts[k] for k, v in window.items()}
                logged.update(
                    {
                        "train/lr": lr,
                        "train/tokens_per_s": window_tokens / window_time,
                        "train/epoch": state.epoch + state.step_in_epoch / len(steps),
                        **self.guard.metrics(),
                    }
                )
                reporter.log(state.step, logged)
                last.clear()  # the caller's dict: train() returns it, the latest rollout's metrics too
                last.update({**planned, **logged})
                window.clear()
                counts.clear()
                window_tokens, window_time = 0, 0.0
            final = state.step == self.total_steps
            if (cfg.eval_steps and state.step % cfg.eval_steps == 0) or final:
                self._evaluate(state.step, reporter, last)
            if (cfg.save_steps and state.step % cfg.save_steps == 0) or final:
                self._save(state)

    def _eval_losses(self) -> dict[str, float]:
        """The recipe's loss metrics over the whole eval set: one big step, sharded over ranks."""
        micros = self.recipe.eval_plan()
        if not micros:
            return {}
        rank, world = self.topology.rank, self.topology.world
        step = plan_steps(micros, math.ceil(len(micros) / world), world, rank)[0]
        sums: dict[str, float] = defaultdict(float)
        for micro in step.micros:
            _, metrics = self.recipe.loss(self.model, micro.read(), step.normaliser)
            for key, value in metrics.items():
                sums[key] += value * micro.scale
        return self._sum_over_ranks(sums)

    def _sum_over_ranks(self, sums: dict[str, float]) -> dict[str, float]:
        """Metric shares summed over data-parallel ranks: the ranks of a sequence-parallel group computed
        the same shares (the same rows), so only each group's first adds its own."""
        keys = sorted(sums)
        mine = [sums[k] if self.topology.leads else 0.0 for k in keys]
        totals = self.acc.reduce(torch.tensor(mine, device=self.acc.device), "sum")
        return dict(zip(keys, totals.tolist(), strict=True))

    def _evaluate(self, step: int, reporter: Reporter, last: dict[str, float]) -> None:
        self.model.eval()
        try:
            with torch.no_grad():
                metrics = self._eval_losses()
                metrics.update(self.recipe.on_evaluate(self.model, step))
        except Exception as e:
            what = f"evaluation after step {step} failed (the eval set, data.eval, or what evaluates it)"
            error = (
                InputError(f"{what}: {e}")
                if is_input_error(e)
                else UserCodeError(f"{what}: {type(e).__name__}: {e}")
            )
            error.every_rank = getattr(e, "every_rank", False)  # type: ignore[attr-defined]
            raise error from e
        self.model.train()
        if metrics:
            metrics = {f"eval/{k}": v for k, v in metrics.items()}
            reporter.log(step, metrics)
            last.update(metrics)
