"""vLLM as a server (``padless vllm-serve``, ``rollout.vllm_mode: server``): a server process and this
process as the trainer. After every weight push the sampled log-probs equal the trainer's own; the same
seeds give the same samples as the colocated engine; a GRPO run trains through it with the sampler-trainer
mismatch within the bound at every step; a server that is not there, or stops, is an error naming its URL.
With vLLM's CPU build under ``make test`` (PADLESS_TEST_VLLM=1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from padless.config.loading import load_config
from padless.config.schema import GRPOConfig
from padless.errors import InputError
from padless.forward.engine import forward_packed
from padless.forward.packing import Example, pack
from padless.proof.load import load_model

ROOT = Path(__file__).parents[2]
# vLLM's CPU GEMMs and torch's differ in summation order only (measured up to ~1e-5 in fp32; the colocated
# engine's test holds the same bound)
BOUND = 1e-4


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rollout_config(url: str, *extra: str):
    overrides = ["rollout.engine=vllm", "rollout.vllm_mode=server", f"rollout.vllm_server_url={url}"]
    return load_config(GRPOConfig, None, [*overrides, "rollout.max_new_tokens=16", *extra])


def test_a_server_that_is_not_there_is_named_with_the_fix(tokenizer):
    from padless.rl.vllm_server import VLLMServerEngine

    url = f"http://127.0.0.1:{free_port()}"
    cfg = rollout_config(url)
    with pytest.raises(
        InputError, match=rf"vLLM server at {url} .*did not answer /health.*padless vllm-serve"
    ):
        VLLMServerEngine(load_model("tiny-qwen2"), tokenizer, cfg.rollout, 256)


@pytest.fixture(scope="module")
def server():
    """``padless vllm-serve`` for tiny-qwen2 in a process of its own; its URL."""
    from tests.rl.test_vllm_engine import need_vllm

    need_vllm()
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"}
    command = [
        sys.executable,
        "-m",
        "padless.cli",
        "vllm-serve",
        "--model",
        "tiny-qwen2",
        "--port",
        str(port),
    ]
    process = subprocess.Popen(
        [*command, "--max-model-len", "1024"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(
                f"padless vllm-serve exited with {process.returncode}:\n{process.stdout.read()[-3000:]}"
            )
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as answer:
                json.loads(answer.read())
                break
        except OSError:
            time.sleep(1)
    else:
        process.kill()
        pytest.fail("padless vllm-serve did not answer within 600 s")
    yield url, process
    process.kill()
    process.wait()


def variety(prompts: list[str], completions: list[str], **fields) -> list[float]:
    """A reward that tells a random model's completions apart (so advantages and the loss are not 0)."""
    return [float(len(set(c))) for c in completions]


def perturb(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def test_sampled_logprobs_equal_the_trainers_after_every_push_and_seeds_reproduce(server, tokenizer):
    """Two pushes of different weights: after each, every sampled token's log-prob is the trainer's own
    (at the rollout's temperature, within BOUND); the same seeds give the same samples in any batch; and a
    planted stale push (weights not sent) is caught by the same comparison."""
    from padless.rl.vllm_server import VLLMServerEngine

    url, _ = server
    cfg = rollout_config(url, "rollout.temperature=0.7")
    policy = load_model("tiny-qwen2")
    engine = VLLMServerEngine(policy, tokenizer, cfg.rollout, 256)
    prompts = [tokenizer(t)["input_ids"] for t in ("What is 2 + 3?", "Name a colour.", "Count: 1, 2,")]

    def worst(seeds: list[int]) -> float:
        completions = engine.complete(prompts, 2, seeds)
        delta = 0.0
        with torch.no_grad():
            for c in completions:
                assert c.logprobs is not None and len(c.logprobs) == len(c.completion_ids) > 0
                n = len(c.prompt_ids)
                batch = pack(
                    [Example(c.prompt_ids + c.completion_ids, [False] * n + [True] * len(c.completion_ids))]
                )
                mine = forward_packed(policy, batch, temperature=0.7).logps[batch.loss_mask[0]]
                delta = max(delta, (mine - torch.tensor(c.logprobs)).abs().max().item())
        return delta

    for push in range(2):
        perturb(policy, push)
        engine.sync_weights()
        assert worst([1, 2, 3]) < BOUND, push
    first = engine.complete(prompts, 2, [7, 8, 9])
    alone = engine.complete(prompts[1:2], 2, [8])
    assert [c.completion_ids for c in first[2:4]] == [c.completion_ids for c in alone]
    assert [c.completion_ids for c in engine.complete(prompts, 2, [7, 8, 9])] == [
        c.completion_ids for c in first
    ]
    perturb(policy, 5)  # not pushed: the server samples the old weights, and the comparison sees it
    assert worst([1, 2, 3]) > 1e-2


@pytest.mark.slow
def test_grpo_trains_through_the_server_with_the_sampler_equal_to_the_trainer(server, tmp_path):
    """`padless grpo` with rollout.vllm_mode server: weights pushed before each rollout, and the run's own
    sampler-trainer comparison (mismatch/logp_diff_max: every sampled token's log-prob against the
    trainer's forward) within BOUND at every step, while the weights change."""
    from padless.cli import main

    url, _ = server
    run = tmp_path / "run"
    code = main(
        [
            "grpo",
            "rollout.engine=vllm",
            "rollout.vllm_mode=server",
            f"rollout.vllm_server_url={url}",
            "model.name=tiny-qwen2",
            "train.max_steps=3",
            "data.train=tiny:rl[:16]",
            "train.learning_rate=1e-2",
            "rollout.prompts_per_step=2",
            "rollout.num_generations=2",
            "rollout.max_new_tokens=6",
            "rollout.mask_truncated=false",
            f"reward.functions=[{Path(__file__).resolve()}:variety]",
            f"train.output_dir={run}",
            "train.logging_steps=1",
            "train.progress_bar=false",
            "train.report_to=[jsonl]",
        ]
    )
    assert code == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    mismatch = [r["mismatch/logp_diff_max"] for r in records if "mismatch/logp_diff_max" in r]
    assert len(mismatch) == 3 and max(mismatch) < BOUND, mismatch
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == 3 and any(loss != 0 for loss in losses)


def test_a_server_that_stops_mid_run_is_named(server, tokenizer):
    """Last in this module: the server is stopped, and the next push says which server stopped."""
    from padless.rl.vllm_server import VLLMServerEngine

    url, process = server
    engine = VLLMServerEngine(load_model("tiny-qwen2"), tokenizer, rollout_config(url).rollout, 256)
    process.kill()
    process.wait()
    with pytest.raises(RuntimeError, match=rf"vLLM server at {url} .*did not answer /weights.*then resume"):
        engine.sync_weights()
