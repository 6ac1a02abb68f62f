"""Data at scale: tokenized sets on disk at 10k / 100k / 1M synthetic chat rows, side by side in one run.

Rows are seeded synthetic chats (1-3 user/assistant turns of words drawn from the embedded corpus, long-tailed
lengths, median about 120 tokens), written once as jsonl; the smaller sets are the first rows of the larger
ones. Tokenizer: the embedded one (``padless/tiny``), whose chat template marks assistant turns. Settings:
``max_length`` 2048, token-budget micro-batches of 4096 tokens (the SFT defaults). Each measurement runs in a
fresh subprocess:

* ``build`` (cold cache): one :func:`padless.data.tokenized.load_set` call that reads the jsonl into Arrow,
  tokenizes it with ``--num-proc`` processes (batched ``datasets.map``) and saves the set. Tokens/s counts
  the whole call. ``cache MB``: the set on disk (the jsonl's size is shown beside it).
* ``rank``: what a training process pays for the set. A fresh process imports padless and runs the steps
  below once on the set's first 200 rows (so code and libraries are loaded), then (RSS before) loads the
  cached set, plans an epoch as SFT does (``SFTRecipe.plan``) and reads every micro-batch's
  examples into Python objects, one micro-batch at a time, as the loop does right before each forward
  (RSS after). ``RSS B/token`` is (after - before) / tokens of the set, split into anonymous memory (private
  to the process: the length and target columns, the plan) and file-backed pages (the memory-mapped Arrow
  files, shared by every process of the machine through the page cache, and reclaimable). The read time per
  token is the time to read the whole epoch.
* ``start``: ``padless sft`` on the set with a warm cache (the set built, its pages in the page cache):
  seconds from starting the process to the first training step, and to the moments the training data was
  ready and the epoch's plan built.
* ``lists`` (reference, up to ``--lists-max`` rows): the in-memory path, which the trainers took before
  (``load_rows`` + ``tokenize_sft`` in one process, Python lists kept; the raw rows dropped, as a trainer
  drops them): RSS B/token and tokens/s.

    python benchmarks/data_scale.py                          # 10k, 100k, 1M rows
    python benchmarks/data_scale.py --rows 2000 20000        # small
    python benchmarks/data_scale.py --quick                  # smoke run: 500 and 2,000 rows (lists: 500)
    python benchmarks/data_scale.py --json results.json --workdir /big/disk
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

try:  # run as a script (benchmarks/ on sys.path) or as a module from the repo root
    import common
except ModuleNotFoundError:
    from benchmarks import common

REPO = Path(__file__).resolve().parents[1]
MAX_LENGTH = 2048
MAX_TOKENS = 4096


# --------------------------------------------------------------------------------------------------------
# Data


def chat(rng: random.Random, words: list[str]) -> dict[str, Any]:
    """One synthetic conversation: 1-3 turns, log-normal word counts (user short, assistant longer)."""
    messages = []
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3))):
        user = " ".join(rng.choices(words, k=int(rng.lognormvariate(2.6, 0.6)) + 3))
        answer = " ".join(rng.choices(words, k=int(rng.lognormvariate(3.2, 0.8)) + 2))
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def write_rows(sizes: list[int], folder: Path, seed: int) -> dict[int, Path]:
    """jsonl files of the first ``n`` rows of one seeded stream, for each ``n`` in ``sizes``."""
    words = re.findall(r"[A-Za-z']+|[.,?!]", (REPO / "padless/tiny/corpus.txt").read_text())
    rng = random.Random(seed)
    paths = {n: folder / f"chats-{n}.jsonl" for n in sizes}
    files = {n: p.open("w") for n, p in paths.items()}
    for i in range(max(sizes)):
        line = json.dumps(chat(rng, words)) + "\n"
        for n, f in files.items():
            if i < n:
                f.write(line)
    for f in files.values():
        f.close()
    return paths


# --------------------------------------------------------------------------------------------------------
# Children (fresh processes)


def rss() -> dict[str, int]:
    """This process's resident memory in bytes (total, anonymous, file-backed; Linux ``/proc``), after
    collecting garbage and handing freed heap (Python's and Arrow's) back to the system, so only live memory
    counts."""
    import ctypes
    import gc

    import pyarrow as pa

    gc.collect()
    pa.default_memory_pool().release_unused()  # Arrow's allocator returns freed memory lazily otherwise
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def child_build(data: str, cache: str, num_proc: int) -> dict[str, Any]:
    from padless.data.sft import SFTLayout
    from padless.data.tokenized import load_set
    from padless.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    started = time.perf_counter()
    examples, _ = load_set(
        data, SFTLayout(max_length=MAX_LENGTH), tokenizer, cache_dir=cache, num_proc=num_proc
    )
    wall = time.perf_counter() - started
    meta = json.loads((examples.path / "padless.json").read_text())
    size = sum(f.stat().st_size for f in examples.path.iterdir() if f.is_file())
    return {
        "wall_s": wall,
        "rows": meta["rows"],
        "tokens": meta["tokens"],
        "processes": meta["processes"],
        "cache_bytes": size,
    }


def child_rank(data: str, cache: str) -> dict[str, Any]:

    import torch

    from padless.config.schema import TrainSettings
    from padless.data.sft import SFTLayout
    from padless.data.tokenized import load_set
    from padless.tiny import tiny_tokenizer
    from padless.trainers.sft import SFTRecipe

    tokenizer = tiny_tokenizer()
    settings = TrainSettings(max_tokens_per_batch=MAX_TOKENS)

    def epoch(spec: str) -> tuple[Any, list[Any], int, list[float]]:
        times = [time.perf_counter()]
        examples, _ = load_set(spec, SFTLayout(max_length=MAX_LENGTH), tokenizer, cache_dir=cache)
        times.append(time.perf_counter())
        assert examples.cached or spec != data, "the rank measurement must load a built set"
        micros = SFTRecipe(examples, settings, tokenizer, torch.device("cpu")).plan(0)
        times.append(time.perf_counter())
        tokens = sum(len(e) for micro in micros for e in micro.read().data)
        times.append(time.perf_counter())
        assert tokens == int(examples.lengths.sum())
        return examples, micros, tokens, times

    epoch(f"{data}[:200]")  # the same code once on a small set: code and libraries are in "before"
    before = rss()
    examples, micros, tokens, times = epoch(data)
    after = rss()  # with the set and the epoch's plan still held, as during training
    del examples, micros
    return {
        "tokens": tokens,
        "load_s": times[1] - times[0],
        "plan_s": times[2] - times[1],
        "read_s": times[3] - times[2],
        "before": before,
        "after": after,
    }


def child_lists(data: str) -> dict[str, Any]:

    from padless.data import load_rows, tokenize_sft
    from padless.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenize_sft(load_rows(f"{data}[:200]"), tokenizer, max_length=MAX_LENGTH)  # code and libraries warm
    before = rss()
    started = time.perf_counter()
    rows = load_rows(data)
    examples, _ = tokenize_sft(rows, tokenizer, max_length=MAX_LENGTH)
    wall = time.perf_counter() - started
    del rows
    after = rss()
    return {"tokens": sum(len(e) for e in examples), "wall_s": wall, "before": before, "after": after}


def child_start(argv: list[str], spawned: float) -> dict[str, Any]:
    """``padless sft`` until its first training step; times from the parent's spawn of this process."""
    marks: dict[str, float] = {"started": time.time()}
    from padless import cli
    from padless.run import loop
    from padless.trainers import sft

    marks["imported"] = time.time()
    original_load = sft.load_set

    def load_set(*args: Any, **kwargs: Any) -> Any:
        out = original_load(*args, **kwargs)
        assert out[0].cached, "the start-up must be measured on a warm cache"
        marks.setdefault("data_ready", time.time())
        return out

    original_count = loop.Trainer._count_steps

    def count_steps(self: Any) -> int:
        out = original_count(self)
        marks["planned"] = time.time()
        return out

    def first_step(self: Any, step: Any) -> Any:
        marks["first_step"] = time.time()
        print(json.dumps({k: v - spawned for k, v in marks.items()}), flush=True)
        os._exit(0)

    sft.load_set = load_set
    loop.Trainer._count_steps = count_steps
    loop.Trainer._train_step = first_step
    code = cli.main(["sft", *argv])
    raise SystemExit(f"padless sft ended (exit {code}) before its first step")


def run_child(mode: str, **kwargs: Any) -> dict[str, Any]:
    spawned = time.time()
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        mode,
        json.dumps(kwargs | {"spawned": spawned}),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PADLESS_LOG_LEVEL": "warning"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} child failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def child_main(mode: str, raw: str) -> None:
    kwargs = json.loads(raw)
    spawned = kwargs.pop("spawned")
    if mode == "start":
        child_start(kwargs["argv"], spawned)
    fn = {"build": child_build, "rank": child_rank, "lists": child_lists}[mode]
    print(json.dumps(fn(**kwargs)), flush=True)


# --------------------------------------------------------------------------------------------------------
# The benchmark


def measure(n: int, data: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    cache = work / f"cache-{n}"
    out: dict[str, Any] = {"rows": n, "jsonl_bytes": data.stat().st_size}
    print(f"[{n:,} rows] build (cold cache, {args.num_proc} processes) ...", flush=True)
    out["build"] = run_child("build", data=str(data), cache=str(cache), num_proc=args.num_proc)
    print(f"[{n:,} rows] rank: load, plan, read every micro-batch ...", flush=True)
    out["rank"] = run_child("rank", data=str(data), cache=str(cache))
    print(f"[{n:,} rows] start-up of padless sft (warm cache) ...", flush=True)
    argv = [
        "model.name=tiny-qwen2",
        f"data.train={data}",
        f"data.cache_dir={cache}",
        f"data.max_length={MAX_LENGTH}",
        f"train.max_tokens_per_batch={MAX_TOKENS}",
        f"train.output_dir={work / f'run-{n}'}",
        "train.max_steps=1",
        "train.progress_bar=false",
        "train.report_to=[jsonl]",
    ]
    out["start"] = run_child("start", argv=argv)
    if n <= args.lists_max:
        print(f"[{n:,} rows] reference: in-memory lists ...", flush=True)
        out["lists"] = run_child("lists", data=str(data))
    if not args.keep:
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(work / f"run-{n}", ignore_errors=True)
    return out


def per_token(r: dict[str, Any], part: str = "VmRSS") -> float:
    """Resident bytes the measured step added, per token of the set."""
    return (r["after"][part] - r["before"][part]) / r["tokens"]


def report(results: list[dict[str, Any]], env: dict[str, Any], args: argparse.Namespace) -> str:
    rows = []
    for r in results:
        b, k, s = r["build"], r["rank"], r["start"]
        rows.append(
            [
                f"{r['rows']:,}",
                f"{b['tokens']:,}",
                common.fmt_number(b["tokens"] / b["wall_s"]),
                f"{b['wall_s']:.1f}",
                f"{b['cache_bytes'] / 1e6:.0f} ({r['jsonl_bytes'] / 1e6:.0f})",
                f"{per_token(k, 'VmRSS'):.2f}",
                f"{per_token(k, 'RssAnon'):.2f}",
                f"{per_token(k, 'RssFile'):.2f}",
                f"{k['read_s'] / k['tokens'] * 1e9:.0f}",
                f"{k['load_s']:.2f} / {k['plan_s']:.2f}",
                f"{s['data_ready']:.1f} / {s['planned']:.1f} / {s['first_step']:.1f}",
            ]
        )
    table = common.markdown_table(
        [
            "rows",
            "tokens",
            "build tok/s",
            "build s",
            "cache MB (jsonl)",
            "RSS B/token",
            "anon",
            "file",
            "read ns/token",
            "load / plan s",
            "start: data / plan / step s",
        ],
        rows,
    )
    lists = [r for r in results if "lists" in r]
    lines = [table]
    if lists:
        ref = common.markdown_table(
            ["rows", "lists RSS B/token", "lists tok/s (1 process)", "Arrow RSS B/token", "ratio"],
            [
                [
                    f"{r['rows']:,}",
                    f"{per_token(r['lists'], 'VmRSS'):.1f}",
                    common.fmt_number(r["lists"]["tokens"] / r["lists"]["wall_s"]),
                    f"{per_token(r['rank'], 'VmRSS'):.2f}",
                    common.fmt_ratio(per_token(r["rank"], "VmRSS") / per_token(r["lists"], "VmRSS")),
                ]
                for r in lists
            ],
        )
        lines += ["", ref]
    if len(results) > 1:
        first, last = results[0], results[-1]

        def flat(fn: Any) -> str:
            return common.fmt_ratio(fn(last) / fn(first))

        lines += [
            "",
            f"{last['rows']:,} vs {first['rows']:,} rows, per token: build time "
            + flat(lambda r: r["build"]["wall_s"] / r["build"]["tokens"])
            + ", RSS "
            + flat(lambda r: per_token(r["rank"], "VmRSS"))
            + ", read time "
            + flat(lambda r: r["rank"]["read_s"] / r["rank"]["tokens"]),
        ]
    load = env.get("loadavg_start")
    lines += [
        "",
        f"{env['cpu']}, {env['cpu_count']} cores, python {env['python']}, "
        + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
        + f"; --num-proc {args.num_proc}; load average at start {load}, at end "
        + str([round(x, 2) for x in os.getloadavg()]),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--num-proc", type=int, default=2, help="tokenizing processes on a cache miss")
    parser.add_argument("--lists-max", type=int, default=100_000, help="largest size for the lists reference")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="where data and caches go (default: a temporary folder, removed)")
    parser.add_argument("--keep", action="store_true", help="keep the data and caches")
    parser.add_argument("--json", help="write every measurement here")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 500 and 2,000 rows, the lists reference at 500 only"
    )
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:  # every measurement runs on both sizes; the reference, one child more, on the first
        args.rows, args.lists_max = [500, 2_000], 500
    if args.child:
        child_main(*args.child)
        return
    env = common.environment(("padless", "torch", "transformers", "datasets", "tokenizers"))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="padless-data-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        sizes = sorted(args.rows)
        print(f"writing {', '.join(f'{n:,}' for n in sizes)} synthetic chat rows to {work} ...", flush=True)
        files = write_rows(sizes, work, args.seed)
        results = [measure(n, files[n], work, args) for n in sizes]
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    text = report(results, env, args)
    print("\n" + text)
    if args.json:
        common.write_json(args.json, {"environment": env, "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
