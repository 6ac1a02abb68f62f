"""Prompt rows a library makes instead of a file holding them: reasoning-gym's procedural tasks (offline)
and the tasks of a verifiers taskset.

``reasoning_gym:<task>`` as a data setting (``data.train: reasoning_gym:basic_arithmetic?size=200&seed=1``)
reads ``size`` rows (default 1000) of the task drawn from ``seed`` (default 0); every other query parameter
goes to the task's own config (``&max_digits=2``, values read as YAML). Each row holds ``prompt`` (the
question), ``answer``, and ``reasoning_gym``: the whole entry, which the bundled ``reasoning_gym`` reward
(:mod:`padless.rl.rewards`) scores with the task's own scorer. ``pip install 'padless[reasoning-gym]'``.

``verifiers:<module>:<name>`` (or ``verifiers:<file.py>:<name>``) names a verifiers ``Taskset`` or ``Env`` (a
multi-turn environment over its taskset), or a function or class that makes one without arguments: one row
per task, holding ``prompt`` (the task's prompt text) and ``verifiers`` (the spec, the task's position and
key), from which the bundled ``verifiers`` environment (:mod:`padless.rl.verifiers_env`) finds the task
again, plays it and scores the episode by its rubric.
``pip install 'padless[verifiers]'``.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import yaml

from padless.errors import DataError

PREFIX = "reasoning_gym:"
VERIFIERS = "verifiers:"


def _error(spec: str, problem: str, fix: str) -> DataError:
    return DataError(f"{spec}: {problem}; fix: {fix}", source=spec, reason="bad source")


def rows(spec: str) -> list[dict[str, Any]]:
    """The rows ``spec`` names, made now (the same spec makes the same rows)."""
    if spec.startswith(VERIFIERS):
        return [
            {"prompt": task.data.prompt_text, "verifiers": {"taskset": spec, "idx": i, "key": task.key}}
            for i, task in enumerate(verifiers_tasks(spec))
        ]
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


def verifiers_tasks(spec: str) -> tuple[Any, ...]:
    """The tasks of the verifiers taskset ``spec`` names, in its order (made once per process)."""
    return verifiers_source(spec)[2]


@functools.cache
def verifiers_source(spec: str) -> tuple[Any, Any, tuple[Any, ...]]:
    """What ``spec`` names: a verifiers ``Env`` (a multi-turn environment over its taskset) or a bare
    ``Taskset`` (None then), the taskset, and its tasks in order (made once per process)."""
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise _error(spec, "verifiers is not installed", "pip install 'padless[verifiers]'") from None
    target, sep, name = spec.removeprefix(VERIFIERS).rpartition(":")
    form = "write verifiers:<module>:<name> or verifiers:<file.py>:<name>"
    if not sep or not target or not name:
        raise _error(spec, "it names no taskset", form)
    try:
        if target.endswith(".py"):
            path = Path(target).resolve()
            loader = importlib.util.spec_from_file_location(f"padless_verifiers_{path.stem}", path)
            if loader is None or loader.loader is None or not path.is_file():
                raise ImportError(f"no Python file {path}")
            module = importlib.util.module_from_spec(loader)
            sys.modules[loader.name] = module  # verifiers reads its classes' modules (pydantic, typing)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
        made = getattr(module, name)
    except (ImportError, AttributeError, SyntaxError) as e:
        raise _error(spec, f"it cannot be loaded ({type(e).__name__}: {e})", form) from None
    kinds = (vf.Taskset, vf.Env)
    made = made if isinstance(made, kinds) else made() if callable(made) else made
    if not isinstance(made, kinds):
        problem = f"{name} is a {type(made).__name__}, not a verifiers Taskset or Env"
        raise _error(spec, problem, "name a Taskset or an Env, or a function or class that makes one")
    env, taskset = (made, made.taskset) if isinstance(made, vf.Env) else (None, made)
    if not taskset.bounded:
        raise _error(spec, "the taskset is infinite", "bound it (taskset.take(n)) where it is made")
    return env, taskset, tuple(taskset)
