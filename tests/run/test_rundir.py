"""Run folders belong to one run: used folders refused, a lock against concurrent runs (a dead holder's
lock taken over), latest / auto resume said out loud, and rotation that renames before deleting."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from padless.config.loading import load_config
from padless.config.schema import SFTConfig, TrainSettings
from padless.errors import InputError
from padless.run import rundir
from padless.run.rundir import own, owned
from padless.trainers.sft import run_sft

FAST = ["model.name=tiny-llama", "data.train=tiny:sft_eval", "train.progress_bar=false"]
MAIN = SimpleNamespace(is_main_process=True, num_processes=1)


def claim(root: Path, **settings) -> Path | None:
    try:
        return rundir.claim(MAIN, TrainSettings(output_dir=str(root), **settings))
    finally:
        rundir.release(root)


def checkpoint(root: Path, step: int) -> Path:
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / rundir.STATE_FILE).write_text(json.dumps({"step": step}))
    return path


def test_a_second_run_into_a_used_folder_is_refused_and_the_first_is_kept(tmp_path):
    overrides = [*FAST, f"train.output_dir={tmp_path}", "train.max_steps=1"]
    run_sft(load_config(SFTConfig, None, overrides))
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(InputError, match=r"is not empty .*overwrite_output_dir=true"):
        run_sft(load_config(SFTConfig, None, overrides))
    after = {p.name: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before and "metrics.jsonl" in after
    assert not (tmp_path / rundir.LOCK_FILE).exists()  # released by the run that failed, too


def test_overwrite_deletes_what_padless_wrote_by_its_manifest_and_keeps_the_rest(tmp_path, caplog):
    """The user's own config.yaml has a name padless writes too: only the manifest says whose it is."""
    checkpoint(tmp_path, 4)
    (tmp_path / ".tmp-checkpoint-6").mkdir()
    for name in ("metrics.jsonl", "log.txt", "notes.md", "config.yaml"):
        (tmp_path / name).write_text("x")
    own(tmp_path, "checkpoint-4", "metrics.jsonl", "log.txt")
    with caplog.at_level(logging.WARNING, logger="padless"):
        assert claim(tmp_path, overwrite_output_dir=True) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "notes.md"]
    assert "deleted 5 entries" in caplog.text and "kept 2" in caplog.text  # 3 listed, the manifest, a .tmp


def test_overwrite_without_a_manifest_deletes_nothing_and_says_why(tmp_path):
    checkpoint(tmp_path, 4)
    (tmp_path / "metrics.jsonl").write_text("x")
    with pytest.raises(InputError, match=r"holds checkpoint-4, metrics.jsonl but no padless-manifest.json"):
        claim(tmp_path, overwrite_output_dir=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "metrics.jsonl"]


def test_resuming_an_older_checkpoint_is_a_branch_that_keeps_the_newer_ones(tmp_path, caplog):
    for step in (2, 4, 6):
        checkpoint(tmp_path, step)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 7)))
    with caplog.at_level(logging.WARNING, logger="padless"):
        resume = claim(tmp_path, resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
        assert resume is not None and not list(tmp_path.glob("superseded-*"))  # nothing moved yet
        rundir.branch(tmp_path, resume)
    (aside,) = tmp_path.glob("superseded-*-after-step-2")
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoint-4", "checkpoint-6", "metrics.jsonl"]
    assert len((aside / "metrics.jsonl").read_text().splitlines()) == 6
    assert [p.name for p in rundir.checkpoints(tmp_path)] == ["checkpoint-2"]  # latest is the branch's
    assert "nothing deleted" in caplog.text and aside.name in owned(tmp_path)


def test_latest_needs_a_checkpoint_and_auto_says_what_it_did(tmp_path, caplog):
    with pytest.raises(InputError, match=r"no complete checkpoint.*set it to auto"):
        claim(tmp_path, resume_from_checkpoint="latest")
    with caplog.at_level(logging.INFO, logger="padless"):
        assert claim(tmp_path, resume_from_checkpoint="auto") is None
        assert "no checkpoint in" in caplog.text and "starting fresh" in caplog.text
        newest = checkpoint(tmp_path, 8)
        checkpoint(tmp_path, 2)
        (tmp_path / "checkpoint-9").mkdir()  # incomplete: no trainer_state.json
        assert claim(tmp_path, resume_from_checkpoint="auto") == newest.resolve()
        assert f"resuming from {newest.resolve()}" in caplog.text
        assert claim(tmp_path, resume_from_checkpoint="latest") == newest.resolve()


def test_auto_starts_over_a_run_that_died_before_its_first_checkpoint(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "config.yaml").write_text("x: 1\n")
    own(tmp_path, "metrics.jsonl", "config.yaml")
    assert claim(tmp_path, resume_from_checkpoint="auto") is None
    assert not (tmp_path / "metrics.jsonl").exists()
    (tmp_path / "mine.txt").write_text("not padless's")
    with pytest.raises(InputError, match="is not empty"):
        claim(tmp_path, resume_from_checkpoint="auto")


def test_the_lock_refuses_a_live_run_and_is_taken_over_from_a_dead_one(tmp_path, caplog):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = {"pid": holder.pid, "host": socket.gethostname(), "started": "now"}
        (tmp_path / rundir.LOCK_FILE).write_text(json.dumps(lock))
        with pytest.raises(InputError, match=f"in use by another padless run \\(pid {holder.pid}"):
            claim(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    with caplog.at_level(logging.WARNING, logger="padless"):
        rundir.claim(MAIN, TrainSettings(output_dir=str(tmp_path)))
    assert f"from pid {holder.pid}, which is no longer running" in caplog.text
    assert json.loads((tmp_path / rundir.LOCK_FILE).read_text())["pid"] == os.getpid()
    rundir.release(tmp_path)
    assert not (tmp_path / rundir.LOCK_FILE).exists()


def test_a_lock_from_another_host_is_never_taken_over(tmp_path):
    (tmp_path / rundir.LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "now"}))
    with pytest.raises(InputError, match="pid 1 on elsewhere"):
        claim(tmp_path)


def test_rotation_renames_before_deleting(tmp_path, monkeypatch):
    """A kill in the middle of deleting an old checkpoint leaves a hidden leftover, never a half
    checkpoint that still looks complete; the next start sweeps it."""
    for step in (2, 4, 6):
        checkpoint(tmp_path, step)

    def killed(path, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(rundir.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        rundir.rotate_checkpoints(tmp_path, keep=2)
    assert [p.name for p in rundir.checkpoints(tmp_path)] == ["checkpoint-4", "checkpoint-6"]
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".old-checkpoint-2")]
    assert len(leftovers) == 1
    monkeypatch.undo()
    assert claim(tmp_path, resume_from_checkpoint="latest") == (tmp_path / "checkpoint-6").resolve()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-6"]
