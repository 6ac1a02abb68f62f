"""The README stays a front page (the documentation is the site built from docs/, `make docs`), and what it
links to exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_stays_a_front_page():
    lines = len(README.splitlines())
    assert lines <= 200, f"README.md has {lines} lines: move what you added into its page under docs/"


def test_readme_links_resolve():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if "://" not in link]
    assert local, "README links to no docs page"
    assert [link for link in local if not (ROOT / link).exists()] == []
