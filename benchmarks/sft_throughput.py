"""SFT throughput: padless packed vs padless padded vs TRL SFTTrainer (padding-free and padded).

Same model, same tokenized data (the embedded ``tiny:sft`` chats through ``padless.data.tokenize_sft``,
loss on assistant tokens only), same optimizer settings, same machine, one run. Each contender trains in a
fresh subprocess (so its peak memory is its own) with the same thread count:

* ``padless-packed``  the real padless path: ``SFTRecipe`` on the shared ``Trainer`` loop, token-budget
  micro-batches (``max_tokens_per_batch``), one packed row per step, ``varlen`` attention.
* ``padless-padded``  the same loop with ``batching: padded`` (right padding), batch size chosen so that
  the real tokens per step match the packed run's on average.
* ``trl-padding-free``  TRL ``SFTTrainer`` with ``padding_free=True``, the same number of sequences per
  step as the padded runs (so about the same tokens per step as padless packed).
* ``trl-padded``  TRL ``SFTTrainer`` with ``padding_free=False``.

TRL gets the pre-tokenized data with a ``labels`` column that carries padless's assistant-only mask, so
both compute the loss on exactly the same tokens and TRL does no tokenization. Timing runs from the end of
the last warm-up step to the end of the last timed step (data loading, collation and per-step bookkeeping
included, for every contender). Neither side saves checkpoints, evaluates or logs to disk.

    python benchmarks/sft_throughput.py                 # full run on CPU (2 threads)
    python benchmarks/sft_throughput.py --quick         # smoke run, well under 2 minutes
    python benchmarks/sft_throughput.py --device cuda   # GPU, bf16
    python benchmarks/sft_throughput.py --json results.json --repeats 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

try:  # run as a script (benchmarks/ on sys.path) or as a module from the repo root
    from common import (
        MemoryMeter,
        StepRecorder,
        environment,
        fmt_number,
        fmt_ratio,
        git_state,
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
        git_state,
        hide_devices_for_cpu,
        limit_threads,
        markdown_table,
        median_run,
        ratio,
        run_isolated,
        write_json,
    )

CONTENDERS = ("padless-packed", "padless-padded", "trl-padding-free", "trl-padded")
IGNORE_INDEX = -100

# Optimizer and schedule shared by every contender (padless's defaults).
OPTIM = {
    "learning_rate": 1e-4,
    "weight_decay": 0.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1e-8,
    "max_grad_norm": 1.0,
    "lr_scheduler": "cosine",
}


# --------------------------------------------------------------------------------------------------------
# Parent: data, plan, orchestration


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-qwen2", help="embedded name, local directory or cached HF id")
    p.add_argument(
        "--data", default="tiny:sft", help="SFT data (jsonl/json/parquet, datasets dir, tiny:<name>)"
    )
    p.add_argument("--max-length", type=int, default=2048, help="longer rows are an error (as in padless)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for every contender")
    p.add_argument(
        "--max-tokens-per-batch",
        type=int,
        default=None,
        help="padless token budget per step (default 4096; 1024 with --quick)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="sequences per step for the padded and TRL runs (default: matches the packed tokens per step)",
    )
    p.add_argument("--steps", type=int, default=None, help="timed optimizer steps per contender")
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
        "flash-attn is installed, else sdpa), sdpa, eager, flash_attention_2, or varlen (padless's kernel)",
    )
    p.add_argument("--seed", type=int, default=42, help="data order seed (model init is always seed 0)")
    p.add_argument(
        "--quick", action="store_true", help="smoke run: 1 warm-up + 2 timed steps of 1024 tokens (< 2 min)"
    )
    p.add_argument("--json", default=None, help="write all results (every run, every step loss) here")
    p.add_argument("--profile", default=None, help="directory for one cProfile file per contender")
    p.add_argument("--report", default=None, help="print the table of a saved --json file and exit")
    args = p.parse_args(argv)
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [c for c in args.contenders if c not in CONTENDERS]
    if unknown:
        p.error(f"unknown contender(s) {', '.join(unknown)}; choose from {', '.join(CONTENDERS)}")
    if args.max_tokens_per_batch is None:
        args.max_tokens_per_batch = 1024 if args.quick else 4096
    if args.warmup is None:
        args.warmup = 1 if args.quick else 3
    if args.steps is None:
        args.steps = 2 if args.quick else (30 if args.device == "cpu" else 100)
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1 or args.threads < 1:
        p.error("--steps and --repeats and --threads must be >= 1, --warmup >= 0")
    return args


def tokenize(args: argparse.Namespace) -> list[tuple[list[int], list[bool]]]:
    """Examples as (input_ids, loss_mask), tokenized once in the parent so every contender sees the same."""
    from padless.data import load_rows, tokenize_sft
    from padless.model import load_tokenizer

    examples, _ = tokenize_sft(load_rows(args.data), load_tokenizer(args.model), max_length=args.max_length)
    return [(e.input_ids, list(e.loss_mask)) for e in examples]


def plan(args: argparse.Namespace, examples: list[tuple[list[int], list[bool]]]) -> dict[str, Any]:
    """Everything a contender needs: settings, data, and the batch size that matches packed tokens/step."""
    from padless.packing import budget_batches

    lengths = [len(ids) for ids, _ in examples]
    if args.quick:  # the small smoke-run budget must still hold the longest example
        args.max_tokens_per_batch = max(args.max_tokens_per_batch, max(lengths))
    bins = budget_batches(lengths, args.max_tokens_per_batch, seed=args.seed)
    packed_tokens_per_step = sum(lengths) / len(bins)
    mean_len = sum(lengths) / len(lengths)
    batch_size = args.batch_size or max(1, round(packed_tokens_per_step / mean_len))
    return {
        "model": args.model,
        "device": args.device,
        "threads": args.threads,
        "warmup": args.warmup,
        "steps": args.steps,
        "seed": args.seed,
        "max_length": args.max_length,
        "max_tokens_per_batch": args.max_tokens_per_batch,
        "batch_size": batch_size,
        "trl_attn": args.trl_attn,
        "profile": args.profile,
        "optim": OPTIM,
        "data": {
            "spec": args.data,
            "examples": len(lengths),
            "tokens": sum(lengths),
            "target_tokens": sum(sum(m[1:]) for _, m in examples),
            "mean_len": mean_len,
            "median_len": statistics.median(lengths),
            "max_len": max(lengths),
            "packed_steps_per_epoch": len(bins),
            "packed_tokens_per_step": packed_tokens_per_step,
        },
    }


def run_contender(name: str, spec: dict[str, Any], examples: list[tuple[list[int], list[bool]]]) -> dict:
    """Entry point of a contender's subprocess."""
    limit_threads(spec["threads"])
    import torch

    torch.set_num_threads(spec["threads"])
    runner = {
        "padless-packed": lambda: run_padless(spec, examples, "tokens"),
        "padless-padded": lambda: run_padless(spec, examples, "padded"),
        "trl-padding-free": lambda: run_trl(spec, examples, padding_free=True),
        "trl-padded": lambda: run_trl(spec, examples, padding_free=False),
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
            profiler.dump_stats(os.path.join(spec["profile"], f"{name}.prof"))
    result["threads_in_use"] = torch.get_num_threads()
    result["profiled"] = bool(profiler)
    return result


# --------------------------------------------------------------------------------------------------------
# Contender: padless (the real SFT recipe on the shared Trainer loop)


def run_padless(spec: dict[str, Any], examples: list, batching: str) -> dict[str, Any]:
    import padless.trainers.loop as loop
    from padless.config import DataSettings, ModelSettings, SFTConfig, TrainSettings
    from padless.packing import Example
    from padless.trainers.session import start_session
    from padless.trainers.sft import SFTRecipe

    total = spec["warmup"] + spec["steps"]
    o = spec["optim"]
    cuda = spec["device"] == "cuda"
    with tempfile.TemporaryDirectory(prefix="padless-bench-") as out:
        cfg = SFTConfig(
            model=ModelSettings(name=spec["model"], attn_implementation="varlen", dtype="auto", seed=0),
            data=DataSettings(train=spec["data"]["spec"], max_length=spec["max_length"]),
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
        )
        session = start_session(cfg.model, cfg.train.seed, out, cfg)
        if session.accelerator.device.type != spec["device"]:
            raise RuntimeError(
                f"asked for {spec['device']} but accelerate chose {session.accelerator.device}"
            )
        data = [Example(ids, mask) for ids, mask in examples]
        recipe = SFTRecipe(data, cfg.train, session.tokenizer, session.accelerator.device)
        trainer = loop.Trainer(recipe, session.model, session.tokenizer, cfg.train, session.accelerator)
        # The final checkpoint is not part of the measurement and would only write to disk.
        loop.save_checkpoint = lambda *args, **kwargs: None

        recorder, memory = StepRecorder(spec["warmup"], cuda=cuda), MemoryMeter(spec["device"])
        measured: dict[str, float] = {}
        inner = trainer._train_step

        def timed_step(step: loop.Step) -> dict[str, float]:
            for micro in step.micros:
                lens = [len(e) for e in micro.data]
                processed = len(lens) * max(lens) if batching == "padded" else sum(lens)
                recorder.tokens(sum(lens), processed, int(micro.units))
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
    kernel = "varlen (per-sequence SDPA)" if not cuda else "varlen"
    layout = "packed, token budget" if batching == "tokens" else f"padded right, {spec['batch_size']} seqs"
    result.update(
        {"layout": layout, "attention": kernel, "dtype": str(next(session.model.parameters()).dtype)}
    )
    return result


# --------------------------------------------------------------------------------------------------------
# Contender: TRL SFTTrainer


def trl_attention(choice: str, device: str) -> str:
    if choice == "auto":
        if device == "cuda":
            import importlib.util

            return "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa"
        return "sdpa"
    if choice == "varlen":
        from padless.attention import VARLEN_NAME

        return VARLEN_NAME
    return choice


def run_trl(spec: dict[str, Any], examples: list, padding_free: bool) -> dict[str, Any]:
    import datasets
    import torch
    import transformers

    try:
        import trl
        from trl import SFTConfig as TRLSFTConfig
        from trl import SFTTrainer
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

    # Same weights as padless: the embedded model from seed 0, or the checkpoint.
    if spec["model"] in tiny.TINY_MODELS:
        model = tiny.build_tiny_model(spec["model"], seed=0, attn_implementation=attn, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            spec["model"], attn_implementation=attn, dtype=dtype
        )
    tokenizer = load_tokenizer(spec["model"])
    # Pre-tokenized: labels carry padless's assistant-only mask (HF convention: unshifted, -100 = no loss).
    dataset = datasets.Dataset.from_dict(
        {
            "input_ids": [ids for ids, _ in examples],
            "labels": [
                [t if m else IGNORE_INDEX for t, m in zip(ids, mask, strict=True)] for ids, mask in examples
            ],
        }
    )
    recorder, memory = StepRecorder(spec["warmup"], cuda=cuda), MemoryMeter(spec["device"])
    measured: dict[str, float] = {}

    class StepTimer(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            memory.start()
            recorder.begin()

        def on_step_end(self, args, state, control, **kwargs):
            recorder.step_end()
            if len(recorder.records) == total:
                measured.update(memory.stop())

    class CountingSFTTrainer(SFTTrainer):
        def training_step(self, model, inputs, *args, **kwargs):
            ids = inputs["input_ids"]
            real = int(inputs["attention_mask"].sum()) if "attention_mask" in inputs else ids.numel()
            recorder.tokens(real, ids.numel(), int((inputs["labels"] != IGNORE_INDEX).sum()))
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
    with tempfile.TemporaryDirectory(prefix="trl-bench-") as out:
        args = TRLSFTConfig(
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
            padding_free=padding_free,
            max_length=None,  # padding_free without packing refuses a max_length; data fits anyway
            assistant_only_loss=False,  # the labels column already masks everything but assistant tokens
            completion_only_loss=False,
            report_to="none",
            save_strategy="no",
            eval_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = CountingSFTTrainer(
            model=model, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[StepTimer()]
        )
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # no end-of-run log line
        trainer.train()
    result = recorder.summary()
    result.update(measured)
    layout = "padding-free" if padding_free else "padded right"
    result.update(
        {
            "layout": f"{layout}, {spec['batch_size']} seqs",
            "attention": attn,
            "dtype": str(next(model.parameters()).dtype),
            "trl_version": trl.__version__,
        }
    )
    return result


# --------------------------------------------------------------------------------------------------------
# Report


TARGETS = {  # (numerator, denominator, minimum ratio of real tokens/s)
    "padless packed >= 1.5x padless padded (issue)": ("padless-packed", "padless-padded", 1.5),
    "padless packed >= 1.1x TRL padding-free (DESIGN)": ("padless-packed", "trl-padding-free", 1.1),
}
RATIOS = (
    ("padless packed / padless padded", "padless-packed", "padless-padded"),
    ("padless packed / TRL padding-free", "padless-packed", "trl-padding-free"),
    ("padless packed / TRL padded", "padless-packed", "trl-padded"),
    ("TRL padding-free / TRL padded", "trl-padding-free", "trl-padded"),
)


def paired_ratios(num: list[dict[str, Any]], den: list[dict[str, Any]]) -> list[float]:
    """Real tokens/s ratio within each repeat that both contenders completed."""
    by_repeat = {r["repeat"]: r["real_tokens_per_s"] for r in den}
    return [r["real_tokens_per_s"] / by_repeat[r["repeat"]] for r in num if r["repeat"] in by_repeat]


def report(spec: dict[str, Any], runs: dict[str, list[dict[str, Any]]], env: dict[str, Any]) -> dict:
    """Print the table (median run of each contender), ratios and targets; return them for the JSON."""
    chosen = {name: median_run(rs) for name, rs in runs.items() if rs}
    cuda = spec["device"] == "cuda"
    mem_key = "cuda_peak_mib" if cuda else "peak_rss_delta_mib"
    headers = ["contender", "layout", "attention", "real tok/step", "real tok/s", "median-step tok/s"]
    headers += ["pad share", "peak CUDA MiB" if cuda else "peak RSS MiB"]
    headers += [] if cuda else ["RSS rise MiB"]
    headers += ["s/step", "loss (last 5)"]
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
            fmt_number(r["real_tokens_per_step"]),
            fmt_number(r["real_tokens_per_s"]) + spread,
            fmt_number(r["real_tokens_per_s_median_step"]),
            f"{100 * r['pad_share']:.1f}%",
        ]
        if cuda:
            row.append(fmt_number(r.get("cuda_peak_mib")))
        else:
            row += [fmt_number(r.get("peak_rss_mib")), fmt_number(r.get("peak_rss_delta_mib"))]
        row += [f"{r['step_s_median']:.2f}", f"{r['final_loss_mean5']:.4f}"]
        rows.append(row)

    def get(name: str, key: str) -> float | None:
        return chosen[name].get(key) if name in chosen else None

    ratios = {
        label: {
            "real_tokens_per_s": ratio(get(a, "real_tokens_per_s"), get(b, "real_tokens_per_s")),
            "median_step": ratio(
                get(a, "real_tokens_per_s_median_step"), get(b, "real_tokens_per_s_median_step")
            ),
            "memory": ratio(get(a, mem_key), get(b, mem_key)),
            # Runs of the same repeat ran minutes apart: their ratio sees similar load from other processes.
            "per_repeat": paired_ratios(runs.get(a, []), runs.get(b, [])),
        }
        for label, a, b in RATIOS
    }
    targets = {}
    for label, (a, b, minimum) in TARGETS.items():
        value = ratio(get(a, "real_tokens_per_s"), get(b, "real_tokens_per_s"))
        targets[label] = {"ratio": value, "met": None if value is None else value >= minimum}

    d = spec["data"]
    n_runs = max(len(rs) for rs in runs.values())
    table = markdown_table(headers, rows)
    print()
    print(
        f"SFT throughput on {spec['device']} ({env.get('gpu') or env['cpu']}), {spec['threads']} threads, "
        f"model {spec['model']}, data {d['spec']} ({d['examples']} examples, {d['tokens']:,} tokens, "
        f"median {d['median_len']:.0f} / max {d['max_len']} tokens)"
    )
    git, versions = env.get("git", {}), env.get("versions", {})
    dirty = " (uncommitted library edits)" if git.get("library_dirty") else ""
    print(
        f"padless {versions.get('padless')} at {git.get('commit')}{dirty}, torch {versions.get('torch')}, "
        f"transformers {versions.get('transformers')}, TRL {versions.get('trl')}; {env.get('date')}"
    )
    print(
        f"{spec['warmup']} warm-up + {spec['steps']} timed steps per contender, {n_runs} run(s) each "
        "(median run shown, range of runs in parentheses);"
    )
    print(
        f"packed: budget {spec['max_tokens_per_batch']} tokens/step; "
        f"padded and TRL: {spec['batch_size']} sequences/step"
    )
    print()
    print(table)
    print()
    mem_label = "peak CUDA memory" if cuda else "peak RSS rise"
    print(f"{'ratio':36s} {'real tok/s':>10s} {'median step':>12s} {mem_label:>16s}  per repeat")
    for label, v in ratios.items():
        pairs = ", ".join(fmt_ratio(x) for x in v["per_repeat"]) if n_runs > 1 else ""
        print(
            f"{label:36s} {fmt_ratio(v['real_tokens_per_s']):>10s} {fmt_ratio(v['median_step']):>12s} "
            f"{fmt_ratio(v['memory']):>16s}  {pairs}"
        )
    print()
    for label, t in targets.items():
        verdict = {None: "n/a", True: "met", False: "MISSED"}[t["met"]]
        print(f"target {label:50s} {fmt_ratio(t['ratio']):>7s}  {verdict}")
    for name, rs in runs.items():
        if not rs:
            print(f"{name}: no successful run (see the errors above)")
    return {"ratios": ratios, "targets": targets, "table": table}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        import json

        with open(args.report) as f:
            saved = json.load(f)
        report(saved["spec"], saved["runs"], saved["environment"])
        return 0
    hide_devices_for_cpu(args.device)
    limit_threads(args.threads)
    env = environment()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("--device cuda: no CUDA device is visible", file=sys.stderr)
            return 2
        env["gpu"] = torch.cuda.get_device_name()
    examples = tokenize(args)
    spec = plan(args, examples)
    d = spec["data"]
    print(
        f"{d['examples']} examples, {d['tokens']:,} tokens; packed: {d['packed_steps_per_epoch']} "
        f"steps/epoch, {d['packed_tokens_per_step']:,.0f} tokens/step; padded and TRL: "
        f"{spec['batch_size']} sequences/step",
        flush=True,
    )
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.contenders}
    errors: dict[str, list[str]] = {}
    for repeat in range(args.repeats):
        for name in args.contenders:
            started = time.perf_counter()
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
            out = run_isolated(run_contender, name=name, spec=spec, examples=examples)
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
                f"[{repeat + 1}/{args.repeats}] {name}: {r['real_tokens_per_s']:,.0f} real tok/s, "
                f"pad {100 * r['pad_share']:.1f}%, {r['seconds']:.1f} s timed, {wall:.0f} s wall, "
                f"loss {r['final_loss']:.4f}",
                flush=True,
            )
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


if __name__ == "__main__":
    sys.exit(main())
