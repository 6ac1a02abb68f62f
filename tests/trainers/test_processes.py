"""Whole processes: a run killed with SIGKILL resumes to the same loss, and 2 GRPO processes each sample
half of every rollout. (Every strategy against one process: ``test_strategies.py``.)"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

BASE = [
    "model.name=tiny-llama",
    "data.max_length=1024",
    "train.logging_steps=1",
    "train.max_tokens_per_batch=1024",
    "train.progress_bar=false",
    "train.report_to=[jsonl]",
]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def sft_cmd(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "padless.cli", "sft", *BASE, f"train.output_dir={run_dir}", *overrides]


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_matches_uninterrupted(tmp_path):
    steps = ["train.max_steps=12", "train.save_steps=2"]
    straight = tmp_path / "straight"
    subprocess.run(sft_cmd(straight, *steps), check=True, env=ENV, capture_output=True, timeout=600)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        sft_cmd(killed, *steps), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.time() + 600
    while not (killed / "checkpoint-4" / "trainer_state.json").exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.time() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "checkpoint-12").exists(), "the run finished before it was killed"

    resumed = subprocess.run(
        sft_cmd(killed, *steps, "train.resume_from_checkpoint=latest"),
        env=ENV,
        capture_output=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr.decode()[-2000:]
    a, b = losses(straight), losses(killed)
    assert sorted(b) == list(range(1, 13))
    assert b[12] == pytest.approx(a[12], rel=1e-6, abs=0)
    for step in range(1, 13):
        assert b[step] == pytest.approx(a[step], rel=1e-6, abs=0), step


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two(command: str, *overrides: str, machine: int | None = None, port: int = 0) -> list[str]:
    """``padless <command>`` on 2 CPU processes (gloo) under ``accelerate launch``: both on this machine, or
    (``machine`` 0 or 1) this one of two "machines" of one process each meeting at ``port`` on this host,
    accelerate's multi-machine launch as each node of a cluster runs it."""
    where = ["--num_machines", "1"]
    if machine is not None:
        where = ["--num_machines", "2", "--machine_rank", str(machine), "--main_process_ip", "127.0.0.1"]
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        *where,
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(port or free_port()),
        "-m",
        "padless.cli",
        command,
        *overrides,
    ]


SCORER = """
import json, os

def logged(prompts, completions, **fields):
    values = [float(len(set(c))) for c in completions]
    with open(os.path.join({log!r}, "rank%s.jsonl" % os.environ["RANK"]), "a") as f:
        f.write(json.dumps({{"prompts": prompts, "values": values}}) + "\\n")
    return values
"""


@pytest.mark.slow
def test_two_grpo_processes_each_sample_half_of_every_rollout(tmp_path):
    """Each rank samples and scores its own half of the prompts (3 eval prompts split 2 + 1); the logged
    rollout reward is the mean over both halves, so every rank planned on the gathered whole."""
    (tmp_path / "scorer.py").write_text(SCORER.format(log=str(tmp_path)))
    rows = [json.loads(line) for line in (Path(__file__).parents[2] / "padless/tiny/data/rl.jsonl").open()]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    run = tmp_path / "run"
    launch = launch_two(
        "grpo",
        *[o for o in BASE if not o.startswith("data.")],
        f"train.output_dir={run}",
        "train.max_steps=2",
        f"data.eval={tmp_path / 'eval.jsonl'}",
        "rollout.prompts_per_step=4",
        "rollout.num_generations=2",
        "rollout.max_new_tokens=4",
        "rollout.mask_truncated=false",
        f"reward.functions=[{tmp_path / 'scorer.py'}:logged]",
    )
    result = subprocess.run(launch, env=ENV, capture_output=True, timeout=600)
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    calls = [[json.loads(line) for line in (tmp_path / f"rank{r}.jsonl").open()] for r in (0, 1)]
    assert [len(c) for c in calls] == [3, 3]  # two rollouts, then the final evaluation
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rollouts = [r for r in records if "rollout/reward" in r]
    for k, record in enumerate(rollouts):
        halves = [calls[0][k], calls[1][k]]
        assert [len(h["prompts"]) for h in halves] == [4, 4]  # 2 prompts x 2 samples on each rank
        assert not set(halves[0]["prompts"]) & set(halves[1]["prompts"])
        values = halves[0]["values"] + halves[1]["values"]
        assert record["rollout/reward"] == pytest.approx(sum(values) / 8, rel=1e-6)
    evals = [calls[0][2], calls[1][2]]
    assert [len(e["prompts"]) for e in evals] == [2, 1]
    values = evals[0]["values"] + evals[1]["values"]
    assert records[-1]["eval/reward"] == pytest.approx(sum(values) / 3, rel=1e-6)


@pytest.mark.slow
def test_two_processes_refuse_a_used_folder_together(tmp_path):
    """The main process checks the run folder; every rank stops with its message instead of waiting for
    the rank that stopped."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    launch = launch_two("sft", *BASE, f"train.output_dir={tmp_path}", "train.max_steps=1")
    result = subprocess.run(launch, env=ENV, capture_output=True, timeout=300)
    err = result.stderr.decode()
    assert result.returncode != 0
    assert err.count(f"padless sft: error: train.output_dir {tmp_path} is not empty") == 2, err[-3000:]
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


@pytest.mark.slow
def test_two_processes_stop_together_on_a_bad_row(tmp_path):
    """The main process tokenizes the data while the other waits for the set; a bad row stops both with its
    message (the waiting one reads it beside the cache) instead of leaving one waiting forever."""
    rows = [json.loads(line) for line in (Path(__file__).parents[2] / "padless/tiny/data/sft.jsonl").open()]
    rows = rows[:30]
    rows[20] = {"messages": "not a list"}
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cache = tmp_path / "cache"
    launch = launch_two(
        "sft", *BASE, f"train.output_dir={tmp_path / 'run'}", f"data.train={data}", f"data.cache_dir={cache}"
    )
    result = subprocess.run(launch, env=ENV, capture_output=True, timeout=300)
    err = result.stderr.decode()
    assert result.returncode != 0
    message = f"padless sft: error: {data} row 21 (line 21): field 'messages' must be a list"
    assert err.count(message) == 2, err[-3000:]
    assert [p.name.endswith(".failed.json") for p in cache.iterdir()] == [True]  # no set, no leftovers


FAILING = """
import os

calls = []


def breaks_on_rank_1(prompts, completions, **fields):
    calls.append(1)
    if os.environ["RANK"] == "1" and len(calls) == 2:
        raise ValueError("the scorer broke")
    return [float(len(set(c))) for c in completions]
"""


@pytest.mark.slow
def test_a_reward_function_failing_on_one_of_two_processes_stops_both_with_a_checkpoint(tmp_path):
    """The reward function raises on rank 1 only, scoring the second rollout: both ranks stop at that point
    (no rank left waiting in a collective), each with one line, and together they first checkpoint the
    step already trained."""
    (tmp_path / "failing.py").write_text(FAILING)
    run = tmp_path / "run"
    launch = launch_two(
        "grpo",
        *[o for o in BASE if not o.startswith("data.")],
        f"train.output_dir={run}",
        "train.max_steps=3",
        "train.save_steps=0",
        "rollout.prompts_per_step=2",
        "rollout.num_generations=2",
        "rollout.max_new_tokens=4",
        "rollout.mask_truncated=false",
        f"reward.functions=[{tmp_path / 'failing.py'}:breaks_on_rank_1]",
    )
    result = subprocess.run(launch, env=ENV, capture_output=True, timeout=600)
    err = result.stderr.decode()
    assert result.returncode != 0
    saved = "the 1 trained steps are saved in checkpoint-1"
    own = "padless grpo: error: at step 2: reward function 'breaks_on_rank_1' raised ValueError: the scorer"
    other = "padless grpo: error: at step 2: a reward function failed on rank 1"
    assert err.count(own) == 1 and err.count(other) == 1 and err.count(saved) == 2, err[-3000:]
    state = json.loads((run / "checkpoint-1" / "trainer_state.json").read_text())
    assert state["step"] == 1 and state["world_size"] == 2
    assert all((run / "checkpoint-1" / f).is_file() for f in state["files"])
    assert not (run / "run.lock").exists()


def start_machines(command: str, *overrides: str) -> list[subprocess.Popen]:
    port = free_port()
    launches = [launch_two(command, *overrides, machine=r, port=port) for r in (0, 1)]
    return [subprocess.Popen(launch, env=ENV, stderr=subprocess.PIPE) for launch in launches]


def worker_of(launcher: subprocess.Popen) -> psutil.Process:
    """The padless process a launcher started (accelerate launch runs it as a child)."""
    deadline = time.time() + 300
    while time.time() < deadline:
        found = [
            p for p in psutil.Process(launcher.pid).children(recursive=True) if "padless.cli" in p.cmdline()
        ]
        if found:
            return found[0]
        time.sleep(0.1)
    raise AssertionError("the launcher started no padless process")


@pytest.mark.slow
def test_two_machines_stopped_by_a_signal_resume_to_what_one_machine_with_two_processes_trains(tmp_path):
    """Two "machines" of one process each on this host (accelerate's multi-machine launch; one run folder
    and one data cache, as nodes share a file system). SIGTERM reaches one of them between steps: both
    checkpoint the trained steps at the same step boundary and stop (exit 143); resumed, they end with the
    losses and weights of one machine with two processes run straight through. The data cache is built once
    (nothing left over), the metrics and checkpoints are written once."""
    common = [*BASE, "data.train=tiny:sft_eval", "train.max_steps=12"]
    one, two = tmp_path / "one", tmp_path / "two"
    result = subprocess.run(
        launch_two("sft", *common, f"train.output_dir={one}", f"data.cache_dir={tmp_path / 'own-cache'}"),
        env=ENV,
        capture_output=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    shared = [*common, f"train.output_dir={two}", f"data.cache_dir={tmp_path / 'cache'}"]
    machines = start_machines("sft", *shared)
    second = worker_of(machines[1])
    deadline = time.time() + 600
    while '"step": 2,' not in (
        (two / "metrics.jsonl").read_text() if (two / "metrics.jsonl").exists() else ""
    ):
        assert all(m.poll() is None for m in machines) and time.time() < deadline, "the run ended first"
        time.sleep(0.05)
    second.send_signal(signal.SIGTERM)
    errors = [m.communicate(timeout=600)[1].decode() for m in machines]
    assert [m.returncode for m in machines] != [0, 0], errors[0][-2000:]
    assert "terminated (SIGTERM); continue from" in errors[0], errors[0][-2000:]  # the main process's line
    [stopped] = [int(p.name.split("-")[1]) for p in two.glob("checkpoint-*")]
    assert 2 <= stopped < 12  # the trained steps, checkpointed by both ranks together
    assert sorted(f.name for f in (two / f"checkpoint-{stopped}" / "state").glob("optimizer-*.json")) == [
        "optimizer-0.json",
        "optimizer-1.json",
    ]
    resumed = start_machines("sft", *shared, "train.resume_from_checkpoint=latest")
    errors = [m.communicate(timeout=600)[1].decode() for m in resumed]
    assert [m.returncode for m in resumed] == [0, 0], errors[0][-3000:]
    a, b = losses(one), losses(two)
    assert sorted(b) == list(range(1, 13)) and b == pytest.approx(a, rel=1e-6, abs=0)
    steps = [json.loads(line)["step"] for line in (two / "metrics.jsonl").read_text().splitlines()]
    assert steps.count(12) == 1 and steps == sorted(steps)  # one writer
    mine, theirs = (load_file(run / "checkpoint-12" / "model.safetensors") for run in (two, one))
    assert mine.keys() == theirs.keys()
    assert max((mine[k] - theirs[k]).abs().max().item() for k in mine) <= 1e-6
    entries = list((tmp_path / "cache").iterdir())
    assert len(entries) == 1 and not entries[0].name.startswith("."), entries  # built once, nothing left over
