"""Vision-language SFT throughput: padless packed vs padless padded vs TRL SFTTrainer (padded).

Same model (the embedded ``tiny-qwen2.5-vl`` by default, fp32 on CPU), same rows, same optimizer settings,
same machine, one run; each contender trains in a fresh subprocess with the same thread count:

* ``padless-packed``  the real padless path: ``SFTRecipe`` on the shared ``Trainer`` loop, token-budget
  micro-batches, one packed row per step with every sample's pixel values concatenated and M-RoPE
  positions ``[4, 1, T]`` computed per sample, ``varlen`` attention.
* ``padless-padded``  the same loop with ``batching: padded`` (right padding), the batch size chosen so that
  real tokens per step match the packed run's on average.
* ``trl-padded``  TRL ``SFTTrainer`` on the same rows (``messages`` + ``images``), the same sequences per
  step. TRL refuses ``padding_free`` for vision datasets ("not supported"), so padded is what it offers.

The rows are long-tailed chats (``tiny:sft``, median 79 / max 672 text tokens) with a drawn shape picture
(``padless.tiny.shapes``, 4 to 16 image tokens) put before the first user message: every row has an image,
lengths vary as in real captioning / visual chat data. padless tokenizes them once before training (its
data path: the model's processor, loss on assistant tokens); TRL's vision collator runs the processor on
every batch (its only path for image data), which is inside its timed steps, and computes the loss on
every token (the model computes full logits either way). Timing runs from the end of the last warm-up
step to the end of the last timed step. Nothing is evaluated, saved or logged to disk.

    python benchmarks/vlm_sft_throughput.py                 # full run on CPU (2 threads)
    python benchmarks/vlm_sft_throughput.py --quick         # smoke run
    python benchmarks/vlm_sft_throughput.py --json results.json --repeats 2
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

try:  # run as a script (benchmarks/ on sys.path) or as a module from the repo root
    import common
except ModuleNotFoundError:
    from benchmarks import common

CONTENDERS = ("padless-packed", "padless-padded", "trl-padded")
IGNORE_INDEX = -100
OPTIM = common.optimizer_settings(learning_rate=1e-4)  # padless's SFT default

# A row as the subprocesses receive it: messages whose contents are lists of parts, and PNG bytes.
Row = dict[str, Any]


# --------------------------------------------------------------------------------------------------------
# Parent: data, plan, orchestration


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="tiny:sft", help="chats a picture is added to (SFT messages data)")
    p.add_argument("--max-length", type=int, default=2048, help="longer rows are an error (as in padless)")
    p.add_argument(
        "--max-tokens-per-batch",
        type=int,
        default=None,
        help="padless token budget per step (default 4096; 1024 with --quick)",
    )
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step for the padded runs")
    p.add_argument("--report", default=None, help="print the table of a saved --json file and exit")
    quick = "smoke run: 1 warm-up + 2 timed steps of 1024 tokens"
    args = common.parse_benchmark_args(p, argv, CONTENDERS, cpu_steps=30, quick_help=quick)
    if args.model == "tiny-qwen2":  # the shared default is a text model
        args.model = "tiny-qwen2.5-vl"
    if args.max_tokens_per_batch is None:
        args.max_tokens_per_batch = 1024 if args.quick else 4096
    return args


def as_parts(content: Any) -> list[dict[str, str]]:
    return content if isinstance(content, list) else [{"type": "text", "text": content}]


def picture_rows(args: argparse.Namespace) -> list[Row]:
    """The text chats, each with a shape picture before its first user message (contents as parts, which
    both padless and TRL's vision collator read)."""
    from padless.data import load_rows
    from padless.tiny import shapes

    rng = random.Random(args.seed)
    rows = []
    for row in load_rows(args.data):
        messages = [{**m, "content": as_parts(m["content"])} for m in row.data["messages"]]
        first = next(i for i, m in enumerate(messages) if m["role"] == "user")
        messages[first]["content"] = [{"type": "image"}, *messages[first]["content"]]
        png, _ = shapes.draw(rng)
        rows.append({"messages": messages, "images": [{"bytes": png}]})
    return rows


def tokenize(spec: dict[str, Any], rows: list[Row], model: Any) -> list[Any]:
    """padless's examples of the rows (input ids, assistant loss mask, pixel values, M-RoPE rows)."""
    from padless.data import Row as DataRow
    from padless.data import tokenize_sft
    from padless.data.images import ImageInputs

    images = ImageInputs.for_model(spec["model"], model)
    data = [DataRow(r, spec["data"]["spec"], i) for i, r in enumerate(rows)]
    examples, _ = tokenize_sft(data, images.tokenizer, max_length=spec["max_length"], images=images)
    return examples


def plan(args: argparse.Namespace, rows: list[Row]) -> dict[str, Any]:
    """Settings, data facts, and the padded batch size that matches packed tokens per step."""
    from padless.model import load_model
    from padless.packing import budget_batches

    spec = {**common.base_spec(args, OPTIM), "data": {"spec": args.data}}
    lengths = [len(e) for e in tokenize(spec, rows, load_model(args.model, probe=False))]
    if args.quick:  # the small smoke-run budget must still hold the longest example
        args.max_tokens_per_batch = max(args.max_tokens_per_batch, max(lengths))
    bins = budget_batches(lengths, args.max_tokens_per_batch, seed=args.seed)
    packed_tokens_per_step = sum(lengths) / len(bins)
    mean_len = sum(lengths) / len(lengths)
    batch_size = args.batch_size or max(1, round(packed_tokens_per_step / mean_len))
    spec["max_tokens_per_batch"] = args.max_tokens_per_batch
    spec["batch_size"] = batch_size
    spec["data"].update(
        {
            "examples": len(lengths),
            "images": len(rows),
            "tokens": sum(lengths),
            "mean_len": mean_len,
            "median_len": statistics.median(lengths),
            "max_len": max(lengths),
            "packed_steps_per_epoch": len(bins),
            "packed_tokens_per_step": packed_tokens_per_step,
        }
    )
    return spec


def prepare(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    rows = picture_rows(args)
    spec = plan(args, rows)
    d = spec["data"]
    print(
        f"{d['examples']} rows with a picture each, {d['tokens']:,} tokens; packed: "
        f"{d['packed_steps_per_epoch']} steps/epoch, {d['packed_tokens_per_step']:,.0f} tokens/step; "
        f"padded: {spec['batch_size']} sequences/step",
        flush=True,
    )
    return spec, {"rows": rows}


def run_contender(name: str, spec: dict[str, Any], rows: list[Row]) -> dict:
    """Entry point of a contender's subprocess."""
    runner = {
        "padless-packed": lambda: run_padless(spec, rows, "tokens"),
        "padless-padded": lambda: run_padless(spec, rows, "padded"),
        "trl-padded": lambda: run_trl(spec, rows),
    }[name]
    return common.contender_main(runner, spec, profile_name=name)


# --------------------------------------------------------------------------------------------------------
# Contender: padless (the real SFT recipe on the shared Trainer loop)


def run_padless(spec: dict[str, Any], rows: list[Row], batching: str) -> dict[str, Any]:
    import padless.trainers.loop as loop
    from padless.config import DataSettings, SFTConfig
    from padless.trainers.sft import SFTRecipe

    run = common.Measurement(spec)
    with tempfile.TemporaryDirectory(prefix="padless-bench-") as out:
        model, train = common.padless_settings(spec, out, batching)
        data_settings = DataSettings(train=spec["data"]["spec"], max_length=spec["max_length"])
        cfg = SFTConfig(model=model, data=data_settings, train=train)
        session = common.start_padless(cfg, out, spec["device"])
        examples = tokenize(spec, rows, session.model)
        recipe = SFTRecipe(examples, cfg.train, session.tokenizer, session.accelerator.device)
        engine = session.engine()
        trainer = loop.Trainer(recipe, engine, session.tokenizer, cfg.train, session.accelerator)

        def count(micro: loop.MicroBatch) -> None:
            lens = [len(e) for e in micro.data]
            processed = len(lens) * max(lens) if batching == "padded" else sum(lens)
            run.recorder.tokens(sum(lens), processed, int(micro.units))

        common.train_padless(trainer, run, count)
    layout = "packed, token budget" if batching == "tokens" else f"padded right, {spec['batch_size']} seqs"
    return run.result(session.model, layout, common.padless_attention(run.cuda))


# --------------------------------------------------------------------------------------------------------
# Contender: TRL SFTTrainer with its vision collator


def run_trl(spec: dict[str, Any], rows: list[Row]) -> dict[str, Any]:
    import io

    import datasets
    from PIL import Image

    from padless.sources import load_processor

    trl = common.import_trl()
    model, _, attn = common.trl_model(spec)
    pictures = [[Image.open(io.BytesIO(p["bytes"])).convert("RGB") for p in r["images"]] for r in rows]
    dataset = datasets.Dataset.from_dict({"messages": [r["messages"] for r in rows], "images": pictures})
    run = common.Measurement(spec)

    def count(inputs: dict[str, Any]) -> None:
        ids = inputs["input_ids"]
        real = int(inputs["attention_mask"].sum())
        run.recorder.tokens(real, ids.numel(), int((inputs["labels"] != IGNORE_INDEX).sum()))

    with tempfile.TemporaryDirectory(prefix="trl-bench-") as out:
        args = trl.SFTConfig(**common.trl_args(spec, out), padding_free=False, max_length=None)
        trainer = common.counting_trainer(trl.SFTTrainer, run, count)(
            model=model, args=args, train_dataset=dataset, processing_class=load_processor(spec["model"])
        )
        common.train_trl(trainer, run)
    layout = f"padded right, {spec['batch_size']} seqs"
    return run.result(model, layout, attn, trl_version=trl.__version__)


# --------------------------------------------------------------------------------------------------------
# Report


TARGETS = {  # (numerator, denominator, minimum ratio of real tokens/s)
    "padless packed > padless padded": ("padless-packed", "padless-padded", 1.0),
    "padless packed > TRL padded": ("padless-packed", "trl-padded", 1.0),
}
RATIOS = (
    ("padless packed / padless padded", "padless-packed", "padless-padded"),
    ("padless packed / TRL padded", "padless-packed", "trl-padded"),
    ("padless padded / TRL padded", "padless-padded", "trl-padded"),
)


def report(spec: dict[str, Any], runs: common.Runs, env: dict[str, Any]) -> dict:
    """Print the table (median run of each contender), ratios and targets; return them for the JSON."""
    results = common.Results(spec, runs)
    mem_key = "cuda_peak_mib" if results.cuda else "peak_rss_delta_mib"
    table = results.table(
        before=[("real tok/step", lambda r: common.fmt_number(r["real_tokens_per_step"]))],
        after=[("loss (last 5)", lambda r: f"{r['final_loss_mean5']:.4f}")],
    )
    ratios = {label: results.throughput_ratios(a, b, mem_key) for label, a, b in RATIOS}
    targets = results.targets(TARGETS)
    d = spec["data"]
    print()
    print(
        f"VLM SFT throughput on {common.machine_line(spec, env)}, {d['examples']} rows of {d['spec']} with "
        f"a picture each ({d['tokens']:,} tokens, median {d['median_len']:.0f} / max {d['max_len']} tokens)"
    )
    git, versions = env.get("git", {}), env.get("versions", {})
    dirty = " (uncommitted library edits)" if git.get("library_dirty") else ""
    print(
        f"padless {versions.get('padless')} at {git.get('commit')}{dirty}, torch {versions.get('torch')}, "
        f"transformers {versions.get('transformers')}, TRL {versions.get('trl')}; {env.get('date')}"
    )
    print(results.runs_line(spec))
    budget, seqs = spec["max_tokens_per_batch"], spec["batch_size"]
    print(f"packed: budget {budget} tokens/step; padded: {seqs} sequences/step")
    print()
    print(table)
    print()
    mem_label = "peak CUDA memory" if results.cuda else "peak RSS rise"
    columns = [("real tok/s", "real_tokens_per_s", 10), ("median step", "median_step", 12)]
    common.print_ratios(ratios, [*columns, (mem_label, "memory", 16)])
    print()
    common.print_targets(targets, width=36)
    results.print_failures()
    return {"ratios": ratios, "targets": targets, "table": table}


def progress(r: dict[str, Any]) -> str:
    return f"{common.throughput_line(r)}, loss {r['final_loss']:.4f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        report(saved["spec"], saved["runs"], saved["environment"])
        return 0
    return common.run_benchmark(args, prepare, run_contender, progress, report)


if __name__ == "__main__":
    sys.exit(main())
