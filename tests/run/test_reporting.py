"""Experiment trackers in ``train.report_to``: trackio, Weights & Biases (offline) and MLflow (a local file
store) each record the run's name, its config and every metric of every record, read back here from what
each wrote; one that cannot start stops the run before the first step, naming it and the fix."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("TRACKIO_DIR", tempfile.mkdtemp(prefix="padless-tests-trackio-"))  # read at import

import padless
from padless.config.schema import SFTConfig
from padless.errors import InputError
from padless.run.reporting import TRACKER_IDS, Reporter
from padless.tiny import data_path

PROJECT = "padless-tests"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """One two-step SFT run reporting to every tracker; its folder."""
    folder = tmp_path_factory.mktemp("trackers") / "run"
    rows = [json.loads(line) for line in data_path("sft").read_text().splitlines()[:6]]
    with pytest.MonkeyPatch.context() as mp:
        for name in ("WANDB_MODE", "WANDB_DIR", "MLFLOW_TRACKING_URI"):
            mp.delenv(name, raising=False)
        mp.setenv("WANDB_SILENT", "true")
        padless.SFT(
            train_data=rows,
            train={
                "max_steps": 2,
                "logging_steps": 1,
                "progress_bar": False,
                "output_dir": str(folder),
                "report_to": ["jsonl", "trackio", "wandb", "mlflow"],
                "run_name": "tracked",
                "project": PROJECT,
            },
        ).train()
    return folder


def records(folder: Path) -> list[dict]:
    """What metrics.jsonl holds, the reference every tracker is held to."""
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if v is not None} for line in lines]


def held(got: dict[int, dict[str, float]], folder: Path) -> None:
    """Every metric of every record, at its step, equal (trackers store float64 or JSON text)."""
    for record in records(folder):
        step = record.pop("step")
        assert got.get(step, {}).keys() >= record.keys(), (
            step,
            sorted(record.keys() - got.get(step, {}).keys()),
        )
        assert all(got[step][k] == pytest.approx(v, rel=1e-12) for k, v in record.items()), step


@pytest.mark.slow
def test_trackio_records_name_config_and_every_metric(run):
    from trackio.sqlite_storage import SQLiteStorage

    logs = SQLiteStorage.get_logs(PROJECT, "tracked")
    held({r["step"]: r for r in logs}, run)
    config = SQLiteStorage.get_run_config(PROJECT, "tracked")
    assert config["train"]["run_name"] == "tracked" and config["data"]["train"] == "python:data.train"
    assert config["train"]["learning_rate"] == 1e-4 and config["model"]["name"] == "tiny-qwen2"


def wandb_records(file: Path):
    """The protobuf records of an offline ``.wandb`` file (a LevelDB log: 7-byte header, 32 KiB blocks of
    chunks with a 7-byte header each: crc, length, kind 1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, parts = file.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record
            parts = b""


@pytest.mark.slow
def test_wandb_offline_records_name_config_and_every_metric(run):
    (file,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    got, config, names = {}, {}, []
    for record in wandb_records(file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            got[items.pop("_step")] = items
        elif kind == "run":
            names.append((record.run.display_name, record.run.project))
            config |= {i.key: json.loads(i.value_json) for i in record.run.config.update}
        elif kind == "config":
            config |= {i.key: json.loads(i.value_json) for i in record.config.update}
    held(got, run)
    assert names == [("tracked", PROJECT)]
    assert config["train"]["run_name"] == "tracked" and config["model"]["name"] == "tiny-qwen2"
    assert json.loads((run / TRACKER_IDS).read_text())["wandb"] in file.name


@pytest.mark.slow
def test_mlflow_file_store_records_name_config_and_every_metric(run):
    from mlflow.tracking import MlflowClient

    client = MlflowClient((run / "mlruns").resolve().as_uri())
    run_id = json.loads((run / TRACKER_IDS).read_text())["mlflow"]
    info = client.get_run(run_id)
    assert info.info.run_name == "tracked" and info.info.status == "FINISHED"
    assert client.get_experiment(info.info.experiment_id).name == PROJECT
    params = info.data.params
    assert params["train.run_name"] == "tracked" and params["train.learning_rate"] == "0.0001"
    got: dict[int, dict[str, float]] = {}
    for key in info.data.metrics:
        for m in client.get_metric_history(run_id, key):
            got.setdefault(m.step, {})[key] = m.value
    held(got, run)


def test_a_tracker_that_cannot_start_stops_before_the_first_step(tmp_path, monkeypatch):
    """MLflow pointed at a store it cannot open: one line naming mlflow and the setting, no step trained."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "file" / "store").as_uri())
    with pytest.raises(InputError, match=r"train\.report_to: mlflow did not start .*MLFLOW_TRACKING_URI"):
        Reporter(tmp_path / "out", ["jsonl", "mlflow"], enabled=True)


def test_a_resumed_run_continues_its_tracker_runs(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    first = Reporter(tmp_path, ["mlflow"], enabled=True, run_name="r")
    first.log(1, {"train/loss": 2.0})
    first.close()
    again = Reporter(tmp_path, ["mlflow"], enabled=True, resume_step=1, run_name="r")
    again.log(2, {"train/loss": 1.0})
    again.close()
    from mlflow.tracking import MlflowClient

    client = MlflowClient((tmp_path / "mlruns").resolve().as_uri())
    run_id = json.loads((tmp_path / TRACKER_IDS).read_text())["mlflow"]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")] == [
        (1, 2.0),
        (2, 1.0),
    ]


def test_tracker_settings_are_checked_with_the_config(monkeypatch):
    with pytest.raises(ValueError, match=r"run_name='x' has no effect: .*report_to lists none"):
        SFTConfig(train={"run_name": "x", "report_to": ["jsonl"]})
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ValueError, match=r"wandb is not installed.*padless\[wandb\]"):
        SFTConfig(train={"report_to": ["wandb"]})
