"""padless: padding-free training for Hugging Face causal language models.

The trainers of the command line are importable from here (``padless.SFT``, ``padless.GRPO``, ...; see
:mod:`padless.api`), loaded on first use so that ``import padless.config`` stays light.
"""

from __future__ import annotations

from typing import Any

API = ("SFT", "DPO", "RM", "KTO", "ORPO", "GRPO", "PPO", "DISTILL", "Trainer", "trainer", "PadlessError")


def __getattr__(name: str) -> Any:
    if name == "PadlessError":
        from padless.errors import PadlessError

        return PadlessError
    if name in API:
        from padless import api

        return getattr(api, name)
    raise AttributeError(f"module 'padless' has no attribute {name!r}")
