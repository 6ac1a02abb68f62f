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
import random
import statistics
import sys
import tempfile
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
    args = common.parse_benchmark_args(
        p, argv, CONTENDERS, cpu_steps=30, quick_help=quick, model="tiny-qwen2.5-vl"
    )
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
    from padless.data.sources import image_inputs

    images = image_inputs(spec["model"], model)
    data = [DataRow(r, spec["data"]["spec"], i) for i, r in enumerate(rows)]
    examples, _ = tokenize_sft(data, images.tokenizer, max_length=spec["max_length"], images=images)
    return examples


def plan(args: argparse.Namespace, rows: list[Row]) -> dict[str, Any]:
    """Settings, data facts, and the padded batch size that matches packed tokens per step."""
    from padless.forward.packing import budget_batches
    from padless.proof.load import load_model

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
    return common.run_padless_sft(spec, batching, lambda session: tokenize(spec, rows, session.model))


# --------------------------------------------------------------------------------------------------------
# Contender: TRL SFTTrainer with its vision collator


def run_trl(spec: dict[str, Any], rows: list[Row]) -> dict[str, Any]:
    import io

    import datasets
    from PIL import Image

    from padless.data.sources import load_processor

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
    return common.sft_report(spec, runs, env, "VLM SFT throughput, a picture in every row", RATIOS, TARGETS)


def main(argv: list[str] | None = None) -> int:
    return common.run_benchmark(parse_args(argv), prepare, run_contender, common.loss_progress, report)


if __name__ == "__main__":
    sys.exit(main())
