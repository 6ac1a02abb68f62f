"""Ctrl-C and SIGTERM end a command the same way at any phase: exit 130 / 143, one line, nothing left.

While a command runs, SIGTERM raises :class:`~padless.errors.Terminated` (a ``KeyboardInterrupt``) in the
main thread, so it unwinds like Ctrl-C: ``finally`` blocks remove temporary folders (a cache being built,
a checkpoint being written), worker pools are terminated, and the run folder's lock is released. Which
signal arrived is remembered, because cleanup code in libraries can replace the exception on its way
out (``datasets`` collects its workers' results and raises a ``TimeoutError`` instead): the command
still reports the interruption.

A checkpoint being written is finished first (:func:`deferred`): the signal is held until the write
ends, then raised, so the trained steps it saves are not lost; a second signal stops the write at once
(its temporary folder is removed, earlier checkpoints stay as they were).

Processes forked from the command (tokenizing workers) get the default dispositions back: they die on
SIGTERM at once, as they always did (a Python handler would wait for their main thread to run Python
again, which a worker busy in native code never does), and ignore SIGINT, so Ctrl-C in a terminal does
not make each of them print a traceback; the command ends them.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from padless.errors import Terminated, UserExit

T = TypeVar("T")

_arrived: list[KeyboardInterrupt] = []  # the interruption of the command running now, if any
_held: list[KeyboardInterrupt] = []  # one that arrived inside a deferred() block, raised at its end
_deferring = [0]  # depth of deferred() blocks open now
_forks_reset = False
_active = [False]  # whether this command's handlers are installed (then every real signal is recorded)


def _in_child() -> None:
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _handler(owner: int) -> Any:
    def handle(signum: int, frame: Any) -> None:
        if os.getpid() != owner:  # a child that kept the handler: end as the signal always did
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        error = Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
        _arrived.append(error)
        if _deferring[0] and not _held:  # the first one waits for the block; a second one ends it
            _held.append(error)
            return
        raise error

    return handle


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """Install the handlers for the command's duration (a no-op off the main thread)."""
    global _forks_reset
    _arrived.clear()
    _held.clear()
    handle = _handler(os.getpid())
    try:
        previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT)}
    except ValueError:  # not the main thread: signals cannot be handled here
        previous = {}
    if previous and not _forks_reset:
        os.register_at_fork(after_in_child=_in_child)
        _forks_reset = True
    _active[0] = bool(previous)
    try:
        yield
    finally:
        _active[0] = False
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold Ctrl-C / SIGTERM until the block ends, then raise it (a checkpoint being written is finished,
    not thrown away); a second signal inside the block raises at once."""
    _deferring[0] += 1
    try:
        yield
    finally:
        _deferring[0] -= 1
    if not _deferring[0] and _held:
        raise _held.pop()


def take_held() -> KeyboardInterrupt | None:
    """The signal a :func:`deferred` block holds, taken out of it: its caller raises it where it chooses."""
    return _held.pop() if _held else None


def interruption(error: BaseException) -> BaseException:
    """The interruption that arrived during the command, else ``error`` itself."""
    return _arrived[0] if _arrived else error


def from_signal(error: BaseException) -> bool:
    """Whether ``error`` is an interruption this command received (Ctrl-C, SIGTERM) rather than one user code
    raised itself: with the handlers installed every signal is recorded as it arrives; without them (the
    Python API) every ``KeyboardInterrupt`` counts as one."""
    return isinstance(error, KeyboardInterrupt) and (not _active[0] or bool(_arrived))


def bounded(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call user code (a tool, an environment, a reward function): ``sys.exit()`` or a ``KeyboardInterrupt``
    of its own comes out as :class:`~padless.errors.UserExit`, an ``Exception`` its caller handles like any
    other; a real interruption passes through."""
    try:
        return fn(*args, **kwargs)
    except SystemExit as e:
        raise UserExit(f"called sys.exit({e.code!r})") from None
    except KeyboardInterrupt as e:
        if from_signal(e):
            raise
        raise UserExit("raised KeyboardInterrupt") from None
