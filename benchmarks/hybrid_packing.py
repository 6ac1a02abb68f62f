"""Hybrid SFT: padless packed vs padless padded on the embedded gated delta-net hybrid (``tiny-qwen3.5``).

In a packed row the hybrid's delta-net layers run per sequence (``padless.hybrid``: sequences regrouped
into right-padded rows of similar length, every sequence starting at zero state); padded, they run on
the batch's rows as transformers wrote them. This measures what that exactness costs: real (non-pad)
tokens per second and peak RSS of both, same model, data, optimizer and machine, one run, each contender
in a fresh subprocess with the same thread count. The contenders are those of
``benchmarks/sft_throughput.py`` (its data, plan and training code are reused as they are):

* ``padless-packed``  ``SFTRecipe`` on the shared ``Trainer`` loop, token-budget micro-batches, one
  packed row per step, ``varlen`` attention, delta-nets per sequence.
* ``padless-padded``  the same loop with ``batching: padded`` (right padding), the batch size chosen so
  that real tokens per step match the packed run's on average.

    python benchmarks/hybrid_packing.py                 # full run on CPU (2 threads)
    python benchmarks/hybrid_packing.py --quick         # smoke run
    python benchmarks/hybrid_packing.py --json results.json --repeats 2
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

try:  # run as a script (benchmarks/ on sys.path) or as a module from the repo root
    import common
    import sft_throughput as sft
except ModuleNotFoundError:
    from benchmarks import common
    from benchmarks import sft_throughput as sft

CONTENDERS = ("padless-packed", "padless-padded")
TARGETS = {
    "packing no slower than padding on the hybrid (issue 18)": ("padless-packed", "padless-padded", 1.0)
}
RATIOS = (("padless packed / padless padded", "padless-packed", "padless-padded"),)


def parse_args(argv: list[str] | None = None):
    """``sft_throughput``'s options (``common.parse_benchmark_args``), on the hybrid by default."""
    args = sft.parse_args(argv)
    if args.model == "tiny-qwen2":  # the shared default is not a hybrid
        args.model = "tiny-qwen3.5"
    unknown = [c for c in args.contenders if c not in CONTENDERS]
    if args.contenders == list(sft.CONTENDERS):
        args.contenders = list(CONTENDERS)
    elif unknown:
        raise SystemExit(f"unknown contender(s) {', '.join(unknown)}; choose from {', '.join(CONTENDERS)}")
    return args


def report(spec: dict[str, Any], runs: common.Runs, env: dict[str, Any]) -> dict:
    """Print the table (median run of each contender), the ratio and the target; return them for the JSON."""
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
        f"Hybrid SFT ({spec['model']}) on {common.machine_line(spec, env)}, data {d['spec']} "
        f"({d['examples']} examples, {d['tokens']:,} tokens, median {d['median_len']:.0f} / max "
        f"{d['max_len']})"
    )
    git, versions = env.get("git", {}), env.get("versions", {})
    dirty = " (uncommitted library edits)" if git.get("library_dirty") else ""
    print(
        f"padless {versions.get('padless')} at {git.get('commit')}{dirty}, torch {versions.get('torch')}, "
        f"transformers {versions.get('transformers')}; {env.get('date')}"
    )
    print(results.runs_line(spec))
    print(
        f"packed: budget {spec['max_tokens_per_batch']} tokens/step; "
        f"padded: {spec['batch_size']} sequences/step"
    )
    print()
    print(table)
    print()
    mem_label = "peak CUDA memory" if results.cuda else "peak RSS rise"
    columns = [("real tok/s", "real_tokens_per_s", 10), ("median step", "median_step", 12)]
    common.print_ratios(ratios, [*columns, (mem_label, "memory", 16)])
    print()
    common.print_targets(targets, width=56)
    results.print_failures()
    return {"ratios": ratios, "targets": targets, "table": table}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        report(saved["spec"], saved["runs"], saved["environment"])
        return 0
    return common.run_benchmark(args, sft.prepare, sft.run_contender, sft.progress, report)


if __name__ == "__main__":
    sys.exit(main())
