"""Every trainer on the embedded hybrid (``tiny-qwen3.5``: gated delta-net + attention), packed: two
steps each, with the stateful layers seen running rows of several sequences through the per-sequence
path, and finite losses. Exactness itself is proven per token in tests/forward/test_hybrid.py and by the
load-time probe every run starts with."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from padless.cli import TRAINERS, _load
from padless.config.loading import load_config
from padless.forward import hybrid

EXAMPLES = Path(__file__).parents[2] / "examples"
COMMON = [
    "model.name=tiny-qwen3.5",
    "train.max_steps=2",
    "train.save_steps=2",
    "train.progress_bar=false",
    "train.report_to=[jsonl]",
    "train.logging_steps=1",
]
RUNS = {
    "sft": (
        "sft_hybrid_tiny.yaml",
        ["data.train=tiny:sft_eval", "train.eval_steps=2", "train.eval_max_new_tokens=4"],
    ),
    "dpo": ("dpo_tiny.yaml", ["data.train=tiny:preference_eval", "train.eval_steps=2"]),
    "rm": ("rm_tiny.yaml", ["data.train=tiny:preference_eval", "train.eval_steps=2"]),
    "grpo": (
        "grpo_tiny.yaml",
        ["rollout.prompts_per_step=2", "rollout.num_generations=2", "rollout.max_new_tokens=4"],
    ),
    "ppo": ("ppo_tiny.yaml", ["rollout.prompts_per_step=2", "rollout.max_new_tokens=4"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(RUNS))
def test_every_trainer_runs_packed_on_the_hybrid(kind, tmp_path, monkeypatch):
    most = [0]
    exact = hybrid.RUNNERS["gated_delta_net"]

    def counting(module, forward, hidden, bounds, kwargs):
        most[0] = max(most[0], len(bounds.spans))
        return exact(module, forward, hidden, bounds, kwargs)

    monkeypatch.setitem(hybrid.RUNNERS, "gated_delta_net", counting)
    example, extra = RUNS[kind]
    config_cls, run = (_load(t) for t in TRAINERS[kind][:2])
    metrics = run(
        load_config(config_cls, EXAMPLES / example, [*COMMON, f"train.output_dir={tmp_path}", *extra])
    )
    assert most[0] > 1  # rows of several sequences went through the per-sequence path
    assert math.isfinite(metrics["train/loss"])
    assert (tmp_path / "checkpoint-2" / "trainer_state.json").exists()
