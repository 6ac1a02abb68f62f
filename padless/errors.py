"""What can go wrong, sorted by who fixes it, and the one line the command line prints for it.

Input errors (a config key, a data row, a path, a model folder, a checkpoint, a run folder) are the user's
to fix and exit with 2; the message names the culprit and the fix. Anything else is a runtime fault (a
diverging run, a full disk, a bug) and exits with 1. ``--debug`` or ``PADLESS_DEBUG=1`` adds the
traceback; without it the user sees one message, never a Python traceback.
"""

from __future__ import annotations

USAGE = 2  # exit code: the input needs fixing
FAULT = 1  # exit code: the run failed while running
INTERRUPTED = 130  # exit code: Ctrl-C, as shells report SIGINT
TERMINATED = 143  # exit code: SIGTERM (128 + 15)
DEBUG_HINT = "rerun with --debug (or PADLESS_DEBUG=1) for the traceback"
OUTSIDE_A_RUN = object()  # an interruption outside the training loop (no checkpoint known): no advice


class InputError(ValueError):
    """Something the user gave cannot be used: a path, a model folder, a checkpoint, a run folder.

    The message says which one, what is wrong with it and how to fix it.
    """


class DataError(ValueError):
    """A problem with the data itself; the message says where it is and how to fix it.

    ``reason`` is a short, stable label (e.g. ``"too long"``) used to count skipped rows by cause.
    """

    def __init__(
        self,
        message: str,
        *,
        source: str | None = None,
        index: int | None = None,
        field: str | None = None,
        reason: str = "bad row",
    ) -> None:
        super().__init__(message)
        self.source = source
        self.index = index
        self.field = field
        self.reason = reason


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived (a scheduler or ``kill`` ended the run): unwinds like Ctrl-C, exits with 143."""


class UserCodeError(RuntimeError):
    """A function the user wrote (a reward function, an environment, a callback) failed or returned
    something unusable; the message names the function and the step."""


class UserExit(Exception):
    """User code called ``sys.exit()`` or raised ``KeyboardInterrupt`` itself: at the boundary of that code
    this is an error like any other it raises, never the end of the command (see
    :func:`padless.run.interrupts.bounded`)."""


class AttentionError(RuntimeError):
    """The requested attention is not available, or would not compute what was asked."""


class DivergenceError(RuntimeError):
    """Training produced a non-finite loss, gradient norm or weight; nothing was saved from that state."""


DIVERGENCE_FIX = (
    "lower train.learning_rate (or raise warmup), keep train.max_grad_norm > 0 to clip gradients, check the "
    "data of that step, or set train.on_nonfinite=skip to drop such steps and count them"
)


def divergence_fix(float16: bool) -> str:
    """The fix of a divergence: float16 weights overflow first (their range, not the step size), so that
    advice comes first for them."""
    if not float16:
        return DIVERGENCE_FIX
    return (
        "the model trains in float16, whose range ends at 65504 and overflows long before the learning rate "
        "matters: set model.dtype to bfloat16, or float32 (exact; the default on CPU); otherwise "
        + DIVERGENCE_FIX
    )


class PadlessError(Exception):
    """What the Python API (:mod:`padless.api`) raises: the one line the command line prints
    (``message``), who fixes it (``category``: ``input``, exit code 2, or ``fault``, 1) and the command
    line's ``exit_code``. The original error is the ``__cause__``."""

    def __init__(self, message: str, category: str, exit_code: int) -> None:
        super().__init__(message)
        self.message, self.category, self.exit_code = message, category, exit_code

    @classmethod
    def of(cls, error: BaseException) -> PadlessError:
        code = exit_code(error)
        return cls(describe(error), "input" if code == USAGE else "fault", code)


def is_input_error(error: BaseException) -> bool:
    """Config, data, path and backend problems: ``ValueError`` (ConfigError, DataError, InputError, ...),
    the attention backend asked for not running here, and files that are missing or not readable."""
    from padless.faults import FileFault

    if isinstance(error, FileFault):
        return error.code == USAGE
    return isinstance(error, (ValueError, AttentionError, FileNotFoundError, PermissionError))


def exit_code(error: BaseException) -> int:
    from padless.faults import FileFault, translate

    if isinstance(error, PadlessError):
        return error.exit_code
    if isinstance(error, Terminated):
        return TERMINATED
    if isinstance(error, KeyboardInterrupt):
        return INTERRUPTED
    fault = error if isinstance(error, FileFault) else translate(error, "running")
    if fault is not None:
        return fault.code
    return USAGE if is_input_error(error) else FAULT


def describe(error: BaseException) -> str:
    """One message for ``error``: its own text for input errors, cause and next step for faults."""
    from padless.faults import translate

    if isinstance(error, PadlessError):
        return error.message
    if isinstance(error, KeyboardInterrupt):
        how = "terminated (SIGTERM)" if isinstance(error, Terminated) else "interrupted (Ctrl-C)"
        latest = getattr(error, "checkpoint", OUTSIDE_A_RUN)  # set by the training loop from its run folder
        if latest is OUTSIDE_A_RUN:
            return how
        if latest is None:
            return f"{how} before any checkpoint was written: nothing to resume; run the command again"
        return f"{how}; continue from {latest} with train.resume_from_checkpoint=latest"
    text = str(error).strip() or type(error).__name__
    own = is_input_error(error) or isinstance(error, (DivergenceError, UserCodeError))
    if own and not (isinstance(error, OSError) and error.errno):
        return text
    fault = translate(error, "running")  # a file error no call site named: its category, path and fix
    if fault is not None:
        return str(fault)
    if isinstance(error, MemoryError) or "out of memory" in text.lower():
        return (
            f"out of memory ({type(error).__name__}: {text.splitlines()[0]}); fix: lower "
            "train.max_tokens_per_batch (and raise gradient_accumulation_steps to keep the step size), or "
            "enable model.gradient_checkpointing"
        )
    return f"unexpected {type(error).__name__}: {text}; {DEBUG_HINT}, and report it if this does not help"
