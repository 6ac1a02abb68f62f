"""Every example config is valid and runs (two steps, with eval and a checkpoint) on the embedded default."""

from __future__ import annotations

from pathlib import Path

import pytest

from padless.cli import TRAINERS, _load
from padless.config import load_config

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))


def trainer_of(path: Path) -> str:
    return path.stem.split("_")[0]


def test_every_example_names_a_trainer():
    assert EXAMPLES
    assert all(trainer_of(p) in TRAINERS for p in EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs(path, tmp_path):
    config_cls, run = (_load(t) for t in TRAINERS[trainer_of(path)][:2])
    overrides = [
        f"train.output_dir={tmp_path}",
        "train.max_steps=2",
        "train.eval_steps=2",
        "train.save_steps=2",
        "train.progress_bar=false",
    ]
    if trainer_of(path) == "sft":
        overrides += ["data.train=tiny:sft_eval", "train.eval_max_new_tokens=4"]
    else:
        overrides += ["data.train=tiny:preference_eval"]
    metrics = run(load_config(config_cls, path, overrides))
    assert metrics["eval/loss"] > 0
    assert (tmp_path / "checkpoint-2" / "trainer_state.json").exists()
