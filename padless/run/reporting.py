"""Metrics out of the loop: ``metrics.jsonl``, TensorBoard, a loss-curve PNG in the run directory, and the
experiment trackers of ``train.report_to`` (trackio, Weights & Biases, MLflow).

Trackers run on the main process only, each with the run's name, its whole resolved config and every
metric record. Each is started before the first step: one that cannot start stops the run there with one
line naming it and the fix. One that fails later is dropped with a warning (``metrics.jsonl`` keeps every
record). A resumed run continues the same tracker runs (their ids are kept in ``trackers.json``).

``metrics.jsonl`` is strict JSON: a value that is not finite is written as ``null`` (the divergence guard
stops or skips such steps, so this is for metrics like a standard deviation of one sample). What the data
stage reports before the loop starts (rows kept and skipped, by reason) goes into the run's first record.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from padless.config.choices import TRACKERS
from padless.data import DataError, SkipStats
from padless.errors import InputError
from padless.faults import doing, write_atomic
from padless.run.rundir import own

log = logging.getLogger(__name__)
_pending: dict[Path, dict[str, float]] = {}  # run folder -> data metrics for its first record
_configs: dict[Path, dict[str, Any]] = {}  # run folder -> its resolved config, for the trackers
TRACKER_IDS = "trackers.json"  # in the run folder: each tracker's run id, continued at resume


def remember_config(config: dict[str, Any], output_dir: str | Path) -> None:
    """The run's resolved config, for the trackers to record when the loop starts them."""
    _configs[Path(output_dir).resolve()] = config


def report_data(stats: SkipStats, role: str, spec: str, output_dir: str | Path) -> None:
    """Say what ``data.skip_bad_rows`` dropped from ``data.<role>`` (log and metrics); a set whose every
    row was skipped is an error, not an empty run."""
    if stats.kept == 0 and stats.skipped:
        raise DataError(
            f"data.{role} {spec}: all {stats.skipped} rows were skipped "
            f"({stats.summary().partition(': ')[2]}); the first: {stats.examples_of[0]}",
            source=spec,
            reason="all skipped",
        )
    if stats.skipped:
        log.warning("data.%s %s: %s", role, spec, stats.summary())
    else:
        log.info("data.%s %s: %d rows", role, spec, stats.kept)
    metrics = {f"data/{role}/rows": float(stats.kept), f"data/{role}/skipped": float(stats.skipped)}
    for reason, n in stats.reasons.items():
        metrics[f"data/{role}/skipped/{re.sub(r'[^a-z0-9]+', '_', reason.lower()).strip('_')}"] = float(n)
    _pending.setdefault(Path(output_dir).resolve(), {}).update(metrics)


def _step(line: str) -> int | None:
    """The step of a metrics record, or None for a line that is not one (a record cut short when a run was
    killed mid-write): such a line is dropped, never fatal."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) else None


def _strict(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


@dataclass(frozen=True)
class RunInfo:
    """What a tracker starts a run with."""

    name: str
    project: str
    config: dict[str, Any]  # the resolved config
    folder: Path  # the run folder
    ids: dict[str, str] | None  # the tracker run ids saved by the run this one resumes; None: a new run


class Tracker:
    """An experiment tracker's run: started from :class:`RunInfo`, then given every metrics record."""

    fix: str  # what to check when it does not start

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self, failed: bool = False) -> None:
        raise NotImplementedError

    def id(self) -> str | None:
        """What continues this run at resume (None: the name does)."""
        return None


class Trackio(Tracker):
    fix = "check that TRACKIO_DIR (default: trackio's folder in the Hugging Face cache) is writable"

    def __init__(self, run: RunInfo) -> None:
        import trackio

        resume = "never" if run.ids is None else "allow"  # a new run never adds to an old one of its name
        self.run = trackio.init(
            project=run.project, name=run.name, config=run.config, resume=resume, embed=False
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish()


class WandB(Tracker):
    fix = (
        "padless runs wandb offline unless WANDB_MODE is set (then check the login and WANDB_MODE), into "
        "output_dir/wandb unless WANDB_DIR is set; `wandb sync <that folder>/offline-run-*` uploads it"
    )

    def __init__(self, run: RunInfo) -> None:
        import wandb

        id_ = (run.ids or {}).get("wandb")
        self.run = wandb.init(
            project=run.project,
            name=run.name,
            config=run.config,
            id=id_,
            resume="allow" if id_ else None,
            mode=os.environ.get("WANDB_MODE", "offline"),
            dir=os.environ.get("WANDB_DIR", str(run.folder)),
            reinit="create_new",
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)

    def id(self) -> str | None:
        return self.run.id


class MLflow(Tracker):
    fix = (
        "padless writes to a file store in output_dir/mlruns unless MLFLOW_TRACKING_URI is set (then check "
        "that server or store)"
    )

    def __init__(self, run: RunInfo) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if uri is None:  # MLflow 3 keeps its file store only on request
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run.folder / "mlruns").resolve().as_uri()
        self.client = MlflowClient(uri)
        experiment = self.client.get_experiment_by_name(run.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(run.project)
        if run.ids and run.ids.get("mlflow"):
            self.run_id = run.ids["mlflow"]
            self.client.update_run(self.run_id, status="RUNNING")
            return
        self.run_id = self.client.create_run(experiment_id, run_name=run.name).info.run_id
        flat = _flat(run.config).items()
        params = [Param(k, v if isinstance(v, str) else json.dumps(v)) for k, v in flat]
        for start in range(0, len(params), 100):  # MLflow takes 100 parameters per call
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        values = [Metric(k, v, now, step) for k, v in metrics.items() if v is not None and math.isfinite(v)]
        for start in range(0, len(values), 1000):
            self.client.log_batch(self.run_id, metrics=values[start : start + 1000])

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")

    def id(self) -> str | None:
        return self.run_id


TRACKER_CLASSES: dict[str, type[Tracker]] = {"trackio": Trackio, "wandb": WandB, "mlflow": MLflow}


class Reporter:
    """Writes on the main process only; other ranks get a reporter that does nothing."""

    def __init__(
        self,
        output_dir: str | Path,
        report_to: list[str],
        enabled: bool,
        resume_step: int | None = None,
        run_name: str | None = None,
        project: str = "padless",
    ):
        self.dir = Path(output_dir)
        self.enabled = enabled
        self.jsonl = self.dir / "metrics.jsonl" if enabled and "jsonl" in report_to else None
        self.tb = None
        self.trackers: dict[str, Tracker] = {}
        if not enabled:
            return
        with doing("opening the metrics files", self.dir, setting="train.output_dir"):
            self.dir.mkdir(parents=True, exist_ok=True)
            own(self.dir, *(["metrics.jsonl"] if self.jsonl else []), "loss.png")
            if self.jsonl is not None:
                self._truncate_after(resume_step)
            if "tensorboard" in report_to:
                from torch.utils.tensorboard import SummaryWriter

                own(self.dir, "tensorboard")
                self.tb = SummaryWriter(log_dir=str(self.dir / "tensorboard"), purge_step=resume_step)
        self._start_trackers(
            [r for r in report_to if r in TRACKERS], run_name or self.dir.resolve().name, project, resume_step
        )
        data = _pending.pop(self.dir.resolve(), None)
        if data:
            self.log(resume_step or 0, data)

    def _start_trackers(self, names: list[str], run_name: str, project: str, resume_step: int | None) -> None:
        """Start each tracker, or stop here naming the one that did not start; their run ids are saved so
        that a resumed run continues them."""
        if not names:
            return
        file = self.dir / TRACKER_IDS
        ids = None
        if resume_step is not None and file.exists():
            with doing("reading the trackers' run ids", file, corrupt_fix=f"delete {file}"):
                ids = json.loads(file.read_text())
        config = _configs.pop(self.dir.resolve(), {})
        for name in names:
            cls = TRACKER_CLASSES[name]
            try:
                self.trackers[name] = cls(RunInfo(run_name, project, config, self.dir, ids))
            except Exception as e:
                self.close(failed=True)
                first = (str(e).strip().splitlines() or [""])[0][:300]
                raise InputError(
                    f"train.report_to: {name} did not start ({type(e).__name__}: {first}); fix: {cls.fix}, "
                    f"or remove {name} from train.report_to"
                ) from e
        ids = {name: t.id() for name, t in self.trackers.items() if t.id() is not None}
        own(self.dir, TRACKER_IDS)
        with doing("writing the trackers' run ids", file, setting="train.output_dir"):
            write_atomic(file, json.dumps(ids))

    def _truncate_after(self, step: int | None) -> None:
        """A resumed run rewrites history from its checkpoint on: drop records of steps beyond it."""
        if self.jsonl is None or not self.jsonl.exists():
            return
        if step is None:
            self.jsonl.unlink()
            return
        steps = [(line, _step(line)) for line in self.jsonl.read_text().splitlines()]
        kept = [line for line, at in steps if at is not None and at <= step]
        torn = [line for line, at in steps if at is None and line.strip()]
        if torn:
            log.warning(
                "%s: dropped %d line(s) that are not whole records (cut short when the run was stopped "
                "mid-write): %s",
                self.jsonl,
                len(torn),
                ", ".join(repr(line[:60]) for line in torn[:3]),
            )
        write_atomic(self.jsonl, "".join(line + "\n" for line in kept))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self.jsonl is not None:
            record = {"step": step, **{k: _strict(v) for k, v in metrics.items()}}
            what = f"writing the metrics of step {step}"
            with doing(what, self.jsonl, "train.output_dir"), self.jsonl.open("a") as f:
                f.write(json.dumps(record, allow_nan=False) + "\n")
        if self.tb is not None:
            for key, value in metrics.items():
                self.tb.add_scalar(key, value, step)
        for name, tracker in list(self.trackers.items()):
            try:
                tracker.log(step, metrics)
            except Exception as e:  # the run goes on; metrics.jsonl keeps the records
                log.warning(
                    "%s failed at step %d (%s: %s): no more metrics go to it", name, step, type(e).__name__, e
                )
                del self.trackers[name]

    def records(self) -> list[dict[str, Any]]:
        if self.jsonl is None or not self.jsonl.exists():
            return []
        lines = self.jsonl.read_text().splitlines()
        return [json.loads(line) for line in lines if _step(line) is not None]

    def plot(self, keys: tuple[str, ...] = ("train/loss", "eval/loss")) -> Path | None:
        """Loss curves to ``loss.png`` (from metrics.jsonl, so a resumed run plots its whole history)."""
        records = self.records()
        if not self.enabled or not records:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for key in keys:
            points = [(r["step"], r[key]) for r in records if key in r]
            if points:
                ax.plot(*zip(*points, strict=True), marker="." if len(points) < 50 else None, label=key)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend()
        path = self.dir / "loss.png"
        fig.tight_layout()
        with doing("drawing the loss curve", path, setting="train.output_dir"):
            fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    def close(self, failed: bool = False) -> None:
        if self.tb is not None:
            self.tb.close()
        for name, tracker in self.trackers.items():
            try:
                tracker.close(failed)
            except Exception as e:
                log.warning("%s did not close cleanly (%s: %s)", name, type(e).__name__, e)
        self.trackers = {}
