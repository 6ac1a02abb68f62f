"""SFT throughput: padless packed and padded vs TRL SFTTrainer (padding-free and padded) vs a dense ideal.

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
* ``dense-ideal``  what the hardware does with the same model, optimizer and tokens per step when nothing
  is ragged: the same token stream cut into rows of one length with no padding, plain transformers
  ``model(input_ids, labels=...)`` (full logits, ``sdpa`` causal attention), a bare PyTorch loop (AdamW,
  the same schedule and clipping, nothing else). The row length is the data's token-weighted mean sequence
  length ``sum L_i^2 / sum L_i``, so its attention does the same FLOPs per token as the packed run's.

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
import statistics
import sys
import tempfile
from typing import Any

try:  # run as a script (benchmarks/ on sys.path) or as a module from the repo root
    import common
except ModuleNotFoundError:
    from benchmarks import common

CONTENDERS = ("padless-packed", "padless-padded", "trl-padding-free", "trl-padded", "dense-ideal")
IGNORE_INDEX = -100
OPTIM = common.optimizer_settings(learning_rate=1e-4)  # padless's SFT default

# An example as the subprocesses receive it: (input_ids, loss_mask).
Tokenized = tuple[list[int], list[bool]]


# --------------------------------------------------------------------------------------------------------
# Parent: data, plan, orchestration


def parse_args(
    argv: list[str] | None = None,
    contenders: tuple[str, ...] = CONTENDERS,
    model: str = "tiny-qwen2",
    description: str = __doc__.split("\n\n")[0],
) -> argparse.Namespace:
    """This benchmark's options; another SFT benchmark on the same data and plan (``hybrid_packing``)
    passes its own contenders, default model and description."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--data", default="tiny:sft", help="SFT data (jsonl/json/parquet, datasets dir, tiny:<name>)"
    )
    p.add_argument("--max-length", type=int, default=2048, help="longer rows are an error (as in padless)")
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
    p.add_argument("--report", default=None, help="print the table of a saved --json file and exit")
    quick = "smoke run: 1 warm-up + 2 timed steps of 1024 tokens (< 2 min)"
    args = common.parse_benchmark_args(p, argv, contenders, cpu_steps=30, quick_help=quick, model=model)
    if args.max_tokens_per_batch is None:
        args.max_tokens_per_batch = 1024 if args.quick else 4096
    return args


def tokenize(args: argparse.Namespace) -> list[Tokenized]:
    """Examples as (input_ids, loss_mask), tokenized once in the parent so every contender sees the same."""
    from padless.data import load_rows, tokenize_sft
    from padless.proof.load import load_tokenizer

    examples, _ = tokenize_sft(load_rows(args.data), load_tokenizer(args.model), max_length=args.max_length)
    return [(e.input_ids, list(e.loss_mask)) for e in examples]


def plan(args: argparse.Namespace, examples: list[Tokenized]) -> dict[str, Any]:
    """Everything a contender needs: settings, data, and the batch size that matches packed tokens/step."""
    from padless.forward.packing import budget_batches

    lengths = [len(ids) for ids, _ in examples]
    if args.quick:  # the small smoke-run budget must still hold the longest example
        args.max_tokens_per_batch = max(args.max_tokens_per_batch, max(lengths))
    bins = budget_batches(lengths, args.max_tokens_per_batch, seed=args.seed)
    packed_tokens_per_step = sum(lengths) / len(bins)
    mean_len = sum(lengths) / len(lengths)
    batch_size = args.batch_size or max(1, round(packed_tokens_per_step / mean_len))
    # dense ideal: the attention FLOPs per token of the packed run, sum L^2 / sum L, in equal rows
    dense_len = round(sum(n * n for n in lengths) / sum(lengths))
    return {
        **common.base_spec(args, OPTIM),
        "max_tokens_per_batch": args.max_tokens_per_batch,
        "batch_size": batch_size,
        "dense_rows": max(1, round(packed_tokens_per_step / dense_len)),
        "dense_len": dense_len,
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


def prepare(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The spec and the tokenized examples every contender gets; prints how the data will be batched."""
    examples = tokenize(args)
    spec = plan(args, examples)
    d = spec["data"]
    print(
        f"{d['examples']} examples, {d['tokens']:,} tokens; packed: {d['packed_steps_per_epoch']} "
        f"steps/epoch, {d['packed_tokens_per_step']:,.0f} tokens/step; padded and TRL: "
        f"{spec['batch_size']} sequences/step; dense ideal: {spec['dense_rows']} rows of {spec['dense_len']}",
        flush=True,
    )
    return spec, {"examples": examples}


def run_contender(name: str, spec: dict[str, Any], examples: list[Tokenized]) -> dict:
    """Entry point of a contender's subprocess."""
    runner = {
        "padless-packed": lambda: run_padless(spec, examples, "tokens"),
        "padless-padded": lambda: run_padless(spec, examples, "padded"),
        "trl-padding-free": lambda: run_trl(spec, examples, padding_free=True),
        "trl-padded": lambda: run_trl(spec, examples, padding_free=False),
        "dense-ideal": lambda: run_dense(spec, examples),
    }[name]
    return common.contender_main(runner, spec, profile_name=name)


# --------------------------------------------------------------------------------------------------------
# Contender: padless (the real SFT recipe on the shared Trainer loop)


def run_padless(spec: dict[str, Any], examples: list[Tokenized], batching: str) -> dict[str, Any]:
    from padless.forward.packing import Example

    return common.run_padless_sft(spec, batching, lambda _: [Example(ids, mask) for ids, mask in examples])


# --------------------------------------------------------------------------------------------------------
# Contender: TRL SFTTrainer


def run_trl(spec: dict[str, Any], examples: list[Tokenized], padding_free: bool) -> dict[str, Any]:
    import datasets

    trl = common.import_trl()
    model, tokenizer, attn = common.trl_model(spec)
    # Pre-tokenized: labels carry padless's assistant-only mask (HF convention: unshifted, -100 = no loss).
    dataset = datasets.Dataset.from_dict(
        {
            "input_ids": [ids for ids, _ in examples],
            "labels": [
                [t if m else IGNORE_INDEX for t, m in zip(ids, mask, strict=True)] for ids, mask in examples
            ],
        }
    )
    run = common.Measurement(spec)

    def count(inputs: dict[str, Any]) -> None:
        ids = inputs["input_ids"]
        real = int(inputs["attention_mask"].sum()) if "attention_mask" in inputs else ids.numel()
        run.recorder.tokens(real, ids.numel(), int((inputs["labels"] != IGNORE_INDEX).sum()))

    with tempfile.TemporaryDirectory(prefix="trl-bench-") as out:
        args = trl.SFTConfig(
            **common.trl_args(spec, out),
            padding_free=padding_free,
            max_length=None,  # padding_free without packing refuses a max_length; data fits anyway
            assistant_only_loss=False,  # the labels column already masks everything but assistant tokens
            completion_only_loss=False,
        )
        trainer = common.counting_trainer(trl.SFTTrainer, run, count)(
            model=model, args=args, train_dataset=dataset, processing_class=tokenizer
        )
        common.train_trl(trainer, run)
    layout = "padding-free" if padding_free else "padded right"
    return run.result(model, f"{layout}, {spec['batch_size']} seqs", attn, trl_version=trl.__version__)


# --------------------------------------------------------------------------------------------------------
# Contender: the dense ideal (equal rows, no padding, full logits, a bare loop)


def run_dense(spec: dict[str, Any], examples: list[Tokenized]) -> dict[str, Any]:
    import random

    import torch
    from transformers import get_scheduler

    model, _, attn = common.trl_model({**spec, "trl_attn": "sdpa"})  # seed-0 weights, bf16 on CUDA
    device = torch.device(spec["device"])
    model.to(device).train()
    o = spec["optim"]
    steps = spec["warmup"] + spec["steps"]
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=o["learning_rate"],
        betas=(o["adam_beta1"], o["adam_beta2"]),
        eps=o["adam_epsilon"],
        weight_decay=o["weight_decay"],
    )
    scheduler = get_scheduler(o["lr_scheduler"], optimizer, num_warmup_steps=0, num_training_steps=steps)
    # The examples' tokens in a seeded order, labels -100 where padless has no loss, cut into equal rows.
    order = list(range(len(examples)))
    random.Random(spec["seed"]).shuffle(order)
    ids = torch.tensor([t for i in order for t in examples[i][0]])
    labels = torch.tensor(
        [t if m else IGNORE_INDEX for i in order for t, m in zip(*examples[i], strict=True)]
    )
    rows, length = spec["dense_rows"], spec["dense_len"]
    per_step = rows * length
    if per_step * steps > ids.numel():  # more steps than one epoch of data: go round again
        repeat = -(-per_step * steps // ids.numel())
        ids, labels = ids.repeat(repeat), labels.repeat(repeat)
    run = common.Measurement(spec)
    run.start()
    for step in range(steps):
        window = slice(step * per_step, (step + 1) * per_step)
        batch_ids = ids[window].view(rows, length).to(device)
        batch_labels = labels[window].view(rows, length).to(device)
        loss = model(input_ids=batch_ids, labels=batch_labels, use_cache=False).loss
        loss.backward()
        if o["max_grad_norm"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o["max_grad_norm"])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        run.recorder.tokens(per_step, per_step, int((batch_labels[:, 1:] != IGNORE_INDEX).sum()))
        run.step_end(loss.item())
    return run.result(model, f"dense, {rows} rows x {length}", attn)


# --------------------------------------------------------------------------------------------------------
# Report


TARGETS = {  # (numerator, denominator, minimum ratio of real tokens/s)
    "padless packed >= 0.9x dense ideal (issue 13)": ("padless-packed", "dense-ideal", 0.9),
    "padless packed >= 1.5x padless padded (issue)": ("padless-packed", "padless-padded", 1.5),
    "padless packed >= 1.1x TRL padding-free (DESIGN)": ("padless-packed", "trl-padding-free", 1.1),
}
RATIOS = (
    ("padless packed / dense ideal", "padless-packed", "dense-ideal"),
    ("padless packed / padless padded", "padless-packed", "padless-padded"),
    ("padless packed / TRL padding-free", "padless-packed", "trl-padding-free"),
    ("padless packed / TRL padded", "padless-packed", "trl-padded"),
    ("TRL padding-free / TRL padded", "trl-padding-free", "trl-padded"),
)


def report(spec: dict[str, Any], runs: common.Runs, env: dict[str, Any]) -> dict:
    """Print the table (median run of each contender), ratios and targets; return them for the JSON."""
    return common.sft_report(spec, runs, env, "SFT throughput", RATIOS, TARGETS, padded="padded and TRL")


def main(argv: list[str] | None = None) -> int:
    return common.run_benchmark(parse_args(argv), prepare, run_contender, common.loss_progress, report)


if __name__ == "__main__":
    sys.exit(main())
