"""MkDocs hooks: the configuration reference is rendered from the pydantic schemas at every build.

``docs/reference/config.md`` holds the hand-written part and a marker line; the marker is replaced by
:func:`padless.config.reference.reference` for every trainer the CLI offers, so the page cannot drift from
the code. The padless of this checkout is the one documented (its folder goes first on ``sys.path``).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

MARKER = "<!-- generated: the configuration reference -->"
PAGE = "reference/config.md"


def on_config(config, **kwargs):
    sys.path.insert(0, str(Path(config.config_file_path).resolve().parent))
    return config


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    from padless.cli import TRAINERS
    from padless.config.reference import reference

    if MARKER not in markdown:
        raise ValueError(f"docs/{PAGE} lost its marker line {MARKER!r}: the reference has nowhere to go")
    configs = {}
    for name, (target, *_) in TRAINERS.items():
        module, cls = target.split(":")
        configs[name] = getattr(importlib.import_module(module), cls)
    return markdown.replace(MARKER, reference(configs))
