"""Metrics out of the loop: ``metrics.jsonl``, TensorBoard, and a loss-curve PNG in the run directory.

``metrics.jsonl`` is strict JSON: a value that is not finite is written as ``null`` (the divergence guard
stops or skips such steps, so this is for metrics like a standard deviation of one sample). What the data
stage reports before the loop starts (rows kept and skipped, by reason) goes into the run's first record.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any

from padless.data import DataError, SkipStats
from padless.faults import doing, write_atomic
from padless.run.runfiles import own

log = logging.getLogger(__name__)
_pending: dict[Path, dict[str, float]] = {}  # run folder -> data metrics for its first record


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


class Reporter:
    """Writes on the main process only; other ranks get a reporter that does nothing."""

    def __init__(
        self, output_dir: str | Path, report_to: list[str], enabled: bool, resume_step: int | None = None
    ):
        self.dir = Path(output_dir)
        self.enabled = enabled
        self.jsonl = self.dir / "metrics.jsonl" if enabled and "jsonl" in report_to else None
        self.tb = None
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
        data = _pending.pop(self.dir.resolve(), None)
        if data:
            self.log(resume_step or 0, data)

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

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
