"""What can go wrong, sorted by who fixes it, and the one line the command line prints for it.

Input errors (a config key, a data row, a path, a model folder, a checkpoint, a run folder) are the user's
to fix and exit with 2; the message names the culprit and the fix. Anything else is a runtime fault (a
diverging run, a full disk, a bug) and exits with 1. ``--debug`` or ``PADLESS_DEBUG=1`` adds the
traceback; without it the user sees one message, never a Python traceback.
"""

from __future__ import annotations

import errno

USAGE = 2  # exit code: the input needs fixing
FAULT = 1  # exit code: the run failed while running
INTERRUPTED = 130  # exit code: Ctrl-C, as shells report SIGINT
DEBUG_HINT = "rerun with --debug (or PADLESS_DEBUG=1) for the traceback"


class InputError(ValueError):
    """Something the user gave cannot be used: a path, a model folder, a checkpoint, a run folder.

    The message says which one, what is wrong with it and how to fix it.
    """


class AttentionError(RuntimeError):
    """The requested attention is not available, or would not compute what was asked."""


class DivergenceError(RuntimeError):
    """Training produced a non-finite loss, gradient norm or weight; nothing was saved from that state."""


def is_input_error(error: BaseException) -> bool:
    """Config, data, path and backend problems: ``ValueError`` (ConfigError, DataError, InputError, ...),
    the attention backend asked for not running here, and files that are missing or not readable."""
    return isinstance(error, (ValueError, AttentionError, FileNotFoundError, PermissionError))


def exit_code(error: BaseException) -> int:
    if isinstance(error, KeyboardInterrupt):
        return INTERRUPTED
    return USAGE if is_input_error(error) else FAULT


def describe(error: BaseException) -> str:
    """One message for ``error``: its own text for input errors, cause and next step for faults."""
    if isinstance(error, KeyboardInterrupt):
        return (
            "interrupted (Ctrl-C); continue from the last checkpoint with train.resume_from_checkpoint=latest"
        )
    text = str(error).strip() or type(error).__name__
    if isinstance(error, (FileNotFoundError, PermissionError)) and error.filename:
        what = "no such file or directory" if isinstance(error, FileNotFoundError) else "permission denied"
        return f"{error.filename}: {what}; fix: check the path and its permissions"
    if is_input_error(error) or isinstance(error, DivergenceError):
        return text
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        where = f" writing {error.filename}" if error.filename else ""
        return (
            f"no space left on the device{where}; fix: free space, or use another disk for train.output_dir"
        )
    if isinstance(error, MemoryError) or "out of memory" in text.lower():
        return (
            f"out of memory ({type(error).__name__}: {text.splitlines()[0]}); fix: lower "
            "train.max_tokens_per_batch (and raise gradient_accumulation_steps to keep the step size), or "
            "enable model.gradient_checkpointing"
        )
    return f"unexpected {type(error).__name__}: {text}; {DEBUG_HINT}, and report it if this does not help"
