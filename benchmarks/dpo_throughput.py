"""DPO throughput: padless packed vs padless padded vs TRL DPOTrainer (default, and padding_free=True).

Same model (the embedded ``tiny-qwen2`` by default, fp32 on CPU), same preference data (``tiny:preference``),
same machine, one run. Every contender trains the policy with the sigmoid DPO loss (beta 0.1) against a
frozen copy of the initial model as reference (no precomputed reference log-probs), one micro-batch per
optimizer step, the same optimizer and schedule, and runs in a fresh subprocess with the same thread count:

* ``padless-packed``  the real padless path: ``DPORecipe`` on the shared ``Trainer`` loop; token-budget
  micro-batches of whole pairs, one packed row ``[c1, r1, c2, r2, ...]`` per policy forward and per
  reference forward, ``varlen`` attention.
* ``padless-padded``  the same loop with ``batching: padded`` (right padding, ``--batch-size`` pairs), for
  reference.
* ``trl``  TRL ``DPOTrainer`` as it ships: its preference collator pads the ``2 x batch`` sequences on the
  right to the longest one; reference model passed as a frozen copy.
* ``trl-padding-free``  the same with ``padding_free=True``. What TRL actually does with it (pack, refuse,
  or fall back to padding) is detected and printed, and the measured padding share shows it too.

Per-step work is matched in pairs: TRL and padless padded take ``--batch-size`` pairs per step (TRL's
``per_device_train_batch_size``); padless packed gets the smallest token budget that holds every pair and
gives at least that many pairs per micro-batch on average (both numbers are printed). padless tokenizes
the data itself (``tokenize_preference``); TRL receives the same prompt / chosen / rejected strings and
tokenizes them itself, so both report the real tokens they computed on. Preprocessing, model loading and
the warm-up steps are outside the timed window, which runs from the end of the last warm-up step to the
end of the last timed step (data loading and collation included). TRL's gradient checkpointing (on by
default in TRL) is turned off, as padless does not checkpoint; TRL's bf16 default is off on CPU. Nothing
is evaluated, saved or logged to disk.

    python benchmarks/dpo_throughput.py                 # full run on CPU (2 threads)
    python benchmarks/dpo_throughput.py --quick         # smoke run, well under 2 minutes
    python benchmarks/dpo_throughput.py --device cuda   # GPU, bf16
    python benchmarks/dpo_throughput.py --json results.json --repeats 2
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

try:  # run as a script (benchmarks/ on sys.path) or as a module from the repo root
    from common import (
        MemoryMeter,
        StepRecorder,
        environment,
        fmt_number,
        fmt_ratio,
        hide_devices_for_cpu,
        limit_threads,
        markdown_table,
        median_run,
        ratio,
        run_isolated,
        write_json,
    )
except ModuleNotFoundError:
    from benchmarks.common import (
        MemoryMeter,
        StepRecorder,
        environment,
        fmt_number,
        fmt_ratio,
        hide_devices_for_cpu,
        limit_threads,
        markdown_table,
        median_run,
        ratio,
        run_isolated,
        write_json,
    )

CONTENDERS = ("padless-packed", "padless-padded", "trl", "trl-padding-free")
IGNORE_INDEX = -100

# Shared by every contender: padless's DPO defaults (TRL's would be lr 1e-6 and a linear schedule).
OPTIM = {
    "learning_rate": 5e-6,
    "weight_decay": 0.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1e-8,
    "max_grad_norm": 1.0,
    "lr_scheduler": "cosine",
}
BETA = 0.1

# A pair as the padless subprocess receives it: (chosen ids, chosen mask, rejected ids, rejected mask).
Pair = tuple[list[int], list[bool], list[int], list[bool]]


# --------------------------------------------------------------------------------------------------------
# Step recording with pair counts


@dataclass
class PairRecorder(StepRecorder):
    """A :class:`StepRecorder` that also counts preference pairs per optimizer step (for pairs/s)."""

    pair_counts: list[int] = field(default_factory=list)
    _pending_pairs: int = 0

    def pairs(self, count: int) -> None:
        self._pending_pairs += count

    def step_end(self, loss: float | None = None) -> None:
        super().step_end(loss)
        self.pair_counts.append(self._pending_pairs)
        self._pending_pairs = 0

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        timed = self.pair_counts[self.warmup :]
        ends = [r.end for r in self.records]
        starts = [self.started, *ends[:-1]]
        durations = [e - s for s, e in zip(starts, ends, strict=True)][self.warmup :]
        rates = [n / d for n, d in zip(timed, durations, strict=True) if d > 0]
        out.update(
            {
                "pairs": sum(timed),
                "pairs_per_s": sum(timed) / out["seconds"],
                "pairs_per_s_median_step": statistics.median(rates),
                "pairs_per_step": sum(timed) / len(timed),
                "real_tokens_per_pair": out["real_tokens"] / max(1, sum(timed)),
                "first_loss": self.records[0].loss,
            }
        )
        return out


# --------------------------------------------------------------------------------------------------------
# Parent: data, plan, orchestration


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-qwen2", help="embedded name, local directory or cached HF id")
    p.add_argument(
        "--data",
        default="tiny:preference",
        help="preference data with prompt/chosen/rejected (jsonl/json/parquet, datasets dir, tiny:<name>)",
    )
    p.add_argument(
        "--max-length",
        type=int,
        default=1024,
        help="per side, for both (TRL's default); a longer side is an error here, so nobody truncates",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for every contender")
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="pairs per optimizer step for TRL (per_device_train_batch_size) and padless padded (default 8, "
        "TRL's default; 4 with --quick)",
    )
    p.add_argument(
        "--max-pair-tokens",
        type=int,
        default=None,
        help="leave out pairs longer than this (chosen + rejected tokens) for every contender (default: keep "
        "all; 256 with --quick)",
    )
    p.add_argument(
        "--max-tokens-per-batch",
        type=int,
        default=None,
        help="padless packed token budget per step (default: the smallest budget that holds every pair and "
        "gives at least --batch-size pairs per micro-batch on average)",
    )
    p.add_argument("--steps", type=int, default=None, help="timed optimizer steps per contender (default 35)")
    p.add_argument("--warmup", type=int, default=None, help="untimed optimizer steps first (default 3)")
    p.add_argument("--repeats", type=int, default=1, help="run every contender this many times (interleaved)")
    p.add_argument(
        "--contenders",
        default=",".join(CONTENDERS),
        help=f"comma-separated subset of {', '.join(CONTENDERS)}",
    )
    p.add_argument(
        "--trl-attn",
        default="auto",
        help="attn_implementation for the TRL runs: auto (sdpa on CPU; flash_attention_2 on CUDA when "
        "flash-attn is installed, else sdpa), sdpa, eager or flash_attention_2",
    )
    p.add_argument("--seed", type=int, default=42, help="data order seed (model init is always seed 0)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run (< 2 min): pairs of <= 256 tokens, 4 per step, 1 warm-up + 2 timed steps",
    )
    p.add_argument("--json", default=None, help="write all results (every run, every step loss) here")
    p.add_argument("--profile", default=None, help="directory for one cProfile file per contender")
    args = p.parse_args(argv)
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [c for c in args.contenders if c not in CONTENDERS]
    if unknown:
        p.error(f"unknown contender(s) {', '.join(unknown)}; choose from {', '.join(CONTENDERS)}")
    if args.batch_size is None:
        args.batch_size = 4 if args.quick else 8
    if args.max_pair_tokens is None and args.quick:
        args.max_pair_tokens = 256
    if args.warmup is None:
        args.warmup = 1 if args.quick else 3
    if args.steps is None:
        args.steps = 2 if args.quick else (35 if args.device == "cpu" else 100)
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1 or args.threads < 1 or args.batch_size < 1:
        p.error("--steps, --repeats, --threads and --batch-size must be >= 1, --warmup >= 0")
    return args


def load_data(args: argparse.Namespace) -> tuple[list[Pair], list[dict[str, Any]]]:
    """padless's tokenized pairs and the raw rows (for TRL), read once in the parent."""
    from padless.data import load_rows, tokenize_preference
    from padless.model import load_tokenizer

    rows = load_rows(args.data)
    pairs, _ = tokenize_preference(rows, load_tokenizer(args.model), max_length=args.max_length)
    assert len(pairs) == len(rows)  # without skip_bad_rows a bad row raises: pairs[i] is rows[i]
    keep = [i for i, p in enumerate(pairs) if args.max_pair_tokens is None or len(p) <= args.max_pair_tokens]
    if not keep:
        raise SystemExit(f"no pair has at most --max-pair-tokens {args.max_pair_tokens} tokens")
    tokenized = [
        (p.chosen.input_ids, list(p.chosen.loss_mask), p.rejected.input_ids, list(p.rejected.loss_mask))
        for p in (pairs[i] for i in keep)
    ]
    raw = [{k: rows[i].data[k] for k in ("prompt", "chosen", "rejected") if k in rows[i].data} for i in keep]
    return tokenized, raw


def matching_budget(lengths: list[int], pairs_per_step: int, seed: int) -> int:
    """Smallest budget (>= the longest pair) giving >= ``pairs_per_step`` pairs per micro-batch on average."""
    from padless.packing import budget_batches

    target_bins = len(lengths) / pairs_per_step
    budget = max(lengths)
    while len(budget_batches(lengths, budget, seed=seed)) > target_bins and budget < sum(lengths):
        budget += 16
    return budget


def plan(args: argparse.Namespace, pairs: list[Pair]) -> dict[str, Any]:
    """Everything a contender needs: settings, data facts, and the budget matching TRL's pairs per step."""
    from padless.packing import budget_batches

    lengths = [len(c) + len(r) for c, _, r, _ in pairs]
    sides = [n for c, _, r, _ in pairs for n in (len(c), len(r))]
    budget = args.max_tokens_per_batch or matching_budget(lengths, args.batch_size, args.seed)
    if budget < max(lengths):
        raise SystemExit(f"--max-tokens-per-batch {budget} is below the longest pair ({max(lengths)} tokens)")
    bins = budget_batches(lengths, budget, seed=args.seed)
    # The padding a right-padded batch of `batch_size` random pairs carries (what TRL's collator does).
    expected_pad = padded_share(sides, args.batch_size, args.seed)
    return {
        "model": args.model,
        "device": args.device,
        "threads": args.threads,
        "warmup": args.warmup,
        "steps": args.steps,
        "seed": args.seed,
        "max_length": args.max_length,
        "max_tokens_per_batch": budget,
        "batch_size": args.batch_size,
        "beta": BETA,
        "trl_attn": args.trl_attn,
        "profile": args.profile,
        "optim": OPTIM,
        "data": {
            "spec": args.data,
            "max_pair_tokens": args.max_pair_tokens,
            "pairs": len(pairs),
            "tokens": sum(lengths),
            "median_side_len": statistics.median(sides),
            "mean_side_len": statistics.mean(sides),
            "max_side_len": max(sides),
            "max_pair_len": max(lengths),
            "packed_steps_per_epoch": len(bins),
            "packed_pairs_per_step": len(pairs) / len(bins),
            "packed_tokens_per_step": sum(lengths) / len(bins),
            "padded_steps_per_epoch": math.ceil(len(pairs) / args.batch_size),
            "padded_pad_share_expected": expected_pad,
        },
    }


def padded_share(sides: list[int], batch_size: int, seed: int) -> float:
    """Padding share of one shuffled epoch in right-padded batches of ``batch_size`` pairs (2x sequences)."""
    import random

    order = list(range(len(sides) // 2))
    random.Random(seed).shuffle(order)
    real = processed = 0
    for start in range(0, len(order), batch_size):
        group = [sides[2 * i + k] for i in order[start : start + batch_size] for k in (0, 1)]
        real += sum(group)
        processed += len(group) * max(group)
    return 1.0 - real / processed


def run_contender(name: str, spec: dict[str, Any], pairs: list[Pair], rows: list[dict[str, Any]]) -> dict:
    """Entry point of a contender's subprocess."""
    limit_threads(spec["threads"])
    import torch

    torch.set_num_threads(spec["threads"])
    runner = {
        "padless-packed": lambda: run_padless(spec, pairs, "tokens"),
        "padless-padded": lambda: run_padless(spec, pairs, "padded"),
        "trl": lambda: run_trl(spec, rows, padding_free=False),
        "trl-padding-free": lambda: run_trl(spec, rows, padding_free=True),
    }[name]
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
            profiler.dump_stats(os.path.join(spec["profile"], f"dpo-{name}.prof"))
    result["threads_in_use"] = torch.get_num_threads()
    result["profiled"] = bool(profiler)
    return result


# --------------------------------------------------------------------------------------------------------
# Contender: padless (DPORecipe on the shared Trainer loop)


def run_padless(spec: dict[str, Any], pairs: list[Pair], batching: str) -> dict[str, Any]:
    import padless.trainers.loop as loop
    from padless.config import DPOConfig, DPOSettings, ModelSettings, PreferenceDataSettings, TrainSettings
    from padless.data import PairExample
    from padless.model import load_model
    from padless.packing import Example
    from padless.trainers.dpo import DPORecipe
    from padless.trainers.session import start_session

    total = spec["warmup"] + spec["steps"]
    o = spec["optim"]
    cuda = spec["device"] == "cuda"
    with tempfile.TemporaryDirectory(prefix="padless-dpo-bench-") as out:
        cfg = DPOConfig(
            model=ModelSettings(name=spec["model"], attn_implementation="varlen", dtype="auto", seed=0),
            data=PreferenceDataSettings(train=spec["data"]["spec"], max_length=spec["max_length"]),
            train=TrainSettings(
                output_dir=out,
                seed=spec["seed"],
                max_steps=total,
                learning_rate=o["learning_rate"],
                lr_scheduler=o["lr_scheduler"],
                weight_decay=o["weight_decay"],
                adam_beta1=o["adam_beta1"],
                adam_beta2=o["adam_beta2"],
                adam_epsilon=o["adam_epsilon"],
                max_grad_norm=o["max_grad_norm"],
                batching=batching,
                max_tokens_per_batch=spec["max_tokens_per_batch"],
                batch_size=spec["batch_size"],
                padding_side="right",
                report_to=[],
                progress_bar=False,
            ),
            dpo=DPOSettings(beta=spec["beta"], loss_type="sigmoid", reference="model"),
        )
        session = start_session(cfg.model, cfg.train.seed, out, cfg)
        device = session.accelerator.device
        if device.type != spec["device"]:
            raise RuntimeError(f"asked for {spec['device']} but accelerate chose {device}")
        # As run_dpo does: a frozen reference built like the policy (same weights, kernel and dtype).
        ref_model = load_model(
            spec["model"],
            attn_implementation="varlen",
            dtype=next(session.model.parameters()).dtype,
            device=device,
            seed=0,
        ).requires_grad_(False)
        tokenizer = session.tokenizer
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        data = [PairExample(Example(c, cm), Example(r, rm)) for c, cm, r, rm in pairs]
        recipe = DPORecipe(data, cfg.train, cfg.dpo, pad_id, device, ref_model)
        trainer = loop.Trainer(recipe, session.model, tokenizer, cfg.train, session.accelerator)
        # The final checkpoint is not part of the measurement and would only write to disk.
        loop.save_checkpoint = lambda *args, **kwargs: None

        recorder, memory = PairRecorder(spec["warmup"], cuda=cuda), MemoryMeter(spec["device"])
        measured: dict[str, float] = {}
        inner = trainer._train_step

        def timed_step(step: loop.Step) -> dict[str, float]:
            for micro in step.micros:
                sides = [len(s) for p in micro.data for s in (p.chosen, p.rejected)]
                processed = len(sides) * max(sides) if batching == "padded" else sum(sides)
                targets = sum(s.num_targets for p in micro.data for s in (p.chosen, p.rejected))
                recorder.tokens(sum(sides), processed, targets)
                recorder.pairs(len(micro.data))
            metrics = inner(step)
            recorder.step_end(metrics.get("loss"))
            if len(recorder.records) == total:
                measured.update(memory.stop())
            return metrics

        trainer._train_step = timed_step
        memory.start()
        recorder.begin()
        trainer.train()
    result = recorder.summary()
    result.update(measured)
    if batching == "tokens":
        layout = f"packed, budget {spec['max_tokens_per_batch']} tok"
    else:
        layout = f"padded right, {spec['batch_size']} pairs"
    result.update(
        {
            "layout": layout,
            "attention": "varlen (per-sequence SDPA)" if not cuda else "varlen",
            "dtype": str(next(session.model.parameters()).dtype),
            "reference": "frozen copy, forward every step",
        }
    )
    return result


# --------------------------------------------------------------------------------------------------------
# Contender: TRL DPOTrainer


def trl_attention(choice: str, device: str) -> str:
    if choice == "auto":
        if device == "cuda":
            import importlib.util

            return "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa"
        return "sdpa"
    return choice


class _Captured:
    """A logging handler that keeps the messages TRL's DPO trainer logs (its padding_free warning)."""

    def __init__(self) -> None:
        import logging

        class Handler(logging.Handler):
            def __init__(self, sink: list[str]):
                super().__init__(logging.WARNING)
                self.sink = sink

            def emit(self, record: logging.LogRecord) -> None:
                self.sink.append(record.getMessage())

        self.messages: list[str] = []
        self.handler = Handler(self.messages)
        self.logger = logging.getLogger("trl.trainer.dpo_trainer")

    def __enter__(self) -> _Captured:
        self.logger.addHandler(self.handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.logger.removeHandler(self.handler)


def run_trl(spec: dict[str, Any], rows: list[dict[str, Any]], padding_free: bool) -> dict[str, Any]:
    import copy
    import warnings

    import datasets
    import torch
    import transformers

    try:
        import trl
        from trl import DPOConfig as TRLDPOConfig
        from trl import DPOTrainer
    except ImportError as e:
        raise RuntimeError("TRL is not installed: pip install 'padless[bench]'") from e
    from padless import tiny
    from padless.model import load_tokenizer

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    cuda = spec["device"] == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    attn = trl_attention(spec["trl_attn"], spec["device"])
    total = spec["warmup"] + spec["steps"]
    o = spec["optim"]

    # Same weights as padless: the embedded model from seed 0, or the checkpoint; the reference is a copy.
    if spec["model"] in tiny.TINY_MODELS:
        model = tiny.build_tiny_model(spec["model"], seed=0, attn_implementation=attn, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            spec["model"], attn_implementation=attn, dtype=dtype
        )
    ref_model = copy.deepcopy(model).requires_grad_(False).eval()
    tokenizer = load_tokenizer(spec["model"])
    dataset = datasets.Dataset.from_list(rows)

    recorder, memory = PairRecorder(spec["warmup"], cuda=cuda), MemoryMeter(spec["device"])
    measured: dict[str, float] = {}
    layouts: set[str] = set()

    class StepTimer(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            memory.start()
            recorder.begin()

        def on_step_end(self, args, state, control, **kwargs):
            recorder.step_end()
            if len(recorder.records) == total:
                measured.update(memory.stop())

    class CountingDPOTrainer(DPOTrainer):
        def training_step(self, model, inputs, *args, **kwargs):
            ids = inputs["input_ids"]
            mask = inputs.get("attention_mask")
            real = int(mask.sum()) if mask is not None else ids.numel()
            # Packed (padding-free) input would be one row with position_ids; TRL's padded batch is [2B, L].
            packed = ids.shape[0] == 1 and "position_ids" in inputs
            layouts.add("packed" if packed else f"padded [{2 * spec['batch_size']}, L]")
            recorder.tokens(real, ids.numel(), int(inputs["completion_mask"][:, 1:].sum()))
            recorder.pairs(ids.shape[0] // 2 if not packed else int(inputs["position_ids"].eq(0).sum()) // 2)
            loss = super().training_step(model, inputs, *args, **kwargs)
            recorder.loss(loss.item())
            return loss

    # TRL turns activation (gradient) checkpointing on by default; padless does not. transformers >= 5.2x
    # renamed the argument and warns about the old name.
    fields = transformers.TrainingArguments.__dataclass_fields__
    no_checkpointing = (
        {"activation_checkpointing": False}
        if "activation_checkpointing" in fields
        else {"gradient_checkpointing": False}
    )
    dpo_fields = TRLDPOConfig.__dataclass_fields__
    extra = {"padding_free": padding_free} if "padding_free" in dpo_fields else {}
    if padding_free and not extra:
        raise RuntimeError(f"TRL {trl.__version__} DPOConfig has no padding_free option")
    with tempfile.TemporaryDirectory(prefix="trl-dpo-bench-") as out, _Captured() as captured:
        args = TRLDPOConfig(
            output_dir=out,
            max_steps=total,
            per_device_train_batch_size=spec["batch_size"],
            gradient_accumulation_steps=1,
            learning_rate=o["learning_rate"],
            lr_scheduler_type=o["lr_scheduler"],
            warmup_steps=0,
            weight_decay=o["weight_decay"],
            adam_beta1=o["adam_beta1"],
            adam_beta2=o["adam_beta2"],
            adam_epsilon=o["adam_epsilon"],
            max_grad_norm=o["max_grad_norm"],
            optim="adamw_torch",  # torch.optim.AdamW, as padless
            seed=spec["seed"],
            **no_checkpointing,
            bf16=cuda,
            fp16=False,
            use_cpu=not cuda,
            beta=spec["beta"],
            loss_type=["sigmoid"],
            max_length=spec["max_length"],
            precompute_ref_log_probs=False,
            report_to="none",
            save_strategy="no",
            eval_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            **extra,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = CountingDPOTrainer(
                model=model,
                ref_model=ref_model,
                args=args,
                train_dataset=dataset,
                processing_class=tokenizer,
                callbacks=[StepTimer()],
            )
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # no end-of-run log line
        trainer.train()
    result = recorder.summary()
    result.update(measured)
    notes = [m for m in captured.messages + [str(w.message) for w in caught] if "padding_free" in m]
    honoured = getattr(trainer, "padding_free", padding_free)
    if padding_free:
        fell_back = not honoured or "packed" not in layouts
        verdict = "fell back to padding" if fell_back else "padding-free"
    else:
        verdict = "padded (default)"
    result.update(
        {
            "layout": f"{'packed' if 'packed' in layouts else 'padded right'}, {spec['batch_size']} pairs",
            "attention": attn,
            "dtype": str(next(model.parameters()).dtype),
            "reference": "frozen copy (ref_model), forward every step",
            "trl_version": trl.__version__,
            "padding_free_requested": padding_free,
            "padding_free_verdict": verdict,
            "layouts_seen": sorted(layouts),
            "trl_messages": notes,
        }
    )
    return result


# --------------------------------------------------------------------------------------------------------
# Report


TARGETS = {  # (numerator, denominator, minimum ratio of real tokens/s)
    "padless packed >= 1.7x TRL DPO (DESIGN)": ("padless-packed", "trl", 1.7),
}
RATIOS = (
    ("padless packed / TRL", "padless-packed", "trl"),
    ("padless packed / TRL padding_free", "padless-packed", "trl-padding-free"),
    ("padless packed / padless padded", "padless-packed", "padless-padded"),
    ("padless padded / TRL", "padless-padded", "trl"),
    ("TRL padding_free / TRL", "trl-padding-free", "trl"),
)


def report(spec: dict[str, Any], runs: dict[str, list[dict[str, Any]]], env: dict[str, Any]) -> dict:
    """Print the table (median run of each contender), ratios, targets and TRL's padding_free verdict."""
    chosen = {name: median_run(rs) for name, rs in runs.items() if rs}
    cuda = spec["device"] == "cuda"
    mem_key = "cuda_peak_mib" if cuda else "peak_rss_mib"
    headers = ["contender", "layout", "attention", "pairs/step", "tok/pair", "pairs/s", "real tok/s"]
    headers += ["median-step tok/s", "pad share", "peak CUDA MiB" if cuda else "peak RSS MiB"]
    headers += [] if cuda else ["RSS rise MiB"]
    headers += ["s/step", "loss first", "loss last 5"]
    rows = []
    for name, r in chosen.items():
        spread = ""
        if len(runs[name]) > 1:
            values = [x["real_tokens_per_s"] for x in runs[name]]
            spread = f" ({min(values):,.0f}-{max(values):,.0f})"
        row = [
            name,
            r["layout"],
            r["attention"],
            fmt_number(r["pairs_per_step"], 1),
            fmt_number(r["real_tokens_per_pair"]),
            fmt_number(r["pairs_per_s"], 2),
            fmt_number(r["real_tokens_per_s"]) + spread,
            fmt_number(r["real_tokens_per_s_median_step"]),
            f"{100 * r['pad_share']:.1f}%",
        ]
        if cuda:
            row.append(fmt_number(r.get("cuda_peak_mib")))
        else:
            row += [fmt_number(r.get("peak_rss_mib")), fmt_number(r.get("peak_rss_delta_mib"))]
        row += [f"{r['step_s_median']:.2f}", f"{r['first_loss']:.4f}", f"{r['final_loss_mean5']:.4f}"]
        rows.append(row)

    def get(name: str, key: str) -> float | None:
        return chosen[name].get(key) if name in chosen else None

    ratios = {
        label: {
            "pairs_per_s": ratio(get(a, "pairs_per_s"), get(b, "pairs_per_s")),
            "real_tokens_per_s": ratio(get(a, "real_tokens_per_s"), get(b, "real_tokens_per_s")),
            "median_step": ratio(
                get(a, "real_tokens_per_s_median_step"), get(b, "real_tokens_per_s_median_step")
            ),
            "memory": ratio(get(a, mem_key), get(b, mem_key)),
            "memory_rise": None
            if cuda
            else ratio(get(a, "peak_rss_delta_mib"), get(b, "peak_rss_delta_mib")),
        }
        for label, a, b in RATIOS
        if a in chosen and b in chosen
    }
    targets = {}
    for label, (a, b, minimum) in TARGETS.items():
        value = ratio(get(a, "real_tokens_per_s"), get(b, "real_tokens_per_s"))
        targets[label] = {"ratio": value, "met": None if value is None else value >= minimum}

    d = spec["data"]
    n_runs = max(len(rs) for rs in runs.values())
    table = markdown_table(headers, rows)
    subset = f" (pairs of <= {d['max_pair_tokens']} tokens)" if d["max_pair_tokens"] else ""
    print()
    print(
        f"DPO throughput on {spec['device']} ({env.get('gpu') or env['cpu']}), {spec['threads']} threads, "
        f"model {spec['model']}, data {d['spec']}{subset} ({d['pairs']} pairs, {d['tokens']:,} tokens, "
        f"per side median {d['median_side_len']:.0f} / max {d['max_side_len']} tokens), sigmoid loss, beta "
        f"{spec['beta']}, frozen reference model"
    )
    print(
        f"{spec['warmup']} warm-up + {spec['steps']} timed steps per contender, {n_runs} run(s) each "
        "(median run shown, range of runs in parentheses);"
    )
    print(
        f"TRL and padless padded: {spec['batch_size']} pairs/step; padless packed: budget "
        f"{spec['max_tokens_per_batch']} tokens/step = {d['packed_pairs_per_step']:.2f} pairs, "
        f"{d['packed_tokens_per_step']:,.0f} tokens per step on average over an epoch"
    )
    print()
    print(table)
    print()
    mem_label = "peak CUDA" if cuda else "peak RSS"
    print(f"{'ratio':36s} {'pairs/s':>8s} {'real tok/s':>10s} {'median step':>12s} {mem_label:>9s}", end="")
    print("" if cuda else f" {'RSS rise':>9s}")
    for label, v in ratios.items():
        line = (
            f"{label:36s} {fmt_ratio(v['pairs_per_s']):>8s} {fmt_ratio(v['real_tokens_per_s']):>10s} "
            f"{fmt_ratio(v['median_step']):>12s} {fmt_ratio(v['memory']):>9s}"
        )
        print(line + ("" if cuda else f" {fmt_ratio(v['memory_rise']):>9s}"))
    print()
    for label, t in targets.items():
        verdict = {None: "n/a", True: "met", False: "MISSED"}[t["met"]]
        print(f"target {label:44s} {fmt_ratio(t['ratio']):>7s}  {verdict}")
    trl_pf = chosen.get("trl-padding-free")
    padding_free = None
    if trl_pf is not None:
        padding_free = {
            "verdict": trl_pf["padding_free_verdict"],
            "layouts_seen": trl_pf["layouts_seen"],
            "pad_share": trl_pf["pad_share"],
            "messages": trl_pf["trl_messages"],
        }
        said = "; TRL said: " + " | ".join(trl_pf["trl_messages"]) if trl_pf["trl_messages"] else ""
        print(
            f"TRL {trl_pf['trl_version']} padding_free=True: {trl_pf['padding_free_verdict']} "
            f"(batches seen: {', '.join(trl_pf['layouts_seen'])}; padding share "
            f"{100 * trl_pf['pad_share']:.1f}%){said}"
        )
    for name, rs in runs.items():
        if not rs:
            print(f"{name}: no successful run (see the errors above)")
    return {"ratios": ratios, "targets": targets, "table": table, "trl_padding_free": padding_free}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hide_devices_for_cpu(args.device)
    limit_threads(args.threads)
    env = environment()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("--device cuda: no CUDA device is visible", file=sys.stderr)
            return 2
        env["gpu"] = torch.cuda.get_device_name()
    pairs, rows = load_data(args)
    spec = plan(args, pairs)
    d = spec["data"]
    print(
        f"{d['pairs']} pairs, {d['tokens']:,} tokens; padless packed: budget {spec['max_tokens_per_batch']}, "
        f"{d['packed_steps_per_epoch']} steps/epoch, {d['packed_pairs_per_step']:.2f} pairs and "
        f"{d['packed_tokens_per_step']:,.0f} tokens/step; TRL and padless padded: {spec['batch_size']} "
        f"pairs/step, {d['padded_steps_per_epoch']} steps/epoch, expected padding share "
        f"{100 * d['padded_pad_share_expected']:.0f}%",
        flush=True,
    )
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.contenders}
    errors: dict[str, list[str]] = {}
    for repeat in range(args.repeats):
        for name in args.contenders:
            started = time.perf_counter()
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
            out = run_isolated(run_contender, name=name, spec=spec, pairs=pairs, rows=rows)
            wall = time.perf_counter() - started
            if not out["ok"]:
                errors.setdefault(name, []).append(out["error"])
                print(
                    f"[{repeat + 1}/{args.repeats}] {name}: FAILED {out['error']}\n{out['traceback']}",
                    flush=True,
                )
                continue
            r = out["value"]
            r.update({"repeat": repeat, "wall_s": wall, "loadavg_1m_before": load})
            runs[name].append(r)
            print(
                f"[{repeat + 1}/{args.repeats}] {name}: {r['pairs_per_s']:.2f} pairs/s, "
                f"{r['real_tokens_per_s']:,.0f} real tok/s, pad {100 * r['pad_share']:.1f}%, "
                f"{r['seconds']:.1f} s timed, {wall:.0f} s wall, loss {r['first_loss']:.4f} -> "
                f"{r['final_loss']:.4f}",
                flush=True,
            )
    if hasattr(os, "getloadavg"):
        env["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    summary = report(spec, runs, env) if any(runs.values()) else {}
    if args.json:
        path = write_json(
            args.json, {"environment": env, "spec": spec, "runs": runs, "errors": errors, **summary}
        )
        print(f"\nwrote {path}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
