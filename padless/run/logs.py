"""Logging: what padless decided and adjusted, on the console and in ``<output_dir>/log.txt``.

Everything padless says goes through the ``padless`` logger. Only the main process writes (other ranks
report errors only), so an 8-process run prints each line once. The console handler is added only when
nobody configured logging already (a library user's root handler keeps receiving the records instead),
and each run replaces the previous run's file handler, so runs in one process never write into each
other's logs.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

LEVELS = ("debug", "info", "warning", "error")
LOG_FILE = "log.txt"
_ROOT = "padless"
_CONSOLE_FORMAT = "padless %(levelname)s: %(message)s"
_FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _Handler(logging.Handler):
    """Marks handlers padless installed, so they can be found and replaced."""


class _ConsoleHandler(logging.StreamHandler, _Handler):
    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr  # follow redirections (pytest's capsys, contextlib.redirect_stderr)
        super().emit(record)


class _FileHandler(logging.FileHandler, _Handler):
    pass


def _level(name: str | None) -> int:
    name = (name or os.environ.get("PADLESS_LOG_LEVEL") or "info").lower()
    if name not in LEVELS:
        raise ValueError(f"log level {name!r}: choose one of {', '.join(LEVELS)} (PADLESS_LOG_LEVEL)")
    return getattr(logging, name.upper())


def _replace(logger: logging.Logger, kind: type[logging.Handler], new: logging.Handler | None) -> None:
    for handler in [h for h in logger.handlers if isinstance(h, kind)]:
        logger.removeHandler(handler)
        handler.close()
    if new is not None:
        logger.addHandler(new)


def setup_logging(level: str | None = None, main_process: bool = True) -> logging.Logger:
    """The ``padless`` logger at ``level`` (default ``PADLESS_LOG_LEVEL`` or info) with a console handler
    when the root logger has none; errors only on processes other than the main one."""
    logger = logging.getLogger(_ROOT)
    logger.setLevel(_level(level) if main_process else logging.ERROR)
    has_root_handler = any(not isinstance(h, _Handler) for h in logging.getLogger().handlers)
    console = None if has_root_handler else _ConsoleHandler()
    if console is not None:
        console.setFormatter(logging.Formatter(_CONSOLE_FORMAT))
    _replace(logger, _ConsoleHandler, console)
    return logger


def write_to(path: Path | None) -> None:
    """Append the ``padless`` logger's records to ``path`` too, replacing any earlier run's file; ``None``
    closes it. The run's own file, ``<output_dir>/log.txt``, is opened by
    :func:`padless.run.rundir.log_to_file`."""
    logger = logging.getLogger(_ROOT)
    if path is None:
        _replace(logger, _FileHandler, None)
        return
    from padless.faults import doing

    with doing("opening the run's log file", path, setting="train.output_dir"):
        handler = _FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(_FILE_FORMAT))
    _replace(logger, _FileHandler, handler)


def log_failure(message: str) -> None:
    """Write the message a run ended with into its ``log.txt`` (the console already shows it)."""
    logger = logging.getLogger(_ROOT)
    record = logger.makeRecord(_ROOT, logging.ERROR, __file__, 0, message, None, None)
    for handler in logger.handlers:
        if isinstance(handler, _FileHandler):
            handler.handle(record)


def describe_run(accelerator: Any, model: Any, name: str, dtype_setting: str) -> str:
    """One line that says what a run runs on: backend and the kernel the load-time probe proved, precision,
    engine and world size."""
    probe = getattr(model, "padless_probe", None) or {}
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    kernel = (
        (
            f"kernel {probe['kernel']} (proved by the load-time probe: {probe['calls']} calls; "
            if probe.get("kernel")
            else "no attention layer (proved by the load-time probe: "  # a state-space model
        )
        + "packed through "
        f"padless's head vs its own forward alone, max |delta log-prob| {probe['max_delta_logps']:.1e}"
        + (
            f"; in float32 on the same weights, after the {dtype} probe differed: {probe['float32_reprobe']}"
            if "float32_reprobe" in probe
            else f"; in float32 on the same weights {probe['float32_probe']}"
            if "float32_probe" in probe
            else ""
        )
        + (
            "; reused: the same model and code were proven earlier in this process"
            if probe.get("reused")
            else ""
        )
        + "".join(
            f"; probed with {key} {probe_value} instead of {value}, so that its sequences cross it"
            for key, (value, probe_value) in probe.get("spans_cut", {}).items()
        )
        + (
            f"; tree rows (shared prefixes computed once) vs each sequence alone, max |delta log-prob| "
            f"{probe['tree']['max_delta_logps']:.1e}"
            if "tree" in probe
            else ""
        )
        + ")"
        if probe
        else "kernel not probed"
    )
    precision = f"{dtype}" + (
        f" (dtype auto on {accelerator.device.type})" if dtype_setting == "auto" else ""
    )
    if accelerator.mixed_precision != "no":
        precision += f", mixed precision {accelerator.mixed_precision}"
    backend = probe.get("backend", getattr(model, "padless_attention", "?"))
    return (
        f"model {name}: {params / 1e6:.1f}M parameters, {trainable / 1e6:.1f}M trainable; attention "
        f"{backend}, {kernel}; precision {precision}; engine {_engine(accelerator)}, "
        f"world size {accelerator.num_processes}, device {accelerator.device}"
    )


def _engine(accelerator: Any) -> str:
    kind = accelerator.distributed_type.value
    if kind == "DEEPSPEED":
        return f"DeepSpeed ZeRO-{accelerator.state.deepspeed_plugin.zero_stage}"
    names = {"NO": "single process", "MULTI_CPU": "DDP on CPU processes", "MULTI_GPU": "DDP"}
    return f"{names.get(kind, kind)} ({kind})"
