"""Prompt rows a library makes instead of a file holding them: reasoning-gym's procedural tasks (offline).

``reasoning_gym:<task>`` as a data setting (``data.train: reasoning_gym:basic_arithmetic?size=200&seed=1``)
reads ``size`` rows (default 1000) of the task drawn from ``seed`` (default 0); every other query parameter
goes to the task's own config (``&max_digits=2``, values read as YAML). Each row holds ``prompt`` (the
question), ``answer``, and ``reasoning_gym``: the whole entry, which the bundled ``reasoning_gym`` reward
(:mod:`padless.rl.rewards`) scores with the task's own scorer. ``pip install 'padless[reasoning-gym]'``.
"""

from __future__ import annotations

import difflib
from typing import Any
from urllib.parse import unquote

import yaml

from padless.data.records import DataError

PREFIX = "reasoning_gym:"


def is_procedural(spec: Any) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def _error(spec: str, problem: str, fix: str) -> DataError:
    return DataError(f"{spec}: {problem}; fix: {fix}", source=spec, reason="bad source")


def rows(spec: str) -> list[dict[str, Any]]:
    """The rows ``spec`` names, made now (the same spec makes the same rows)."""
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise _error(spec, "reasoning-gym is not installed", "pip install 'padless[reasoning-gym]'") from None
    task, _, query = spec.removeprefix(PREFIX).partition("?")
    if task not in DATASETS:
        close = difflib.get_close_matches(task, list(DATASETS), n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        fix = f"{hint}name one of its {len(DATASETS)} tasks"
        raise _error(spec, f"reasoning-gym has no task {task!r}", fix)
    pairs = [part.partition("=") for part in query.split("&") if part]  # "+" stays "+" (operators=[+, -])
    options = {unquote(key): yaml.safe_load(unquote(value)) for key, _, value in pairs}
    options.setdefault("size", 1000)
    options.setdefault("seed", 0)
    try:
        dataset = reasoning_gym.create_dataset(task, **options)
    except (TypeError, ValueError, AssertionError) as e:  # an option the task's config does not take
        problem = f"reasoning-gym refused the options {options} ({e})"
        raise _error(spec, problem, "give the keys of the task's config") from None
    return [
        {"prompt": entry["question"], "answer": entry["answer"], "reasoning_gym": _plain(entry)}
        for entry in dataset
    ]


def _plain(value: Any) -> Any:
    """An entry as JSON holds it (tuples as lists), so it reads back the same from every path."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
