"""Shared helpers for padless benchmarks: isolation, timing, memory, contender setup, the run loop, tables.

A benchmark runs each contender in a fresh ``spawn`` subprocess (:func:`run_isolated`) so that peak memory
(``ru_maxrss`` is a process-wide high-water mark) and thread settings belong to that contender alone. Inside
the subprocess a contender records the end time of every optimizer step with a :class:`StepRecorder`; time is
measured from the end of the last warm-up step to the end of the last timed step, so everything a trainer
does between optimizer steps (data loading, collation, logging, callbacks) is counted, the same way for
every contender. :class:`MemoryMeter` reports peak memory above the state right before training. The padless
and TRL contenders of every benchmark are set up, timed and trained by the same helpers here, so that only
what a method does differently (data, recipe, counting, report columns) lives in its script.

Nothing here imports torch at module level, so the parent process stays light.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import itertools
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from types import ModuleType
from typing import Any

MIB = 1024 * 1024
# Settings that change CPU kernel timing; recorded with the results.
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


# --------------------------------------------------------------------------------------------------------
# Process isolation and threads


def limit_threads(num_threads: int) -> None:
    """Ask every math library for ``num_threads`` threads; call before importing torch (env) and after."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(num_threads)
    if "torch" in sys.modules:
        import torch

        torch.set_num_threads(num_threads)


def hide_devices_for_cpu(device: str) -> None:
    """On a CPU benchmark, hide GPUs from children so every trainer (and accelerate) picks the CPU."""
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def _call_with_traceback(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    try:
        return {"ok": True, "value": fn(**kwargs)}
    except BaseException as e:  # a failed contender must not take the whole benchmark down
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


def run_isolated(fn: Callable[..., Any], **kwargs: Any) -> dict[str, Any]:
    """Run ``fn(**kwargs)`` in a fresh spawned process; returns ``{"ok", "value"}`` or ``{"ok", "error"}``.

    ``fn`` must be importable by name (a module-level function; the benchmark script needs an
    ``if __name__ == "__main__"`` guard). Environment variables set before the call are inherited.
    """
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        try:
            return pool.submit(_call_with_traceback, fn, kwargs).result()
        except Exception as e:  # the child died (killed for memory, segfault, ...)
            return {"ok": False, "error": f"subprocess failed: {type(e).__name__}: {e}", "traceback": ""}


def contender_main(runner: Callable[[], dict[str, Any]], spec: dict[str, Any], profile_name: str) -> dict:
    """Body of a contender's subprocess: threads limited before torch loads, ``runner`` profiled on request.

    With ``spec["profile"]`` set, cProfile writes ``<profile>/<profile_name>.prof``.
    """
    limit_threads(spec["threads"])
    import torch

    torch.set_num_threads(spec["threads"])
    profiler = None
    if spec["profile"]:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        result = runner()
    finally:
        if profiler is not None:
            profiler.disable()
            os.makedirs(spec["profile"], exist_ok=True)
            profiler.dump_stats(os.path.join(spec["profile"], f"{profile_name}.prof"))
    result["threads_in_use"] = torch.get_num_threads()
    result["profiled"] = bool(profiler)
    return result


# --------------------------------------------------------------------------------------------------------
# Memory


def current_rss_bytes() -> int:
    """Resident set size of this process now (Linux ``/proc``; falls back to the peak elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (monotonic, process-wide)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


class MemoryMeter:
    """Peak memory of the training phase: CPU peak RSS (and its rise over the start), CUDA peak allocated.

    Call :meth:`start` right before the first training step and :meth:`stop` after the last one.
    """

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.rss_start = 0
        self.cuda_start = 0

    def start(self) -> None:
        self.rss_start = current_rss_bytes()
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.cuda_start = torch.cuda.memory_allocated()

    def stop(self) -> dict[str, float]:
        peak = peak_rss_bytes()
        out = {
            "rss_start_mib": self.rss_start / MIB,
            "peak_rss_mib": peak / MIB,
            "peak_rss_delta_mib": max(0, peak - self.rss_start) / MIB,
        }
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            out["cuda_start_mib"] = self.cuda_start / MIB
            out["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / MIB
        return out


# --------------------------------------------------------------------------------------------------------
# Step timing


@dataclass
class StepRecord:
    end: float  # perf_counter at the end of the optimizer step
    real_tokens: int  # tokens of the sequences themselves
    processed_tokens: int  # tokens the model computed on (real + padding)
    target_tokens: int  # tokens that carry loss
    loss: float


@dataclass
class StepRecorder:
    """Collects one :class:`StepRecord` per optimizer step; times from the end of warm-up.

    The contender calls :meth:`begin` once before training (so the first step has a start time),
    :meth:`tokens` when it sees a micro-batch, and :meth:`step_end` after each optimizer step.
    """

    warmup: int
    cuda: bool = False
    records: list[StepRecord] = field(default_factory=list)
    started: float = 0.0
    computed: list[int] = field(default_factory=list)  # tokens through the model per step, every pass
    _pending: list[int] = field(default_factory=lambda: [0, 0, 0])
    _pending_computed: int = 0
    _losses: list[float] = field(default_factory=list)

    def begin(self) -> None:
        self.started = time.perf_counter()

    def tokens(self, real: int, processed: int, targets: int) -> None:
        self._pending[0] += real
        self._pending[1] += processed
        self._pending[2] += targets

    def passes(self, tokens: int) -> None:
        """Tokens one forward pass of a training pass (update, reference, old log-probs, scores) computed
        on: a packed row's, a tree row's (its shared prefixes once), or a padded batch's (padding too)."""
        self._pending_computed += tokens

    def loss(self, value: float) -> None:
        """A micro-batch's share of the step loss (they sum to the step loss)."""
        self._losses.append(value)

    def step_end(self, loss: float | None = None) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        now = time.perf_counter()
        value = loss if loss is not None else (sum(self._losses) if self._losses else math.nan)
        self.records.append(StepRecord(now, *self._pending, loss=value))
        self.computed.append(self._pending_computed)
        self._pending, self._losses, self._pending_computed = [0, 0, 0], [], 0

    def summary(self) -> dict[str, Any]:
        """Throughput over the timed steps (all steps after ``warmup``)."""
        if len(self.records) <= self.warmup:
            raise RuntimeError(
                f"only {len(self.records)} steps ran, not more than the {self.warmup} warm-up steps: "
                "nothing was timed (is the data set too small for the requested steps?)"
            )
        timed = self.records[self.warmup :]
        t0 = self.records[self.warmup - 1].end if self.warmup > 0 else self.started
        seconds = timed[-1].end - t0
        ends = [t0] + [r.end for r in timed]
        durations = [b - a for a, b in itertools.pairwise(ends)]
        real = sum(r.real_tokens for r in timed)
        # Robust to bursts of load from other processes: the median over steps of each step's own rate.
        step_rates = [r.real_tokens / d for r, d in zip(timed, durations, strict=True) if d > 0]
        processed = sum(r.processed_tokens for r in timed)
        losses = [r.loss for r in timed]
        tail = losses[-min(5, len(losses)) :]
        return {
            "steps": len(timed),
            "warmup_steps": self.warmup,
            "seconds": seconds,
            "step_s_median": statistics.median(durations),
            "real_tokens": real,
            "processed_tokens": processed,
            "target_tokens": sum(r.target_tokens for r in timed),
            "real_tokens_per_s": real / seconds,
            "real_tokens_per_s_median_step": statistics.median(step_rates),
            "processed_tokens_per_s": processed / seconds,
            "pad_share": 1.0 - real / processed if processed else 0.0,
            "real_tokens_per_step": real / len(timed),
            "computed_tokens_per_step": sum(self.computed[self.warmup :]) / len(timed),
            "final_loss": losses[-1],
            "final_loss_mean5": sum(tail) / len(tail),
            "losses": [r.loss for r in self.records],
        }


class Measurement:
    """A contender's step recorder and memory meter, driven together by whichever trainer runs.

    Memory peaks are read right after the last timed step, before the trainer's own teardown can allocate.
    """

    def __init__(self, spec: dict[str, Any], recorder: StepRecorder | None = None):
        self.cuda = spec["device"] == "cuda"
        self.recorder = recorder or StepRecorder(spec["warmup"], cuda=self.cuda)
        self.memory = MemoryMeter(spec["device"])
        self.total = spec["warmup"] + spec["steps"]
        self.measured: dict[str, float] = {}

    def start(self) -> None:
        self.memory.start()
        self.recorder.begin()

    def step_end(self, loss: float | None = None) -> None:
        self.recorder.step_end(loss)
        if len(self.recorder.records) == self.total:
            self.measured.update(self.memory.stop())

    def result(self, model: Any, layout: str, attention: str, **info: Any) -> dict[str, Any]:
        """The recorder's summary with the memory peaks and what the report prints about the contender."""
        out = self.recorder.summary()
        out.update(self.measured)
        out.update(
            {"layout": layout, "attention": attention, "dtype": str(next(model.parameters()).dtype), **info}
        )
        return out


# --------------------------------------------------------------------------------------------------------
# Contenders: padless (a recipe on the shared Trainer loop) and TRL


def padless_settings(spec: dict[str, Any], output_dir: str, batching: str) -> tuple[Any, Any]:
    """padless's ``ModelSettings`` and ``TrainSettings`` for a contender: the embedded model from seed 0 (or
    the checkpoint) with varlen attention, the benchmark's optimizer, no logging or progress bar."""
    from padless.config.schema import ModelSettings, TrainSettings

    o = spec["optim"]
    model = ModelSettings(name=spec["model"], attn_implementation="varlen", dtype="auto", seed=0)
    train = TrainSettings(
        output_dir=output_dir,
        seed=spec["seed"],
        max_steps=spec["warmup"] + spec["steps"],
        learning_rate=o["learning_rate"],
        lr_scheduler=o["lr_scheduler"],
        weight_decay=o["weight_decay"],
        adam_beta1=o["adam_beta1"],
        adam_beta2=o["adam_beta2"],
        adam_epsilon=o["adam_epsilon"],
        max_grad_norm=o["max_grad_norm"],
        batching=batching,
        max_tokens_per_batch=spec["max_tokens_per_batch"],
        **({"batch_size": spec["batch_size"]} if batching == "padded" else {}),  # right padding
        report_to=[],
        progress_bar=False,
    )
    return model, train


def start_padless(cfg: Any, output_dir: str, device: str) -> Any:
    """A padless session for ``cfg``, refused unless accelerate put it on the device that was asked for."""
    from padless.run.session import start_session

    return require_device(start_session(cfg.model, cfg.train.seed, output_dir, cfg), device)


def require_device(session: Any, device: str) -> Any:
    """``session``, unless accelerate put it on another device than asked for (that would time the wrong one);
    for contenders whose session is started by padless itself (RL's ``start_rl``)."""
    if session.accelerator.device.type != device:
        raise RuntimeError(f"asked for {device} but accelerate chose {session.accelerator.device}")
    return session


def padless_attention(cuda: bool) -> str:
    """The report's name for padless's varlen attention (on CPU: SDPA on sequences grouped by length)."""
    return "varlen" if cuda else "varlen (SDPA, sequences grouped by length)"


def count_passes(recorder: StepRecorder) -> None:
    """Record the tokens of every forward padless's engine runs in this process (:meth:`StepRecorder.passes`):
    ``routed_hidden_states`` is where every pass of every engine meets the model (generation does not)."""
    import padless.forward.engine as engine

    routed = engine.routed_hidden_states

    def counted(model: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        recorder.passes(batch.input_ids.numel())
        return routed(model, batch, *args, **kwargs)

    engine.routed_hidden_states = counted


def padless_layout(trainer: Any, packed: str) -> str:
    """The report's name for a padless contender's rows: ``packed`` as it is, or as tree rows where the
    recipe's engine runs them (``train.tree_packing``)."""
    return packed.replace("packed", "tree rows") if getattr(trainer.recipe, "tree", False) else packed


def train_padless(trainer: Any, run: Measurement, count: Callable[[Any], None]) -> None:
    """Train with every optimizer step timed by ``run``; ``count`` records each micro-batch's tokens first."""
    import padless.run.loop as loop

    # The final checkpoint is not part of the measurement and would only write to disk.
    loop.save_checkpoint = lambda *args, **kwargs: None
    inner = trainer._train_step

    def timed_step(step: loop.Step) -> dict[str, float]:
        for micro in step.micros:
            count(micro)
        metrics = inner(step)
        run.step_end(metrics.get("loss"))
        return metrics

    trainer._train_step = timed_step
    run.start()
    trainer.train()


def run_padless_sft(
    spec: dict[str, Any], batching: str, examples: Callable[[Any], list[Any]]
) -> dict[str, Any]:
    """The padless SFT contender of every SFT benchmark: the real ``SFTRecipe`` on the shared ``Trainer``
    loop with ``batching`` ``tokens`` (one packed row per step) or ``padded`` (right padding), on the
    examples ``examples(session)`` returns (built with the session's model and tokenizer)."""
    import tempfile

    import padless.run.loop as loop
    from padless.config.schema import DataSettings, SFTConfig
    from padless.trainers.sft import SFTRecipe

    run = Measurement(spec)
    with tempfile.TemporaryDirectory(prefix="padless-bench-") as out:
        model, train = padless_settings(spec, out, batching)
        data_settings = DataSettings(train=spec["data"]["spec"], max_length=spec["max_length"])
        cfg = SFTConfig(model=model, data=data_settings, train=train)
        session = start_padless(cfg, out, spec["device"])
        recipe = SFTRecipe(examples(session), cfg.train, session.tokenizer, session.accelerator.device)
        trainer = loop.Trainer(recipe, session.engine(), session.tokenizer, cfg.train, session.accelerator)

        def count(micro: loop.MicroBatch) -> None:
            lens = [len(e) for e in micro.data]
            processed = len(lens) * max(lens) if batching == "padded" else sum(lens)
            run.recorder.tokens(sum(lens), processed, int(micro.units))

        train_padless(trainer, run, count)
    layout = "packed, token budget" if batching == "tokens" else f"padded right, {spec['batch_size']} seqs"
    return run.result(session.model, layout, padless_attention(run.cuda))


def import_trl() -> ModuleType:
    """TRL, or a message saying how to get it (it is a benchmark-only extra)."""
    try:
        import trl
    except ImportError as e:
        raise RuntimeError("TRL is not installed: pip install 'padless[bench]'") from e
    return trl


def trl_attention(choice: str, device: str) -> str:
    """``--trl-attn`` as transformers' ``attn_implementation``: ``auto`` is the best kernel TRL users get."""
    if choice == "auto":
        if device == "cuda":
            import importlib.util

            return "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa"
        return "sdpa"
    if choice == "varlen":
        from padless.forward.attention import VARLEN_NAME

        return VARLEN_NAME
    return choice


def trl_model(spec: dict[str, Any]) -> tuple[Any, Any, str]:
    """TRL's model (same initial weights as padless: the embedded model from seed 0, or the checkpoint), its
    tokenizer and attention, with transformers' and datasets' chatter off."""
    import datasets
    import torch
    import transformers

    from padless import tiny
    from padless.proof.load import load_tokenizer

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    dtype = torch.bfloat16 if spec["device"] == "cuda" else torch.float32
    attn = trl_attention(spec["trl_attn"], spec["device"])
    if spec["model"] in tiny.TINY_MODELS:
        model = tiny.build_tiny_model(spec["model"], seed=0, attn_implementation=attn, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            spec["model"], attn_implementation=attn, dtype=dtype
        )
    return model, load_tokenizer(spec["model"]), attn


def trl_args(spec: dict[str, Any], output_dir: str) -> dict[str, Any]:
    """TRL config arguments every TRL contender shares: padless's optimizer and schedule, one micro-batch per
    step, no activation checkpointing, and nothing saved, evaluated or logged."""
    import transformers

    o = spec["optim"]
    cuda = spec["device"] == "cuda"
    # TRL turns activation (gradient) checkpointing on by default; padless does not. transformers >= 5.2x
    # renamed the argument and warns about the old name.
    fields = transformers.TrainingArguments.__dataclass_fields__
    no_checkpointing = (
        {"activation_checkpointing": False}
        if "activation_checkpointing" in fields
        else {"gradient_checkpointing": False}
    )
    return {
        "output_dir": output_dir,
        "max_steps": spec["warmup"] + spec["steps"],
        "per_device_train_batch_size": spec["batch_size"],
        "gradient_accumulation_steps": 1,
        "learning_rate": o["learning_rate"],
        "lr_scheduler_type": o["lr_scheduler"],
        "warmup_steps": 0,
        "weight_decay": o["weight_decay"],
        "adam_beta1": o["adam_beta1"],
        "adam_beta2": o["adam_beta2"],
        "adam_epsilon": o["adam_epsilon"],
        "max_grad_norm": o["max_grad_norm"],
        "optim": "adamw_torch",  # torch.optim.AdamW, as padless
        "seed": spec["seed"],
        **no_checkpointing,
        "bf16": cuda,
        "fp16": False,
        "use_cpu": not cuda,
        "report_to": "none",
        "save_strategy": "no",
        "eval_strategy": "no",
        "logging_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }


def counting_trainer(base: type, run: Measurement, count: Callable[[dict[str, Any]], None]) -> type:
    """``base`` (a TRL trainer class) with ``count`` called on every micro-batch and its loss recorded."""

    class Counting(base):
        def training_step(self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            count(inputs)
            loss = super().training_step(model, inputs, *args, **kwargs)
            run.recorder.loss(loss.item())
            return loss

    return Counting


def train_trl(trainer: Any, run: Measurement) -> None:
    """Train with every optimizer step timed by ``run`` (a callback), without the end-of-run log line."""
    import transformers

    class StepTimer(transformers.TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            run.start()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            run.step_end()

    trainer.add_callback(StepTimer())
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    trainer.train()


# --------------------------------------------------------------------------------------------------------
# Command line, plan and the run loop


def optimizer_settings(learning_rate: float) -> dict[str, Any]:
    """AdamW and schedule for every contender of a benchmark (padless's defaults but the learning rate)."""
    return {
        "learning_rate": learning_rate,
        "weight_decay": 0.0,
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_epsilon": 1e-8,
        "max_grad_norm": 1.0,
        "lr_scheduler": "cosine",
    }


def parse_benchmark_args(
    p: argparse.ArgumentParser,
    argv: list[str] | None,
    contenders: Sequence[str],
    cpu_steps: int,
    quick_help: str,
    model: str = "tiny-qwen2",
) -> argparse.Namespace:
    """Add the options every benchmark takes to ``p`` (which holds the script's own) and parse.

    Settles the shared defaults: ``--quick`` is 1 warm-up + 2 timed steps, otherwise 3 warm-up +
    ``cpu_steps`` timed steps on CPU, 100 on CUDA; ``--model`` is ``model`` unless given.
    """
    p.add_argument("--model", default=model, help=f"embedded name, local directory or cached HF id ({model})")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for every contender")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"timed optimizer steps per contender (default {cpu_steps} on CPU, 100 on CUDA)",
    )
    p.add_argument("--warmup", type=int, default=None, help="untimed optimizer steps first (default 3)")
    p.add_argument("--repeats", type=int, default=1, help="run every contender this many times (interleaved)")
    p.add_argument(
        "--contenders",
        default=",".join(contenders),
        help=f"comma-separated subset of {', '.join(contenders)}",
    )
    p.add_argument(
        "--trl-attn",
        default="auto",
        help="attn_implementation for the TRL runs: auto (sdpa on CPU; flash_attention_2 on CUDA when "
        "flash-attn is installed, else sdpa), sdpa, eager, flash_attention_2, or varlen (padless's kernel)",
    )
    p.add_argument("--seed", type=int, default=42, help="data order seed (model init is always seed 0)")
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--json", default=None, help="write all results (every run, every step loss) here")
    p.add_argument("--profile", default=None, help="directory for one cProfile file per contender")
    args = p.parse_args(argv)
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [c for c in args.contenders if c not in contenders]
    if unknown:
        p.error(f"unknown contender(s) {', '.join(unknown)}; choose from {', '.join(contenders)}")
    if args.warmup is None:
        args.warmup = 1 if args.quick else 3
    if args.steps is None:
        args.steps = 2 if args.quick else (cpu_steps if args.device == "cpu" else 100)
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1 or args.threads < 1:
        p.error("--steps, --repeats and --threads must be >= 1, --warmup >= 0")
    return args


def base_spec(args: argparse.Namespace, optim: dict[str, Any]) -> dict[str, Any]:
    """The settings every contender's subprocess reads (the script adds its batching and data facts)."""
    return {
        "model": args.model,
        "device": args.device,
        "threads": args.threads,
        "warmup": args.warmup,
        "steps": args.steps,
        "seed": args.seed,
        "max_length": args.max_length,
        "trl_attn": args.trl_attn,
        "profile": args.profile,
        "optim": optim,
    }


Runs = dict[str, list[dict[str, Any]]]


def run_benchmark(
    args: argparse.Namespace,
    prepare: Callable[[argparse.Namespace], tuple[dict[str, Any], dict[str, Any]]],
    contender: Callable[..., dict[str, Any]],
    progress: Callable[[dict[str, Any]], str],
    report: Callable[[dict[str, Any], Runs, dict[str, Any]], dict[str, Any]],
) -> int:
    """Run every contender ``args.repeats`` times, interleaved, each in a fresh subprocess; report; save.

    ``prepare`` runs once threads are limited and returns the spec and the data keyword arguments that
    ``contender(name=..., spec=..., **data)`` gets in every subprocess; ``progress`` describes one run.
    With ``--report FILE`` (where a script offers it) only prints the report of a saved ``--json`` file.
    Returns the exit status: 2 without the asked-for GPU, 1 if any run failed.
    """
    if getattr(args, "report", None):
        saved = json.loads(Path(args.report).read_text())
        report(saved["spec"], saved["runs"], saved["environment"])
        return 0
    hide_devices_for_cpu(args.device)
    limit_threads(args.threads)
    env = environment()
    if args.device == "cuda":
        env["gpu"] = gpu_name()
        if env["gpu"] is None:
            print("--device cuda: no CUDA device is visible", file=sys.stderr)
            return 2
    spec, data = prepare(args)
    runs: Runs = {name: [] for name in args.contenders}
    errors: dict[str, list[str]] = {}
    for repeat in range(args.repeats):
        for name in args.contenders:
            started = time.perf_counter()
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
            out = run_isolated(contender, name=name, spec=spec, **data)
            wall = time.perf_counter() - started
            tag = f"[{repeat + 1}/{args.repeats}] {name}"
            if not out["ok"]:
                errors.setdefault(name, []).append(out["error"])
                print(f"{tag}: FAILED {out['error']}\n{out['traceback']}", flush=True)
                continue
            r = out["value"]
            r.update({"repeat": repeat, "wall_s": wall, "loadavg_1m_before": load})
            runs[name].append(r)
            print(f"{tag}: {progress(r)}", flush=True)
    env["git_end"] = git_state()  # other people may commit while a long benchmark runs
    if hasattr(os, "getloadavg"):
        env["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    summary = report(spec, runs, env) if any(runs.values()) else {}
    if args.json:
        path = write_json(
            args.json, {"environment": env, "spec": spec, "runs": runs, "errors": errors, **summary}
        )
        print(f"\nwrote {path}")
    return 1 if errors else 0


# --------------------------------------------------------------------------------------------------------
# Environment


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_state(repo: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Commit of the checkout and whether the library has uncommitted edits (read-only git calls)."""
    import subprocess

    root = Path(repo) if repo else Path(__file__).resolve().parent.parent

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--", "padless")
    return {"commit": commit, "library_dirty": bool(dirty) if dirty is not None else None}


def environment(packages: Sequence[str] = ("padless", "torch", "transformers", "accelerate", "trl")) -> dict:
    """Date, machine and library versions, for the record next to the numbers."""
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "versions": {name: package_version(name) for name in packages},
        "git": git_state(),
    }
    info["env"] = {k: os.environ[k] for k in THREAD_ENV if k in os.environ}
    if hasattr(os, "getloadavg"):
        info["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
    return info


def gpu_name() -> str | None:
    """The visible CUDA device's name, None without one (imports torch: call after the thread limits)."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


# --------------------------------------------------------------------------------------------------------
# Reporting


def fmt_number(value: Any, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table (also readable as plain text); numbers right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    numeric = [
        all(r[i][:1].isdigit() or r[i][:1] in "-+." for r in cells) and bool(cells)
        for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)]
        return "| " + " | ".join(parts) + " |"

    sep = "|" + "|".join(
        ("-" * (w + 1) + ":") if num else "-" * (w + 2) for w, num in zip(widths, numeric, strict=True)
    )
    return "\n".join([line(headers), sep + "|", *(line(r) for r in cells)])


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if not numerator or not denominator:
        return None
    return numerator / denominator


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def median_run(runs: Sequence[dict[str, Any]], key: str = "real_tokens_per_s") -> dict[str, Any]:
    """The run with the median ``key`` (lower middle for an even count): its other numbers stay consistent."""
    ordered = sorted(runs, key=lambda r: r[key])
    return ordered[(len(ordered) - 1) // 2]


def write_json(path: str | os.PathLike[str], payload: Any) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return p


# A report column of the script's own: header, and its cell for one contender's median run.
Column = tuple[str, Callable[[dict[str, Any]], str]]


class Results:
    """Every contender's runs with its median run picked, and the parts of a report all benchmarks share."""

    def __init__(self, spec: dict[str, Any], runs: Runs):
        self.runs = runs
        self.cuda = spec["device"] == "cuda"
        self.chosen = {name: median_run(rs) for name, rs in runs.items() if rs}
        self.n_runs = max(len(rs) for rs in runs.values())

    def get(self, name: str, key: str) -> float | None:
        return self.chosen[name].get(key) if name in self.chosen else None

    def ratio(self, numerator: str, denominator: str, key: str) -> float | None:
        return ratio(self.get(numerator, key), self.get(denominator, key))

    def throughput_ratios(self, numerator: str, denominator: str, memory_key: str) -> dict[str, float | None]:
        """Real tokens/s (whole timed window and median step) and memory of one contender over another."""
        return {
            "real_tokens_per_s": self.ratio(numerator, denominator, "real_tokens_per_s"),
            "median_step": self.ratio(numerator, denominator, "real_tokens_per_s_median_step"),
            "memory": self.ratio(numerator, denominator, memory_key),
        }

    def targets(self, targets: dict[str, tuple[str, str, float]]) -> dict[str, dict[str, Any]]:
        """Each target ``label: (numerator, denominator, minimum real tokens/s ratio)``: its ratio and whether
        it was met (None when a contender has no run)."""
        out = {}
        for label, (a, b, minimum) in targets.items():
            value = self.ratio(a, b, "real_tokens_per_s")
            out[label] = {"ratio": value, "met": None if value is None else value >= minimum}
        return out

    def runs_line(self, spec: dict[str, Any]) -> str:
        return (
            f"{spec['warmup']} warm-up + {spec['steps']} timed steps per contender, {self.n_runs} run(s) "
            "each (median run shown, range of runs in parentheses);"
        )

    def table(self, before: Sequence[Column], after: Sequence[Column]) -> str:
        """The median runs as a markdown table: the script's columns around throughput, memory and s/step."""
        headers = ["contender", "layout", "attention", *(h for h, _ in before)]
        headers += [
            "real tok/s",
            "median-step tok/s",
            "pad share",
            "peak CUDA MiB" if self.cuda else "peak RSS MiB",
        ]
        headers += [] if self.cuda else ["RSS rise MiB"]
        headers += ["s/step", *(h for h, _ in after)]
        rows = []
        for name, r in self.chosen.items():
            spread = ""
            if len(self.runs[name]) > 1:
                values = [x["real_tokens_per_s"] for x in self.runs[name]]
                spread = f" ({min(values):,.0f}-{max(values):,.0f})"
            row = [name, r["layout"], r["attention"], *(cell(r) for _, cell in before)]
            row += [
                fmt_number(r["real_tokens_per_s"]) + spread,
                fmt_number(r["real_tokens_per_s_median_step"]),
                f"{100 * r['pad_share']:.1f}%",
            ]
            if self.cuda:
                row.append(fmt_number(r.get("cuda_peak_mib")))
            else:
                row += [fmt_number(r.get("peak_rss_mib")), fmt_number(r.get("peak_rss_delta_mib"))]
            row += [f"{r['step_s_median']:.2f}", *(cell(r) for _, cell in after)]
            rows.append(row)
        return markdown_table(headers, rows)

    def print_failures(self) -> None:
        for name, rs in self.runs.items():
            if not rs:
                print(f"{name}: no successful run (see the errors above)")


def machine_line(spec: dict[str, Any], env: dict[str, Any]) -> str:
    return (
        f"{spec['device']} ({env.get('gpu') or env['cpu']}), {spec['threads']} threads, model {spec['model']}"
    )


def throughput_line(r: dict[str, Any]) -> str:
    """One run's throughput, padding and time, for the progress line printed as each run ends."""
    return (
        f"{r['real_tokens_per_s']:,.0f} real tok/s, pad {100 * r['pad_share']:.1f}%, "
        f"{r['seconds']:.1f} s timed, {r['wall_s']:.0f} s wall"
    )


def print_ratios(
    ratios: dict[str, dict[str, Any]],
    columns: Sequence[tuple[str, str, int]],
    tail: tuple[str, Callable[[dict[str, Any]], str]] | None = None,
) -> None:
    """One line per ratio; ``columns`` are (title, key, width), ``tail`` an unaligned last (title, text)."""
    print(
        f"{'ratio':36s}"
        + "".join(f" {title:>{w}s}" for title, _, w in columns)
        + (f"  {tail[0]}" if tail else "")
    )
    for label, v in ratios.items():
        line = f"{label:36s}" + "".join(f" {fmt_ratio(v.get(key)):>{w}s}" for _, key, w in columns)
        print(line + (f"  {tail[1](v)}" if tail else ""))


def print_targets(targets: dict[str, dict[str, Any]], width: int) -> None:
    for label, t in targets.items():
        verdict = {None: "n/a", True: "met", False: "MISSED"}[t["met"]]
        print(f"target {label:{width}s} {fmt_ratio(t['ratio']):>7s}  {verdict}")


# --------------------------------------------------------------------------------------------------------
# The SFT benchmarks' report (text, vision-language, hybrid): packed vs padded, and TRL where it runs


def loss_progress(r: dict[str, Any]) -> str:
    """One SFT run's progress line: throughput and its final loss."""
    return f"{throughput_line(r)}, loss {r['final_loss']:.4f}"


def paired_ratios(num: list[dict[str, Any]], den: list[dict[str, Any]]) -> list[float]:
    """Real tokens/s ratio within each repeat that both contenders completed."""
    by_repeat = {r["repeat"]: r["real_tokens_per_s"] for r in den}
    return [r["real_tokens_per_s"] / by_repeat[r["repeat"]] for r in num if r["repeat"] in by_repeat]


def sft_report(
    spec: dict[str, Any],
    runs: Runs,
    env: dict[str, Any],
    heading: str,
    ratios: Sequence[tuple[str, str, str]],
    targets: dict[str, tuple[str, str, float]],
    padded: str = "padded",
) -> dict:
    """Print an SFT benchmark's table (median run of each contender), its ``ratios`` (label, numerator,
    denominator; per repeat too, since runs of one repeat see similar load) and ``targets``; return them
    for the JSON. ``heading`` names the benchmark, the machine line follows it; ``padded`` names the
    contenders that take ``batch_size`` sequences per step."""
    results = Results(spec, runs)
    mem_key = "cuda_peak_mib" if results.cuda else "peak_rss_delta_mib"
    table = results.table(
        before=[("real tok/step", lambda r: fmt_number(r["real_tokens_per_step"]))],
        after=[("loss (last 5)", lambda r: f"{r['final_loss_mean5']:.4f}")],
    )
    measured = {
        label: {
            **results.throughput_ratios(a, b, mem_key),
            "per_repeat": paired_ratios(runs.get(a, []), runs.get(b, [])),
        }
        for label, a, b in ratios
    }
    met = results.targets(targets)
    d = spec["data"]
    print()
    print(
        f"{heading} on {machine_line(spec, env)}, data {d['spec']} ({d['examples']} examples, "
        f"{d['tokens']:,} tokens, median {d['median_len']:.0f} / max {d['max_len']} tokens)"
    )
    git, versions = env.get("git", {}), env.get("versions", {})
    dirty = " (uncommitted library edits)" if git.get("library_dirty") else ""
    trl = f", TRL {versions.get('trl')}" if any(name.startswith("trl") for name in runs) else ""
    print(
        f"padless {versions.get('padless')} at {git.get('commit')}{dirty}, torch {versions.get('torch')}, "
        f"transformers {versions.get('transformers')}{trl}; {env.get('date')}"
    )
    print(results.runs_line(spec))
    print(
        f"packed: budget {spec['max_tokens_per_batch']} tokens/step; "
        f"{padded}: {spec['batch_size']} sequences/step"
    )
    print()
    print(table)
    print()
    mem_label = "peak CUDA memory" if results.cuda else "peak RSS rise"
    columns = [
        ("real tok/s", "real_tokens_per_s", 10),
        ("median step", "median_step", 12),
        (mem_label, "memory", 16),
    ]

    def per_repeat(v: dict[str, Any]) -> str:
        return ", ".join(fmt_ratio(x) for x in v["per_repeat"]) if results.n_runs > 1 else ""

    print_ratios(measured, columns, tail=("per repeat", per_repeat))
    print()
    print_targets(met, width=max(map(len, targets), default=0))
    results.print_failures()
    return {"ratios": measured, "targets": met, "table": table}
