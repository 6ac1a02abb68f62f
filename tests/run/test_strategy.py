"""The data-parallel strategy: what cannot be honoured is refused before anything trains, and the model
actually prepared is checked against the request. (The strategies themselves train in
``tests/trainers/test_strategies.py``.)"""

from __future__ import annotations

import json

import pytest
import torch

from padless.run.strategy import StrategyError, start_accelerator, strategy_in_use, verify_strategy


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"}, r"gradient_accumulation_steps is 4.*train\."),
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, r"FSDP version 1.*fsdp_version: 2"),
        (
            {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "1"},
            r"ZeRO stage 1.*zero_stage: 2",
        ),
        (
            {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true"},
            r"zero3_init_flag: false",
        ),
        (
            {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_GRADIENT_CLIPPING": "0.5"},
            r"clips gradients at 0.5 but train.max_grad_norm is 1.0",
        ),
    ],
)
def test_requests_that_would_be_silently_changed_are_refused(monkeypatch, env, match):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(StrategyError, match=match):
        start_accelerator(max_grad_norm=1.0)


def test_deepspeed_config_that_accumulates_on_its_own_is_refused(monkeypatch, tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 8}))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(config))
    with pytest.raises(StrategyError, match=r"gradient_accumulation_steps=8"):
        start_accelerator(max_grad_norm=1.0)


def test_a_model_that_is_not_what_was_asked_for_stops_the_run():
    accelerator = start_accelerator(max_grad_norm=1.0)
    model = torch.nn.Linear(2, 2)
    assert strategy_in_use(model) == "single"
    verify_strategy(accelerator, model, "single")
    with pytest.raises(StrategyError, match=r"fsdp2 was requested but the prepared model runs under single"):
        verify_strategy(accelerator, model, "fsdp2")
