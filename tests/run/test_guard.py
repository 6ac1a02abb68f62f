"""The divergence guard: a non-finite loss stops the run naming step and micro-batch, or (by setting) the
step is skipped and counted; weights are never saved non-finite; metrics stay strict JSON."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from safetensors.torch import load_file

from padless.config.loading import load_config
from padless.config.schema import SFTConfig
from padless.errors import DivergenceError, InputError
from padless.run.guard import DivergenceGuard
from padless.run.reporting import Reporter
from padless.trainers.sft import SFTRecipe, run_sft

FAST = [
    "model.name=tiny-llama",
    "data.train=tiny:sft_eval",
    "train.progress_bar=false",
    "train.report_to=[jsonl]",
    "train.logging_steps=1",
    "train.max_tokens_per_batch=700",
]
SINGLE = SimpleNamespace(
    num_processes=1, process_index=0, device=torch.device("cpu"), distributed_type=DistributedType.NO
)


def poison(monkeypatch, calls: set[int]) -> None:
    """Make the loss of the given micro-batch calls (0-based, training and eval alike) NaN."""
    original = SFTRecipe.loss
    seen = [0]

    def loss(self, model, micro, normaliser):
        value, metrics = original(self, model, micro, normaliser)
        seen[0] += 1
        if seen[0] - 1 in calls:
            return value * math.nan, {**metrics, "loss": math.nan}
        return value, metrics

    monkeypatch.setattr(SFTRecipe, "loss", loss)


def test_stop_names_the_step_and_micro_batch(tmp_path, monkeypatch):
    poison(monkeypatch, {4})  # step 2 has micro-batches 3, 4, 5 (0-based): the second one
    overrides = [*FAST, f"train.output_dir={tmp_path}", "train.max_steps=3", "train.save_steps=1"]
    with pytest.raises(DivergenceError, match="diverged at step 2: loss nan in micro-batch 2 of 3"):
        run_sft(load_config(SFTConfig, None, [*overrides, "train.gradient_accumulation_steps=3"]))
    assert [p.name for p in tmp_path.glob("checkpoint-*")] == ["checkpoint-1"]


def test_skip_drops_the_step_counts_it_and_keeps_metrics_strict(tmp_path, monkeypatch):
    poison(monkeypatch, {1})  # step 2's only micro-batch
    overrides = [*FAST, f"train.output_dir={tmp_path}", "train.max_steps=3", "train.save_steps=1"]
    metrics = run_sft(load_config(SFTConfig, None, [*overrides, "train.on_nonfinite=skip"]))
    assert metrics["train/nonfinite_skipped"] == 1.0 and math.isfinite(metrics["train/loss"])
    records = [
        json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.jsonl"))
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    by_step = {r["step"]: r for r in records if "train/lr" in r}
    assert "train/loss" not in by_step[2] and by_step[2]["train/nonfinite_skipped"] == 1.0
    assert math.isfinite(by_step[3]["train/loss"])
    one, two = (load_file(tmp_path / f"checkpoint-{s}" / "model.safetensors") for s in (1, 2))
    assert all(torch.equal(one[k], two[k]) for k in one)  # the skipped step changed no weight
    three = load_file(tmp_path / "checkpoint-3" / "model.safetensors")
    assert any(not torch.equal(two[k], three[k]) for k in two)


def test_guard_asks_every_rank_once_per_step():
    guard = DivergenceGuard("skip", SINGLE)
    guard.watch(torch.tensor(1.0), 0, 2)
    guard.watch(torch.tensor(math.inf), 1, 2)
    assert guard.allow_step(0.5) is False and guard.skipped == 1
    assert guard.allow_step(0.5) is True  # the next step starts clean
    assert guard.allow_step(math.nan) is False and guard.metrics() == {"train/nonfinite_skipped": 2.0}


def test_non_finite_weights_are_never_saved():
    model = torch.nn.Linear(2, 2)
    guard = DivergenceGuard("stop", SINGLE)
    guard.check_weights(model)
    with torch.no_grad():
        model.weight[0, 1] = math.inf
    with pytest.raises(DivergenceError, match="weight weight is not finite, so no checkpoint was written"):
        guard.check_weights(model)


def test_metrics_jsonl_writes_non_finite_values_as_null(tmp_path):
    reporter = Reporter(tmp_path, ["jsonl"], enabled=True)
    reporter.log(1, {"a": math.nan, "b": math.inf, "c": 1.5})
    record = json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=pytest.fail)
    assert record == {"step": 1, "a": None, "b": None, "c": 1.5}


def test_skip_is_refused_where_the_engine_steps_inside_backward():
    deepspeed = SimpleNamespace(
        **{**vars(SINGLE), "distributed_type": DistributedType.DEEPSPEED},
        state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=2)),
    )
    with pytest.raises(InputError, match="cannot drop a step under DeepSpeed"):
        DivergenceGuard("skip", deepspeed)
    assert DivergenceGuard("stop", deepspeed).steps_in_backward


def test_float16_weights_are_advised_out_of_float16_first():
    """A float16 run's divergence is its range (65504) before its learning rate: that advice comes first;
    other dtypes keep the learning-rate advice."""
    fixes = {}
    for float16 in (True, False):
        guard = DivergenceGuard("stop", SINGLE, float16)
        guard.step = 3
        with pytest.raises(DivergenceError, match="training diverged at step 3: gradient norm inf") as info:
            guard.allow_step(math.inf)
        fixes[float16] = str(info.value).partition("Fix: ")[2]
    assert fixes[True].startswith("the model trains in float16, whose range ends at 65504")
    assert "set model.dtype to bfloat16" in fixes[True] and fixes[True].endswith(fixes[False])
    assert fixes[False].startswith("lower train.learning_rate") and "model.dtype" not in fixes[False]
