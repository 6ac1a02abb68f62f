"""Shared helpers for padless benchmarks: isolation, step timing, memory, environment, tables.

A benchmark runs each contender in a fresh ``spawn`` subprocess (:func:`run_isolated`) so that peak memory
(``ru_maxrss`` is a process-wide high-water mark) and thread settings belong to that contender alone. Inside
the subprocess a contender records the end time of every optimizer step with a :class:`StepRecorder`; time is
measured from the end of the last warm-up step to the end of the last timed step, so everything a trainer
does between optimizer steps (data loading, collation, logging, callbacks) is counted, the same way for
every contender. :class:`MemoryMeter` reports peak memory above the state right before training.

Nothing here imports torch at module level, so the parent process stays light.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import itertools
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

MIB = 1024 * 1024
# Settings that change CPU kernel timing; recorded with the results.
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


# --------------------------------------------------------------------------------------------------------
# Process isolation and threads


def limit_threads(num_threads: int) -> None:
    """Ask every math library for ``num_threads`` threads; call before importing torch (env) and after."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(num_threads)
    if "torch" in sys.modules:
        import torch

        torch.set_num_threads(num_threads)


def hide_devices_for_cpu(device: str) -> None:
    """On a CPU benchmark, hide GPUs from children so every trainer (and accelerate) picks the CPU."""
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def _call_with_traceback(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    try:
        return {"ok": True, "value": fn(**kwargs)}
    except BaseException as e:  # a failed contender must not take the whole benchmark down
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


def run_isolated(fn: Callable[..., Any], **kwargs: Any) -> dict[str, Any]:
    """Run ``fn(**kwargs)`` in a fresh spawned process; returns ``{"ok", "value"}`` or ``{"ok", "error"}``.

    ``fn`` must be importable by name (a module-level function; the benchmark script needs an
    ``if __name__ == "__main__"`` guard). Environment variables set before the call are inherited.
    """
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        try:
            return pool.submit(_call_with_traceback, fn, kwargs).result()
        except Exception as e:  # the child died (killed for memory, segfault, ...)
            return {"ok": False, "error": f"subprocess failed: {type(e).__name__}: {e}", "traceback": ""}


# --------------------------------------------------------------------------------------------------------
# Memory


def current_rss_bytes() -> int:
    """Resident set size of this process now (Linux ``/proc``; falls back to the peak elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (monotonic, process-wide)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


class MemoryMeter:
    """Peak memory of the training phase: CPU peak RSS (and its rise over the start), CUDA peak allocated.

    Call :meth:`start` right before the first training step and :meth:`stop` after the last one.
    """

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.rss_start = 0
        self.cuda_start = 0

    def start(self) -> None:
        self.rss_start = current_rss_bytes()
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.cuda_start = torch.cuda.memory_allocated()

    def stop(self) -> dict[str, float]:
        peak = peak_rss_bytes()
        out = {
            "rss_start_mib": self.rss_start / MIB,
            "peak_rss_mib": peak / MIB,
            "peak_rss_delta_mib": max(0, peak - self.rss_start) / MIB,
        }
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            out["cuda_start_mib"] = self.cuda_start / MIB
            out["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / MIB
        return out


# --------------------------------------------------------------------------------------------------------
# Step timing


@dataclass
class StepRecord:
    end: float  # perf_counter at the end of the optimizer step
    real_tokens: int  # tokens of the sequences themselves
    processed_tokens: int  # tokens the model computed on (real + padding)
    target_tokens: int  # tokens that carry loss
    loss: float


@dataclass
class StepRecorder:
    """Collects one :class:`StepRecord` per optimizer step; times from the end of warm-up.

    The contender calls :meth:`begin` once before training (so the first step has a start time),
    :meth:`tokens` when it sees a micro-batch, and :meth:`step_end` after each optimizer step.
    """

    warmup: int
    cuda: bool = False
    records: list[StepRecord] = field(default_factory=list)
    started: float = 0.0
    _pending: list[int] = field(default_factory=lambda: [0, 0, 0])
    _losses: list[float] = field(default_factory=list)

    def begin(self) -> None:
        self.started = time.perf_counter()

    def tokens(self, real: int, processed: int, targets: int) -> None:
        self._pending[0] += real
        self._pending[1] += processed
        self._pending[2] += targets

    def loss(self, value: float) -> None:
        """A micro-batch's share of the step loss (they sum to the step loss)."""
        self._losses.append(value)

    def step_end(self, loss: float | None = None) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        now = time.perf_counter()
        value = loss if loss is not None else (sum(self._losses) if self._losses else math.nan)
        self.records.append(StepRecord(now, *self._pending, loss=value))
        self._pending, self._losses = [0, 0, 0], []

    def summary(self) -> dict[str, Any]:
        """Throughput over the timed steps (all steps after ``warmup``)."""
        if len(self.records) <= self.warmup:
            raise RuntimeError(
                f"only {len(self.records)} steps ran, not more than the {self.warmup} warm-up steps: "
                "nothing was timed (is the data set too small for the requested steps?)"
            )
        timed = self.records[self.warmup :]
        t0 = self.records[self.warmup - 1].end if self.warmup > 0 else self.started
        seconds = timed[-1].end - t0
        ends = [t0] + [r.end for r in timed]
        durations = [b - a for a, b in itertools.pairwise(ends)]
        real = sum(r.real_tokens for r in timed)
        # Robust to bursts of load from other processes: the median over steps of each step's own rate.
        step_rates = [r.real_tokens / d for r, d in zip(timed, durations, strict=True) if d > 0]
        processed = sum(r.processed_tokens for r in timed)
        losses = [r.loss for r in timed]
        tail = losses[-min(5, len(losses)) :]
        return {
            "steps": len(timed),
            "warmup_steps": self.warmup,
            "seconds": seconds,
            "step_s_median": statistics.median(durations),
            "real_tokens": real,
            "processed_tokens": processed,
            "target_tokens": sum(r.target_tokens for r in timed),
            "real_tokens_per_s": real / seconds,
            "real_tokens_per_s_median_step": statistics.median(step_rates),
            "processed_tokens_per_s": processed / seconds,
            "pad_share": 1.0 - real / processed if processed else 0.0,
            "real_tokens_per_step": real / len(timed),
            "final_loss": losses[-1],
            "final_loss_mean5": sum(tail) / len(tail),
            "losses": [r.loss for r in self.records],
        }


# --------------------------------------------------------------------------------------------------------
# Environment


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_state(repo: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Commit of the checkout and whether the library has uncommitted edits (read-only git calls)."""
    import subprocess

    root = Path(repo) if repo else Path(__file__).resolve().parent.parent

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--", "padless")
    return {"commit": commit, "library_dirty": bool(dirty) if dirty is not None else None}


def environment(packages: Sequence[str] = ("padless", "torch", "transformers", "accelerate", "trl")) -> dict:
    """Date, machine and library versions, for the record next to the numbers."""
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "versions": {name: package_version(name) for name in packages},
        "git": git_state(),
    }
    info["env"] = {k: os.environ[k] for k in THREAD_ENV if k in os.environ}
    if hasattr(os, "getloadavg"):
        info["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
    return info


def gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


# --------------------------------------------------------------------------------------------------------
# Reporting


def fmt_number(value: Any, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table (also readable as plain text); numbers right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    numeric = [
        all(r[i][:1].isdigit() or r[i][:1] in "-+." for r in cells) and bool(cells)
        for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)]
        return "| " + " | ".join(parts) + " |"

    sep = "|" + "|".join(
        ("-" * (w + 1) + ":") if num else "-" * (w + 2) for w, num in zip(widths, numeric, strict=True)
    )
    return "\n".join([line(headers), sep + "|", *(line(r) for r in cells)])


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if not numerator or not denominator:
        return None
    return numerator / denominator


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def median_run(runs: Sequence[dict[str, Any]], key: str = "real_tokens_per_s") -> dict[str, Any]:
    """The run with the median ``key`` (lower middle for an even count): its other numbers stay consistent."""
    ordered = sorted(runs, key=lambda r: r[key])
    return ordered[(len(ordered) - 1) // 2]


def write_json(path: str | os.PathLike[str], payload: Any) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return p
