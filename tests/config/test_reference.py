"""The configuration reference the docs build renders: every key of every trainer, each with a description,
and a default that, written in a config file, is the trainer's default."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import yaml
from pydantic import Field

from padless.cli import TRAINERS
from padless.config.loading import ConfigModel, json_schema
from padless.config.reference import reference, undocumented

CONFIGS = {
    name: getattr(importlib.import_module(target.split(":")[0]), target.split(":")[1])
    for name, (target, *_) in TRAINERS.items()
}


@pytest.fixture(scope="module")
def page() -> str:
    return reference(CONFIGS)


def _schema_keys(schema: dict[str, Any], node: dict[str, Any], prefix: str = "") -> list[str]:
    """Every dotted key of a JSON Schema, sections and their keys, read from the schema alone."""
    keys = []
    for name, prop in node["properties"].items():
        refs = [p["$ref"] for p in (prop, *prop.get("anyOf", ())) if "$ref" in p]
        if prefix or not refs:
            keys.append(prefix + name)
        for ref in refs:
            keys += _schema_keys(schema, schema["$defs"][ref.rsplit("/", 1)[1]], f"{prefix}{name}.")
    return keys


def _rows(page: str, trainer: str) -> dict[str, list[str]]:
    """The table rows of one trainer's part of the page: key -> its cells."""
    part = page.split(f"## padless {trainer} {{#{trainer}}}")[1].split("\n## padless ")[0]
    rows = {}
    for line in part.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0].strip("`")] = cells
    return rows


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config's values by dotted key, sections and their keys."""
    out = {}
    for name, value in values.items():
        out[prefix + name] = value
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{name}."))
    return out


@pytest.mark.parametrize("trainer", list(CONFIGS))
def test_every_key_has_a_description(trainer):
    assert undocumented(CONFIGS[trainer]) == [], (
        "config keys without a description: give each field a docstring below it in padless/config/schema.py"
    )


def test_a_key_without_a_description_is_named():
    class Part(ConfigModel):
        """A section."""

        documented: int = 1
        """what it does"""
        silent: int = 2

    class Toy(ConfigModel):
        """A toy trainer."""

        part: Part = Field(default_factory=Part)

    assert undocumented(Toy) == ["part.silent"]
    Part.__doc__ = None
    assert undocumented(Toy) == ["part", "part.silent"]


@pytest.mark.parametrize("trainer", list(CONFIGS))
def test_the_reference_lists_every_key_with_its_default(trainer, page):
    cls = CONFIGS[trainer]
    rows = _rows(page, trainer)
    schema = json_schema(cls)
    assert sorted(rows) == sorted(_schema_keys(schema, schema))
    for key, default in _flat(cls().model_dump(mode="json")).items():
        if key in rows:  # top-level sections are headings, not rows; a mapping's items are no keys
            written = rows[key][3].strip("`")
            assert yaml.safe_load(written) == default, (key, written)
            assert rows[key][4], key


def test_bounds_and_per_trainer_defaults_are_shown(page):
    assert _rows(page, "grpo")["rollout.top_p"][2] == "&gt; 0, ≤ 1"
    assert _rows(page, "sft")["train.output_dir"][3] == "`runs/sft`"
    assert _rows(page, "grpo")["train.output_dir"][3] == "`runs/grpo`"
    # a description with markup characters is shown as written, not read as HTML
    assert "tiny:&lt;name&gt;" in _rows(page, "sft")["data.train"][4]
