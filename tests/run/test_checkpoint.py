"""Checkpoint state holds data only: nothing in a checkpoint folder is ever unpickled."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

from padless.cli import main

RUN = [
    "model.name=tiny-llama",
    "data.train=tiny:sft_eval",
    "data.max_length=1024",
    "train.max_tokens_per_batch=1024",
    "train.max_steps=3",
    "train.save_steps=2",
    "train.logging_steps=1",
    "train.progress_bar=false",
    "train.report_to=[jsonl]",
]


class Planted:
    """Unpickling this creates ``marker``: proof that a file was unpickled."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_planted_pickle_is_never_executed_and_resume_is_exact(tmp_path):
    straight, run = tmp_path / "straight", tmp_path / "run"
    assert main(["sft", *RUN, f"train.output_dir={straight}"]) == 0
    shutil.copytree(straight, run)
    shutil.rmtree(run / "checkpoint-3")
    ckpt = run / "checkpoint-2"
    assert not [p for p in ckpt.rglob("*") if p.suffix in (".pkl", ".pt", ".bin", ".pth")]
    # every name a pickle-loading trainer would look for: accelerate's state, torch.save'd plans
    marker = tmp_path / "executed"
    for name in (
        "state/custom_checkpoint_0.pkl",
        "state/random_states_0.pkl",
        "state/optimizer.bin",
        "state/scheduler.bin",
        "plan.pt",
        "training_args.bin",
        "rng_state.pth",
    ):
        (ckpt / name).write_bytes(pickle.dumps(Planted(marker)))
    resumed = ["sft", *RUN, f"train.output_dir={run}", "train.resume_from_checkpoint=latest"]
    assert main(resumed) == 0
    assert not marker.exists(), "a file in the checkpoint was unpickled"

    def losses(path: Path) -> dict[int, float]:
        lines = (path / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["train/loss"] for r in map(json.loads, lines) if "train/loss" in r}

    assert losses(run)[3] == losses(straight)[3]
