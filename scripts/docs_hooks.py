"""MkDocs hooks: the reference pages that come from the code are rendered from it at every build.

``docs/reference/config.md`` and ``docs/reference/cli.md`` hold their hand-written part and a marker line;
the marker is replaced by the configuration reference of every trainer the CLI offers
(:func:`padless.config.reference.reference`) or by the help of every command, so neither page can drift
from the code. The padless of this checkout is the one documented (its folder goes first on ``sys.path``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import sys
from pathlib import Path

GENERATED = {
    "reference/config.md": "<!-- generated: the configuration reference -->",
    "reference/cli.md": "<!-- generated: the help of every command -->",
}


def on_config(config, **kwargs):
    sys.path.insert(0, str(Path(config.config_file_path).resolve().parent))
    return config


def on_page_markdown(markdown: str, page, config, files) -> str:
    marker = GENERATED.get(page.file.src_uri)
    if marker is None:
        return markdown
    if marker not in markdown:
        raise ValueError(
            f"docs/{page.file.src_uri} lost its marker line {marker!r}: the generated part has nowhere to go"
        )
    render = config_reference if page.file.src_uri == "reference/config.md" else command_help
    return markdown.replace(marker, render())


def config_reference() -> str:
    from padless.cli import TRAINERS
    from padless.config.reference import reference

    configs = {}
    for name, (target, *_) in TRAINERS.items():
        module, cls = target.split(":")
        configs[name] = getattr(importlib.import_module(module), cls)
    return reference(configs)


def _help(argv: list[str]) -> str:
    """What ``padless ARGV --help`` prints, at a fixed width."""
    from padless.cli import main

    out, width = io.StringIO(), os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main([*argv, "--help"])
    finally:
        os.environ.pop("COLUMNS") if width is None else os.environ.update(COLUMNS=width)
    return out.getvalue().rstrip()


def command_help() -> str:
    from padless.cli import build_parser

    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    names = [[], *([name] for name in commands.choices)]
    if "rm" in commands.choices:
        names.insert(names.index(["rm"]) + 1, ["rm", "score"])
    out = []
    for argv in names:
        out += [f"## padless {' '.join(argv)}".rstrip(), "", "```text", _help(argv), "```", ""]
    return "\n".join(out)
