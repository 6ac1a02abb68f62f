"""DPO throughput: padless packed vs padless padded vs TRL DPOTrainer (default, and padding_free=True).

Same model (the embedded ``tiny-qwen2`` by default, fp32 on CPU), same preference data (``tiny:preference``),
same machine, one run. Every contender trains the policy with the sigmoid DPO loss (beta 0.1) against a
frozen copy of the initial model as reference (no precomputed reference log-probs), one micro-batch per
optimizer step, the same optimizer and schedule, and runs in a fresh subprocess with the same thread count:

* ``padless-packed``  the real padless path: ``DPORecipe`` on the shared ``Trainer`` loop; token-budget
  micro-batches of whole pairs, one packed row ``[c1, r1, c2, r2, ...]`` per policy forward and per
  reference forward, ``varlen`` attention, laid out as a tree: each pair's prompt computed once and
  counted once in the budget (``train.tree_packing: auto``).
* ``padless-flat``  the same with ``train.tree_packing: off``: both sides pack their prompt.
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
is evaluated, saved or logged to disk. "computed/pair" counts what the policy and reference forwards ran
the model on per pair (padding included). ``benchmarks/tree_packing.py`` runs it on prompts of 1,024 tokens.

    python benchmarks/dpo_throughput.py                 # full run on CPU (2 threads)
    python benchmarks/dpo_throughput.py --quick         # smoke run, well under 2 minutes
    python benchmarks/dpo_throughput.py --device cuda   # GPU, bf16
    python benchmarks/dpo_throughput.py --json results.json --repeats 2
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

try:  # run as a script (benchmarks/ on sys.path) or as a module from the repo root
    import common
except ModuleNotFoundError:
    from benchmarks import common

CONTENDERS = ("padless-packed", "padless-flat", "padless-padded", "trl", "trl-padding-free")

# Shared by every contender: padless's DPO defaults (TRL's would be lr 1e-6 and a linear schedule).
OPTIM = common.optimizer_settings(learning_rate=5e-6)
BETA = 0.1

# A pair as the padless subprocess receives it: (chosen ids, chosen mask, rejected ids, rejected mask).
Pair = tuple[list[int], list[bool], list[int], list[bool]]


# --------------------------------------------------------------------------------------------------------
# Step recording with pair counts


@dataclass
class PairRecorder(common.StepRecorder):
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
                "computed_tokens_per_pair": sum(self.computed[self.warmup :]) / max(1, sum(timed)),
                "first_loss": self.records[0].loss,
            }
        )
        return out


# --------------------------------------------------------------------------------------------------------
# Parent: data, plan, orchestration


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    quick = "smoke run (< 2 min): pairs of <= 256 tokens, 4 per step, 1 warm-up + 2 timed steps"
    args = common.parse_benchmark_args(p, argv, CONTENDERS, cpu_steps=35, quick_help=quick)
    if args.batch_size is None:
        args.batch_size = 4 if args.quick else 8
    if args.batch_size < 1:
        p.error("--batch-size must be >= 1")
    if args.max_pair_tokens is None and args.quick:
        args.max_pair_tokens = 256
    return args


def load_data(args: argparse.Namespace) -> tuple[list[Pair], list[dict[str, Any]]]:
    """padless's tokenized pairs and the raw rows (for TRL), read once in the parent."""
    from padless.data import load_rows, tokenize_preference
    from padless.proof.load import load_tokenizer

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
    from padless.forward.packing import budget_batches

    target_bins = len(lengths) / pairs_per_step
    budget = max(lengths)
    while len(budget_batches(lengths, budget, seed=seed)) > target_bins and budget < sum(lengths):
        budget += 16
    return budget


def plan(args: argparse.Namespace, pairs: list[Pair]) -> dict[str, Any]:
    """Everything a contender needs: settings, data facts, and the budget matching TRL's pairs per step."""
    from padless.forward.packing import budget_batches

    lengths = [len(c) + len(r) for c, _, r, _ in pairs]
    sides = [n for c, _, r, _ in pairs for n in (len(c), len(r))]
    budget = args.max_tokens_per_batch or matching_budget(lengths, args.batch_size, args.seed)
    if budget < max(lengths):
        raise SystemExit(f"--max-tokens-per-batch {budget} is below the longest pair ({max(lengths)} tokens)")
    bins = budget_batches(lengths, budget, seed=args.seed)
    # The padding a right-padded batch of `batch_size` random pairs carries (what TRL's collator does).
    expected_pad = padded_share(sides, args.batch_size, args.seed)
    return {
        **common.base_spec(args, OPTIM),
        "max_tokens_per_batch": budget,
        "batch_size": args.batch_size,
        "beta": BETA,
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


def prepare(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The spec, the tokenized pairs (padless) and the raw rows (TRL); prints how the data will be batched."""
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
    return spec, {"pairs": pairs, "rows": rows}


def run_contender(name: str, spec: dict[str, Any], pairs: list[Pair], rows: list[dict[str, Any]]) -> dict:
    """Entry point of a contender's subprocess."""
    runner = {
        "padless-packed": lambda: run_padless(spec, pairs, "tokens"),
        "padless-flat": lambda: run_padless(spec, pairs, "tokens", tree="off"),
        "padless-padded": lambda: run_padless(spec, pairs, "padded"),
        "trl": lambda: run_trl(spec, rows, padding_free=False),
        "trl-padding-free": lambda: run_trl(spec, rows, padding_free=True),
    }[name]
    return common.contender_main(runner, spec, profile_name=f"dpo-{name}")


# --------------------------------------------------------------------------------------------------------
# Contender: padless (DPORecipe on the shared Trainer loop)


def run_padless(spec: dict[str, Any], pairs: list[Pair], batching: str, tree: str = "auto") -> dict[str, Any]:
    import padless.run.loop as loop
    from padless.config.schema import DPOConfig, DPOSettings, PreferenceDataSettings
    from padless.data import PairExample
    from padless.forward.packing import Example
    from padless.proof.load import load_model
    from padless.trainers.dpo import DPORecipe

    recorder = PairRecorder(spec["warmup"], cuda=spec["device"] == "cuda")
    run = common.Measurement(spec, recorder)
    with tempfile.TemporaryDirectory(prefix="padless-dpo-bench-") as out:
        model, train = common.padless_settings(spec, out, batching)
        train = train.model_copy(update={"tree_packing": tree})
        cfg = DPOConfig(
            model=model,
            data=PreferenceDataSettings(train=spec["data"]["spec"], max_length=spec["max_length"]),
            train=train,
            dpo=DPOSettings(beta=spec["beta"], loss_type="sigmoid", reference="model"),
        )
        session = common.start_padless(cfg, out, spec["device"])
        device = session.accelerator.device
        # As run_dpo does: a frozen reference built like the policy (same weights, kernel and dtype).
        ref_model = load_model(
            spec["model"],
            attn_implementation="varlen",
            dtype=next(session.model.parameters()).dtype,
            device=device,
            seed=0,
        )
        ref_model = session.frozen(ref_model)
        tokenizer = session.tokenizer
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        data = [PairExample(Example(c, cm), Example(r, rm)) for c, cm, r, rm in pairs]
        recipe = DPORecipe(data, cfg.train, cfg.dpo, pad_id, device, ref_model)

        trainer = loop.Trainer(recipe, session.engine(), tokenizer, cfg.train, session.accelerator)
        common.count_passes(recorder)

        def count(micro: loop.MicroBatch) -> None:
            sides = [len(s) for p in micro.data for s in (p.chosen, p.rejected)]
            processed = len(sides) * max(sides) if batching == "padded" else sum(sides)
            targets = sum(s.num_targets for p in micro.data for s in (p.chosen, p.rejected))
            recorder.tokens(sum(sides), processed, targets)
            recorder.pairs(len(micro.data))

        common.train_padless(trainer, run, count)
    if batching == "tokens":
        layout = common.padless_layout(trainer, f"packed, budget {spec['max_tokens_per_batch']} tok")
    else:
        layout = f"padded right, {spec['batch_size']} pairs"
    attention = common.padless_attention(run.cuda)
    return run.result(session.model, layout, attention, reference="frozen copy, forward every step")


# --------------------------------------------------------------------------------------------------------
# Contender: TRL DPOTrainer


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

    trl = common.import_trl()
    # The reference is a frozen copy of the policy's initial weights.
    model, tokenizer, attn = common.trl_model(spec)
    ref_model = copy.deepcopy(model).requires_grad_(False).eval()
    dataset = datasets.Dataset.from_list(rows)

    recorder = PairRecorder(spec["warmup"], cuda=spec["device"] == "cuda")
    run = common.Measurement(spec, recorder)
    layouts: set[str] = set()

    def count(inputs: dict[str, Any]) -> None:
        ids = inputs["input_ids"]
        mask = inputs.get("attention_mask")
        real = int(mask.sum()) if mask is not None else ids.numel()
        # Packed (padding-free) input would be one row with position_ids; TRL's padded batch is [2B, L].
        packed = ids.shape[0] == 1 and "position_ids" in inputs
        layouts.add("packed" if packed else f"padded [{2 * spec['batch_size']}, L]")
        recorder.tokens(real, ids.numel(), int(inputs["completion_mask"][:, 1:].sum()))
        recorder.passes(2 * ids.numel())  # the policy's forward and the reference's, on this batch
        recorder.pairs(ids.shape[0] // 2 if not packed else int(inputs["position_ids"].eq(0).sum()) // 2)

    dpo_fields = trl.DPOConfig.__dataclass_fields__
    extra = {"padding_free": padding_free} if "padding_free" in dpo_fields else {}
    if padding_free and not extra:
        raise RuntimeError(f"TRL {trl.__version__} DPOConfig has no padding_free option")
    with tempfile.TemporaryDirectory(prefix="trl-dpo-bench-") as out, _Captured() as captured:
        args = trl.DPOConfig(
            **common.trl_args(spec, out),
            beta=spec["beta"],
            loss_type=["sigmoid"],
            max_length=spec["max_length"],
            precompute_ref_log_probs=False,
            **extra,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = common.counting_trainer(trl.DPOTrainer, run, count)(
                model=model,
                ref_model=ref_model,
                args=args,
                train_dataset=dataset,
                processing_class=tokenizer,
            )
        common.train_trl(trainer, run)
    notes = [m for m in captured.messages + [str(w.message) for w in caught] if "padding_free" in m]
    honoured = getattr(trainer, "padding_free", padding_free)
    if padding_free:
        fell_back = not honoured or "packed" not in layouts
        verdict = "fell back to padding" if fell_back else "padding-free"
    else:
        verdict = "padded (default)"
    return run.result(
        model,
        f"{'packed' if 'packed' in layouts else 'padded right'}, {spec['batch_size']} pairs",
        attn,
        reference="frozen copy (ref_model), forward every step",
        trl_version=trl.__version__,
        padding_free_requested=padding_free,
        padding_free_verdict=verdict,
        layouts_seen=sorted(layouts),
        trl_messages=notes,
    )


# --------------------------------------------------------------------------------------------------------
# Report


TARGETS = {  # (numerator, denominator, minimum ratio of real tokens/s)
    "padless packed >= 1.7x TRL DPO (DESIGN)": ("padless-packed", "trl", 1.7),
}
RATIOS = (
    ("padless tree / padless flat", "padless-packed", "padless-flat"),
    ("padless packed / TRL", "padless-packed", "trl"),
    ("padless packed / TRL padding_free", "padless-packed", "trl-padding-free"),
    ("padless packed / padless padded", "padless-packed", "padless-padded"),
    ("padless padded / TRL", "padless-padded", "trl"),
    ("TRL padding_free / TRL", "trl-padding-free", "trl"),
)


def report(spec: dict[str, Any], runs: common.Runs, env: dict[str, Any]) -> dict:
    """Print the table (median run of each contender), ratios, targets and TRL's padding_free verdict."""
    results = common.Results(spec, runs)
    cuda, chosen = results.cuda, results.chosen
    table = results.table(
        before=[
            ("pairs/step", lambda r: common.fmt_number(r["pairs_per_step"], 1)),
            ("tok/pair", lambda r: common.fmt_number(r["real_tokens_per_pair"])),
            ("pairs/s", lambda r: common.fmt_number(r["pairs_per_s"], 2)),
            ("computed/pair", lambda r: common.fmt_number(r["computed_tokens_per_pair"])),
        ],
        after=[
            ("loss first", lambda r: f"{r['first_loss']:.4f}"),
            ("loss last 5", lambda r: f"{r['final_loss_mean5']:.4f}"),
        ],
    )
    ratios = {
        label: {
            "fewer_tokens": results.ratio(b, a, "computed_tokens_per_pair"),
            "pairs_per_s": results.ratio(a, b, "pairs_per_s"),
            **results.throughput_ratios(a, b, "cuda_peak_mib" if cuda else "peak_rss_mib"),
            "memory_rise": None if cuda else results.ratio(a, b, "peak_rss_delta_mib"),
        }
        for label, a, b in RATIOS
        if a in chosen and b in chosen
    }
    targets = results.targets(TARGETS)

    d = spec["data"]
    subset = f" (pairs of <= {d['max_pair_tokens']} tokens)" if d["max_pair_tokens"] else ""
    print()
    print(
        f"DPO throughput on {common.machine_line(spec, env)}, data {d['spec']}{subset} ({d['pairs']} pairs, "
        f"{d['tokens']:,} tokens, per side median {d['median_side_len']:.0f} / max {d['max_side_len']} "
        f"tokens), sigmoid loss, beta {spec['beta']}, frozen reference model"
    )
    print(results.runs_line(spec))
    print(
        f"TRL and padless padded: {spec['batch_size']} pairs/step; padless packed: budget "
        f"{spec['max_tokens_per_batch']} tokens/step = {d['packed_pairs_per_step']:.2f} pairs, "
        f"{d['packed_tokens_per_step']:,.0f} tokens per step on average over an epoch"
    )
    print()
    print(table)
    print()
    columns = [
        ("fewer computed", "fewer_tokens", 14),
        ("pairs/s", "pairs_per_s", 8),
        ("real tok/s", "real_tokens_per_s", 10),
        ("median step", "median_step", 12),
        ("peak CUDA" if cuda else "peak RSS", "memory", 9),
    ]
    common.print_ratios(ratios, columns if cuda else [*columns, ("RSS rise", "memory_rise", 9)])
    print()
    common.print_targets(targets, width=44)
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
    results.print_failures()
    return {"ratios": ratios, "targets": targets, "table": table, "trl_padding_free": padding_free}


def progress(r: dict[str, Any]) -> str:
    return (
        f"{r['pairs_per_s']:.2f} pairs/s, {common.throughput_line(r)}, "
        f"loss {r['first_loss']:.4f} -> {r['final_loss']:.4f}"
    )


def main(argv: list[str] | None = None) -> int:
    return common.run_benchmark(parse_args(argv), prepare, run_contender, progress, report)


if __name__ == "__main__":
    sys.exit(main())
