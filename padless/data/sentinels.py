"""What of an assistant message its trained tokens must render, found by rendering it with sentinels.

:func:`with_sentinels` lists the values of a message (:class:`Leaf`: each content part's text, the reasoning,
each tool call's name, argument keys and values) and gives a copy of the message with a unique sentinel in
place of each: rendering that copy shows where, and whether, the template writes each value (see
:mod:`padless.data.chat`). Only messages with more than a string content get here.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass
from typing import Any

from padless.data.records import REASONING_KEYS, call_function

# Stands in for one value of a message while a template renders it. Private-use characters: no template
# writes them, strips them or escapes them (transformers' tojson keeps non-ASCII as is).
SENTINEL = "\ue002{}\ue003"
NUMBER_SENTINEL = 987_650_000  # an int or float argument's stand-in (plus its number), kept numeric


@dataclass(frozen=True)
class Leaf:
    """One value of a message that its rendering must hold.

    ``path`` names it in the message (``tool_calls[0].function.name``); ``field`` is the message field it
    belongs to (``content``, ``tool_calls[0]``, ``reasoning_content``); ``sentinel`` stands in for it;
    ``writings`` are the texts that render it (the value as is, or escaped inside a JSON string).
    ``required``: an id (``tool_calls[0].id``) need not be rendered; it is followed to say what a template
    writes in place of a name.
    """

    path: str
    field: str
    kind: str  # "text" (content, parts), "reasoning", "thinking", "name", "arguments", "id"
    sentinel: str
    writings: tuple[str, ...]
    required: bool = True


def _writings(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value, json.dumps(value, ensure_ascii=False)[1:-1], json.dumps(value)[1:-1])
    return (json.dumps(value, ensure_ascii=False), str(value))


class _Sentinels:
    """Numbers the sentinels of one message."""

    def __init__(self) -> None:
        self.leaves: list[Leaf] = []

    def add(self, path: str, field: str, kind: str, value: Any, required: bool = True) -> Any:
        n = len(self.leaves)
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            stand_in: Any = NUMBER_SENTINEL + n + (0.25 if isinstance(value, float) else 0)
            text = str(stand_in)
        else:
            stand_in = text = SENTINEL.format(n)
        self.leaves.append(Leaf(path, field, kind, text, _writings(value), required))
        return stand_in

    def arguments(self, path: str, field: str, value: Any) -> Any:
        """Every key and every string or number of an arguments object; true, false and null stay (their
        key stands for them)."""
        if isinstance(value, dict):
            return {
                self.add(f"{path}.{k} (name)", field, "arguments", k): self.arguments(f"{path}.{k}", field, v)
                for k, v in value.items()
            }
        if isinstance(value, list):
            return [self.arguments(f"{path}[{k}]", field, v) for k, v in enumerate(value)]
        if isinstance(value, str) or (isinstance(value, numbers.Real) and not isinstance(value, bool)):
            return self.add(path, field, "arguments", value)
        return value


def with_sentinels(message: dict[str, Any], label: str) -> tuple[dict[str, Any], list[Leaf]]:
    """A copy of an assistant ``message`` (called ``label``) with a sentinel in place of every value its
    rendering must hold (a string content is proven by its text: it keeps it), and those values as
    :class:`Leaf` s."""
    s = _Sentinels()
    out = dict(message)
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            kind = part["type"]
            if kind in ("text", "thinking") and part[kind]:
                path = f"{label}.content[{k}]"
                part = {
                    **part,
                    kind: s.add(f"{path}.{kind}", path, kind if kind == "thinking" else "text", part[kind]),
                }
            parts.append(part)
        out["content"] = parts
    for key in REASONING_KEYS:
        if message.get(key):
            out[key] = s.add(f"{label}.{key}", f"{label}.{key}", "reasoning", message[key])
    calls = []
    for k, call in enumerate(message.get("tool_calls", [])):
        nested = isinstance(call.get("function"), dict)
        fn = call_function(call)
        field = f"{label}.tool_calls[{k}]"
        at = field + (".function" if nested else "")
        name = s.add(f"{at}.name", field, "name", fn["name"])
        new_fn = {**fn, "name": name}
        if "arguments" in fn:
            new_fn["arguments"] = s.arguments(f"{at}.arguments", field, fn["arguments"])
        new_call = {**call, "function": new_fn} if nested else new_fn
        ident = call.get("id")
        if isinstance(
            ident, str
        ):  # a template may write the name from an id that holds it (functions.NAME:0)
            new_call["id"] = (
                ident.replace(fn["name"], name)
                if fn["name"] in ident
                else s.add(f"{field}.id", field, "id", ident, required=False)
            )
        calls.append(new_call)
    if calls:
        out["tool_calls"] = calls
    return out, s.leaves
