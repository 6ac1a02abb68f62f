"""Hybrid SFT: padless packed vs padless padded on the embedded gated delta-net hybrid (``tiny-qwen3.5``).

In a packed row the hybrid's delta-net layers run per sequence (``padless.forward.hybrid``: sequences
regrouped into right-padded rows of similar length, every sequence starting at zero state); padded, they run
on the batch's rows as transformers wrote them. This measures what that exactness costs: real (non-pad)
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

import sys
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
    """``sft_throughput``'s options (``common.parse_benchmark_args``) with this benchmark's contenders, on
    the hybrid by default."""
    return sft.parse_args(argv, CONTENDERS, model="tiny-qwen3.5", description=__doc__.split("\n\n")[0])


def report(spec: dict[str, Any], runs: common.Runs, env: dict[str, Any]) -> dict:
    """Print the table (median run of each contender), the ratio and the target; return them for the JSON."""
    return common.sft_report(spec, runs, env, "Hybrid SFT", RATIOS, TARGETS)


def main(argv: list[str] | None = None) -> int:
    return common.run_benchmark(
        parse_args(argv), sft.prepare, sft.run_contender, common.loss_progress, report
    )


if __name__ == "__main__":
    sys.exit(main())
