"""Objects handed to padless from Python (:mod:`padless.api`): data and callables under the names a config
carries.

A config is text (it is saved in the run folder and read back at resume), so an in-memory data set, a list
of rows, a reward function, a tool or an environment class handed to the API is registered here for the
length of the run under a name of the form ``python:<name>`` (``python:data.train``, ``python:my_reward``),
and that name goes into the config. The places that read such settings (data sources, reward functions,
tools, environments) look the name up here, so an object takes exactly the path its file or
``module:function`` spec would.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

from padless.errors import InputError

PREFIX = "python:"
_objects: dict[str, Any] = {}


def is_given(spec: Any) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def lookup(spec: str, setting: str) -> Any:
    """The object registered under ``spec``; one that is not (a config saved by an API run, started from
    a file) is an input error naming ``setting``."""
    name = spec.removeprefix(PREFIX)
    if name not in _objects:
        raise InputError(
            f"{setting} {spec!r} names an object handed to padless.api in Python, and this process has none "
            f"by that name (a config saved by an API run, started again from the file?); fix: run it "
            "through padless.api with the same object, or point the setting at a file or module:function"
        )
    return _objects[name]


def register(obj: Any, key: str, objects: dict[str, Any]) -> str:
    """Put ``obj`` in ``objects`` and return its name in configs: a callable's own name (metric and tool
    names read it), anything else the config key it is set at; a second object with a name already taken
    gets ``_2``, ``_3``..."""
    own = getattr(obj, "__name__", None) if callable(obj) else None
    base = re.sub(r"[^\w.]+", "_", own or key).strip("_") or "object"
    name, k = base, 1
    while name in objects and objects[name] is not obj:
        k += 1
        name = f"{base}_{k}"
    objects[name] = obj
    return PREFIX + name


@contextlib.contextmanager
def serving(objects: dict[str, Any]) -> Iterator[None]:
    """``objects`` (from :func:`register`) can be looked up while the run inside runs."""
    before = dict(_objects)
    _objects.update(objects)
    try:
        yield
    finally:
        _objects.clear()
        _objects.update(before)
