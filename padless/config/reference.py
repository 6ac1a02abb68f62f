"""The configuration reference: every key of each trainer's config file with its type, bounds, default and
description, as Markdown.

The docs build renders it into ``docs/reference/config.md`` (``scripts/docs_hooks.py``), so the page is
made from the schemas each time and cannot drift from them. It reads what editors read (the JSON Schema of
:func:`padless.config.loading.json_schema`) for types and bounds, and the trainer's default config for the
defaults, so a section whose defaults differ per trainer (``train.output_dir``) shows each trainer's own.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, get_args

import yaml
from pydantic import BaseModel

from padless.config.loading import ConfigModel, json_schema

_BOUNDS = {"minimum": "≥", "exclusiveMinimum": ">", "maximum": "≤", "exclusiveMaximum": "<"}
_TYPES = {"integer": "int", "number": "float", "string": "str", "boolean": "bool", "null": "null"}


@dataclass(frozen=True)
class Key:
    """One line of the reference: a dotted key as written in YAML (``rollout.max_new_tokens``)."""

    name: str
    type: str
    bounds: str
    default: str
    description: str


def _section_class(annotation: Any) -> type[ConfigModel] | None:
    """The config section a field holds (``LoraSettings`` for ``LoraSettings | None``), if any."""
    for tp in (annotation, *get_args(annotation)):
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            return tp
    return None


def _docstring(cls: type) -> str:
    return cls.__dict__.get("__doc__") or ""


def _type(node: Mapping[str, Any]) -> str:
    if "enum" in node:
        return "one of " + ", ".join(map(_yaml, node["enum"]))
    if "anyOf" in node:
        return " or ".join(_type(n) for n in node["anyOf"])
    if "$ref" in node:
        return "section"
    kind = node.get("type")
    if kind == "array":
        return f"list of {_type(node.get('items', {}))}"
    if kind == "object":
        return "mapping"
    return _TYPES.get(kind, "any")


def _bounds(node: Mapping[str, Any]) -> str:
    own = [f"{sign} {node[k]:g}" for k, sign in _BOUNDS.items() if k in node]
    return ", ".join(own + [b for n in node.get("anyOf", ()) if (b := _bounds(n))])


def _yaml(value: Any) -> str:
    """A value as it is written in a config file (``null``, ``true``, ``[tensorboard, jsonl]``)."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000, allow_unicode=True)
    return text.removesuffix("...\n").strip()


def _prose(text: str) -> str:
    """A docstring as one line of Markdown (reST double backticks and roles become code)."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text).replace("``", "`")
    return " ".join(text.split())


def keys(cls: type[ConfigModel]) -> Iterator[tuple[str, type[ConfigModel], list[Key]]]:
    """Each top-level section of a trainer's config (name, class, its keys, nested sections flattened)."""
    schema = json_schema(cls)
    defaults = cls()

    def walk(section: type[ConfigModel], value: BaseModel, prefix: str) -> Iterator[Key]:
        properties = schema["$defs"][section.__name__]["properties"]
        for name, spec in section.model_fields.items():
            node, current, nested = properties[name], getattr(value, name), _section_class(spec.annotation)
            description = spec.description or (_docstring(nested) if nested else "")
            yield Key(prefix + name, _type(node), _bounds(node), _yaml(current), _prose(description))
            if nested is not None:
                yield from walk(nested, current if current is not None else nested(), f"{prefix}{name}.")

    for name, spec in cls.model_fields.items():
        section = _section_class(spec.annotation)
        assert section is not None, f"{cls.__name__}.{name} is not a section"
        yield name, section, list(walk(section, getattr(defaults, name), ""))


def undocumented(cls: type[ConfigModel]) -> list[str]:
    """The keys of a trainer's config with no description (a field docstring, or a section's docstring)."""
    described = {
        name: spec.description or _docstring(spec.annotation) for name, spec in cls.model_fields.items()
    }
    return [name for name, text in described.items() if not text] + [
        f"{section}.{key.name}" for section, _, found in keys(cls) for key in found if not key.description
    ]


def _cell(text: str) -> str:
    """Table-cell Markdown: pipes escaped, and ``<``, ``>``, ``&`` outside code spans shown as written."""
    parts = text.split("`")
    parts[::2] = [html.escape(part, quote=False) for part in parts[::2]]
    return "`".join(parts).replace("|", "\\|")


def reference(trainers: Mapping[str, type[ConfigModel]]) -> str:
    """The reference page's generated part: per trainer, per section, a table of every key."""
    out = []
    for trainer, cls in trainers.items():
        out += [f"## padless {trainer} {{#{trainer}}}", "", _prose(_docstring(cls)), ""]
        for section, section_cls, found in keys(cls):
            out += [f"### {section} {{#{trainer}-{section}}}", "", _prose(_docstring(section_cls)), ""]
            out += ["| key | type | bounds | default | description |", "|---|---|---|---|---|"]
            for key in found:
                cells = (f"`{section}.{key.name}`", key.type, key.bounds, f"`{key.default}`", key.description)
                out.append("| " + " | ".join(map(_cell, cells)) + " |")
            out.append("")
    return "\n".join(out)
