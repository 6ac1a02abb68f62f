"""Tree packing on long prompts: padless with tree rows vs padless flat vs TRL, GRPO and DPO, side by side.

The workloads where a prompt is most of the tokens: GRPO with prompts of about ``--prompt-tokens`` (1,024)
tokens and ``--num-generations`` (8) completions of exactly ``--max-new-tokens`` tokens each (64 and 256
bracket the workload: run both), and DPO whose pairs have such prompts and the short completions of
``tiny:preference``. Every prompt begins with its own stretch of the embedded corpus (no two prompts share
a prefix beyond the chat template's first tokens, so the tree shares within groups and pairs only), then
the row's own prompt (a ``tiny:rl`` question whose answer the ``arithmetic`` reward checks, or a
``tiny:preference`` prompt).

Each workload runs its throughput benchmark (``benchmarks/grpo_throughput.py``,
``benchmarks/dpo_throughput.py``: every contender in a fresh process, same model, data, optimizer and
machine) on these rows, then this script prints the ratios the issue asks for beside their targets:

* GRPO, training passes (reference log-probs and the update: the step without generation): tokens
  computed, flat / tree (>= 3x) and speed, tree / flat (>= 2.5x); the whole step's ratio (generation
  included) printed beside them.
* DPO: tokens computed per pair, flat / tree, and pairs/s, tree / flat (>= 1.5x).

    python benchmarks/tree_packing.py                        # both workloads on CPU (2 threads)
    python benchmarks/tree_packing.py --max-new-tokens 64    # the short-completion end of GRPO
    python benchmarks/tree_packing.py --quick                # smoke run: short prompts, tree vs flat
    python benchmarks/tree_packing.py --device cuda          # GPU, bf16
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

try:  # run as a script (benchmarks/ on sys.path) or as a module from the repo root
    import common
    import dpo_throughput
    import grpo_throughput
except ModuleNotFoundError:
    from benchmarks import common, dpo_throughput, grpo_throughput

TARGETS = {  # label: (workload, ratio key, minimum)
    "GRPO training passes: >= 3x fewer tokens than flat": ("grpo", "fewer_tokens", 3.0),
    "GRPO training passes: >= 2.5x faster than flat": ("grpo", "without_generation", 2.5),
    "DPO: >= 1.5x the pairs/s of flat": ("dpo", "pairs_per_s", 1.5),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="grpo,dpo", help="comma-separated subset of grpo, dpo")
    p.add_argument("--prompt-tokens", type=int, default=None, help="corpus tokens before each prompt (1,000)")
    p.add_argument("--num-generations", type=int, default=None, help="GRPO completions per prompt (8)")
    p.add_argument("--prompts-per-step", type=int, default=None, help="GRPO prompts per rollout (4)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="GRPO completion length (256)")
    p.add_argument("--pairs", type=int, default=None, help="DPO pairs (64)")
    p.add_argument("--with-trl", action=argparse.BooleanOptionalAction, default=None, help="TRL too")
    p.add_argument("--flat", action=argparse.BooleanOptionalAction, default=True, help="padless flat too")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=None, help="timed steps per contender (GRPO 3, DPO 6)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (1)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--model", default="tiny-qwen2")
    p.add_argument("--quick", action="store_true", help="smoke run: short prompts, tree vs flat, one step")
    p.add_argument("--json", default=None, help="write both workloads' results here")
    args = p.parse_args(argv)
    quick = args.quick
    defaults = {
        "prompt_tokens": 96 if quick else 1000,
        "num_generations": 4 if quick else 8,
        "prompts_per_step": 2 if quick else 4,
        "max_new_tokens": 8 if quick else 256,
        "pairs": 8 if quick else 64,
        "with_trl": not quick,
        "warmup": 0 if quick else 1,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not set(args.workloads) <= {"grpo", "dpo"} or not args.workloads:
        p.error("--workloads: a comma-separated subset of grpo, dpo")
    return args


def corpus_stretches(model: str, count: int, tokens: int) -> list[str]:
    """``count`` stretches of ``tokens`` tokens of the embedded corpus, each starting elsewhere, as text."""
    from padless.proof.load import load_tokenizer

    tokenizer = load_tokenizer(model)
    ids = tokenizer(resources.files("padless.tiny").joinpath("corpus.txt").read_text())["input_ids"]
    while len(ids) < 2 * tokens:
        ids = ids + ids
    room = len(ids) - tokens
    return [tokenizer.decode(ids[(i * 131) % room : (i * 131) % room + tokens]) for i in range(count)]


def write_rows(args: argparse.Namespace, folder: Path) -> dict[str, Path]:
    """The long-prompt rows of each workload as jsonl files in ``folder``."""
    from padless.data import load_rows

    files = {}
    for workload, source, count in (("grpo", "tiny:rl", 64), ("dpo", "tiny:preference", args.pairs)):
        rows = [r.data for r in load_rows(source)[:count]]
        stretches = corpus_stretches(args.model, len(rows), args.prompt_tokens)
        path = folder / f"{workload}.jsonl"
        with path.open("w") as f:
            for row, text in zip(rows, stretches, strict=True):
                f.write(json.dumps({**row, "prompt": f"{text}\n\n{row['prompt']}"}) + "\n")
        files[workload] = path
    return files


def common_args(args: argparse.Namespace, tree: str, steps: int, result: Path) -> list[str]:
    """The options both workloads pass their benchmark: contenders (``tree``: padless's on tree rows),
    machine, model, steps and where the results go."""
    contenders = tree + (",padless-flat" if args.flat else "") + (",trl" if args.with_trl else "")
    out = ["--contenders", contenders, "--device", args.device, "--threads", str(args.threads)]
    out += ["--model", args.model, "--steps", str(steps), "--warmup", str(args.warmup)]
    return [*out, "--repeats", str(args.repeats), "--json", str(result)]


def run_grpo(args: argparse.Namespace, data: Path, result: Path) -> int:
    argv = [
        "--data",
        str(data),
        "--max-prompt-length",
        str(args.prompt_tokens + 400),
        "--prompts-per-step",
        str(args.prompts_per_step),
        "--num-generations",
        str(args.num_generations),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--max-tokens-per-batch",
        "16384",
        *common_args(args, "padless", args.steps or (1 if args.quick else 3), result),
    ]
    return grpo_throughput.main(argv)


def run_dpo(args: argparse.Namespace, data: Path, result: Path) -> int:
    argv = [
        "--data",
        str(data),
        "--max-length",
        str(args.prompt_tokens + 1024),  # tiny:preference's longest sides are about 600 tokens
        "--batch-size",
        "4" if args.quick else "8",
        *common_args(args, "padless-packed", args.steps or (1 if args.quick else 6), result),
    ]
    return dpo_throughput.main(argv)


def summary(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The tree / flat ratios of each workload beside the targets; prints them."""
    rows = {
        "grpo": results.get("grpo", {}).get("ratios", {}).get("padless tree / padless flat"),
        "dpo": results.get("dpo", {}).get("ratios", {}).get("padless tree / padless flat"),
    }
    print("\ntree packing on long prompts: padless tree rows / padless flat packed rows")
    if rows["grpo"]:
        g = rows["grpo"]
        print(
            f"  GRPO: {common.fmt_ratio(g['fewer_tokens'])} fewer tokens computed by the training passes, "
            f"training passes {common.fmt_ratio(g['without_generation'])} as fast, whole step (generation "
            f"included) {common.fmt_ratio(g['steps_per_s'])}, peak memory {common.fmt_ratio(g['memory'])}"
        )
    if rows["dpo"]:
        d = rows["dpo"]
        print(
            f"  DPO: {common.fmt_ratio(d['fewer_tokens'])} fewer tokens computed per pair, pairs/s "
            f"{common.fmt_ratio(d['pairs_per_s'])}, peak memory {common.fmt_ratio(d['memory'])}"
        )
    met = {}
    for label, (workload, key, minimum) in TARGETS.items():
        value = (rows[workload] or {}).get(key)
        met[label] = {"ratio": value, "met": None if value is None else value >= minimum}
    common.print_targets(met, width=max(map(len, TARGETS)))
    return {"tree_over_flat": rows, "targets": met}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    status = 0
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="padless-tree-bench-") as folder:
        files = write_rows(args, Path(folder))
        for workload in args.workloads:
            out = Path(folder) / f"{workload}-results.json"
            print(f"\n=== {workload.upper()}: prompts of {args.prompt_tokens} corpus tokens + the row's ===")
            run = run_grpo if workload == "grpo" else run_dpo
            status = max(status, run(args, files[workload], out))
            if out.exists():
                results[workload] = json.loads(out.read_text())
    report = summary(results)
    if args.json:
        common.write_json(args.json, {"workloads": results, **report})
    return status


if __name__ == "__main__":
    sys.exit(main())
