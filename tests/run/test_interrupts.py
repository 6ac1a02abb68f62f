"""Signals against user code: ``sys.exit()`` or a ``KeyboardInterrupt`` raised by a tool, an environment or a
reward function is an error at that code's boundary; a real Ctrl-C arriving while it runs still interrupts."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from padless.errors import UserExit
from padless.run.interrupts import bounded, handled


def leave() -> None:
    sys.exit(2)


def interrupt() -> None:
    raise KeyboardInterrupt


def ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)  # the handler raises in this frame


def test_user_codes_own_exit_is_an_error_and_a_real_signal_passes_through() -> None:
    with handled():
        with pytest.raises(UserExit, match=r"^called sys.exit\(2\)$"):
            bounded(leave)
        with pytest.raises(UserExit, match=r"^raised KeyboardInterrupt$"):
            bounded(interrupt)
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            bounded(ctrl_c)
        assert time.monotonic() - started < 4
    # without padless's handlers (the Python API) no signal is recorded: every KeyboardInterrupt is one
    with pytest.raises(KeyboardInterrupt):
        bounded(interrupt)
    with pytest.raises(UserExit):
        bounded(leave)
