"""Chat messages as rows give them, checked: roles, content (a string or a list of parts), tool calls,
reasoning, and whether an assistant turn trains.

Fields follow the OpenAI / transformers message format: ``content`` is a string or a list of ``text`` /
``image`` / ``thinking`` parts; ``tool_calls`` holds ``{"type": "function", "function": {"name",
"arguments"}}`` calls (or ``{"name", "arguments"}``), arguments an object or a JSON string; reasoning is in
``reasoning_content``, ``reasoning`` or ``thinking``. A per-message ``loss`` / ``train`` boolean or a
``weight`` of 0 or 1 (the conventions of ms-swift and axolotl datasets) says whether an assistant turn is a
target; it is read here and never reaches the template.

:func:`with_sentinels` lists what of an assistant message its tokens must render (:class:`Leaf`) and gives a
copy of the message with a unique sentinel in place of each value: rendering that copy shows where, and
whether, the template writes each value (see :mod:`padless.data.chat`).
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass
from typing import Any

from padless.data.records import Row, type_name

ROLES = ("system", "user", "assistant", "tool")
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
TRAIN_FLAGS = ("loss", "train", "weight")
PART_TYPES = ("text", "image", "thinking")
# Stands in for one value of a message while a template renders it. Private-use characters: no template
# writes them, strips them or escapes them (transformers' tojson keeps non-ASCII as is).
SENTINEL = "\ue002{}\ue003"
NUMBER_SENTINEL = 987_650_000  # an int or float argument's stand-in (plus its number), kept numeric


def nonempty_str(row: Row, name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise row.error(name, f"must be a string, got {type_name(value)}", reason="wrong type")
    if not value.strip():
        raise row.error(name, "is empty; it must contain text", reason="empty content")
    return value


def check_parts(row: Row, where: str, content: list[Any]) -> None:
    """A list content holds text, image and thinking parts, and at least one of them."""
    if not content:
        raise row.error(
            where, "is an empty list; it must contain text or image parts", reason="empty content"
        )
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in PART_TYPES:
            raise row.error(
                f"{where}[{k}]",
                "must be a {'type': 'text' | 'image' | 'thinking', ...} part, got "
                + (repr(kind) if isinstance(part, dict) else type_name(part)),
                reason="wrong type",
            )
        if kind in ("text", "thinking") and not isinstance(part.get(kind), str):
            raise row.error(
                f"{where}[{k}].{kind}",
                f"must be a string, got {type_name(part.get(kind))}",
                reason="wrong type",
            )


def call_function(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call's function (``name``, ``arguments``): the OpenAI form nests it, the flat form is it."""
    return call["function"] if isinstance(call.get("function"), dict) else call


def _check_calls(row: Row, where: str, calls: Any) -> None:
    if not isinstance(calls, list):
        raise row.error(where, f"must be a list of tool calls, got {type_name(calls)}", reason="wrong type")
    for k, call in enumerate(calls):
        at = f"{where}[{k}]"
        if not isinstance(call, dict):
            raise row.error(
                at,
                f"must be a {{'type': 'function', 'function': {{'name', 'arguments'}}}} call, got "
                f"{type_name(call)}",
                reason="wrong type",
            )
        at += ".function" if isinstance(call.get("function"), dict) else ""
        fn = call_function(call)
        if not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise row.error(
                f"{at}.name", f"must be the function's name, got {fn.get('name')!r}", reason="bad tool call"
            )
        arguments = fn.get("arguments")
        if arguments is not None and not isinstance(arguments, (dict, str)):
            raise row.error(
                f"{at}.arguments",
                f"must be an object or a JSON string, got {type_name(arguments)}",
                reason="bad tool call",
            )


def train_flag(row: Row, where: str, message: dict[str, Any]) -> bool | None:
    """Whether the message's own flag makes it a target (``loss`` / ``train``, or ``weight`` 0 or 1); None
    when it has none. Flags that disagree, or a weight between 0 and 1, are refused."""
    said: dict[str, bool] = {}
    for key in TRAIN_FLAGS:
        value = message.get(key)
        if value is None:
            continue
        if key == "weight":
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or value not in (0, 1):
                raise row.error(
                    f"{where}.weight",
                    f"must be 0 (not trained) or 1 (trained), got {value!r}: padless trains a turn or "
                    "leaves it out, it does not scale its loss",
                    reason="bad train flag",
                    fix="Set it to 0 or 1, or set data.skip_bad_rows: true to skip the row.",
                )
            said[key] = value == 1
        elif not isinstance(value, bool):
            raise row.error(
                f"{where}.{key}", f"must be true or false, got {type_name(value)}", reason="bad train flag"
            )
        else:
            said[key] = value
    if len(set(said.values())) > 1:
        raise row.error(
            where,
            "has flags that disagree on whether the turn trains: "
            + ", ".join(f"{k}={message[k]!r}" for k in said),
            reason="bad train flag",
            fix="Keep one of them, or set data.skip_bad_rows: true to skip the row.",
        )
    return next(iter(said.values()), None)


def chat_messages(row: Row, name: str, value: Any, *, flags: bool = False) -> list[dict[str, Any]]:
    """Validated copy of a message list, with null-valued keys and empty ``tool_calls`` (schema filler from
    datasets) and the train flags dropped. ``flags``: whether a train flag may stand on the list's assistant
    messages (it is refused where nothing trains, or on other roles)."""
    if not isinstance(value, list) or not value:
        got = "an empty list" if isinstance(value, list) else type_name(value)
        raise row.error(name, f"must be a list of {{role, content}} dicts, got {got}", reason="wrong type")
    out = []
    for j, msg in enumerate(value):
        where = f"{name}[{j}]"
        if not isinstance(msg, dict):
            raise row.error(
                where, f"must be a {{role, content}} dict, got {type_name(msg)}", reason="wrong type"
            )
        msg = {k: v for k, v in msg.items() if v is not None and not (k == "tool_calls" and v == [])}
        role = msg.get("role")
        if role is None:
            raise row.error(
                f"{where}.role", f"is missing; it must be one of {', '.join(ROLES)}", reason="missing field"
            )
        if role not in ROLES:
            raise row.error(
                f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}", reason="unknown role"
            )
        if train_flag(row, where, msg) is not None:
            key = next(k for k in TRAIN_FLAGS if k in msg)
            if role != "assistant":
                raise row.error(
                    f"{where}.{key}",
                    f"says whether a turn trains, but messages of role {role!r} are never trained (only "
                    "assistant turns are targets)",
                    reason="train flag on a non-assistant message",
                    fix="Remove the flag, or set data.skip_bad_rows: true to skip the row.",
                )
            if not flags:
                raise row.error(
                    f"{where}.{key}",
                    f"says whether a turn trains, but '{name}' is never trained turn by turn, so it would "
                    "do nothing",
                    reason="train flag with no effect",
                    fix="Remove the flag (per-turn flags belong in SFT 'messages' rows), or set "
                    "data.skip_bad_rows: true to skip the row.",
                )
            msg = {k: v for k, v in msg.items() if k not in TRAIN_FLAGS}
        if "tool_calls" in msg:
            _check_calls(row, f"{where}.tool_calls", msg["tool_calls"])
        for key in REASONING_KEYS:
            if key in msg and not isinstance(msg[key], str):
                raise row.error(
                    f"{where}.{key}", f"must be a string, got {type_name(msg[key])}", reason="wrong type"
                )
        # An assistant turn that only calls tools may have no text; every other message must have some.
        if isinstance(msg.get("content"), list):
            check_parts(row, f"{where}.content", msg["content"])
        elif not (role == "assistant" and msg.get("tool_calls") and not msg.get("content")):
            nonempty_str(row, f"{where}.content", msg.get("content"))
        out.append(msg)
    return out


def turn_flags(row: Row, name: str, value: list[Any]) -> list[bool]:
    """Per message of a list :func:`chat_messages` accepted: whether it is a trained assistant turn (an
    assistant message trains unless its flag says otherwise)."""
    return [
        m.get("role") == "assistant" and train_flag(row, f"{name}[{j}]", m) is not False
        for j, m in enumerate(value)
    ]


def has_fields(message: dict[str, Any]) -> bool:
    """Whether a message carries more than a string content (parts, tool calls, reasoning)."""
    return not isinstance(message.get("content", ""), str) or any(
        k in message for k in ("tool_calls", *REASONING_KEYS)
    )


# -- what a turn must render ------------------------------------------------------------------------------


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
