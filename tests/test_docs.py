"""The README stays a front page (the documentation is the site built from docs/, `make docs`), and what it
links to exists."""

from __future__ import annotations

import re
from pathlib import Path

from padless import faults

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


def test_every_fault_category_is_in_the_error_reference():
    """docs/reference/errors.md's table names what each category says, with its exit code."""
    page = (ROOT / "docs" / "reference" / "errors.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| ")]
    for happened, _, code in faults._CATEGORIES.values():
        row = next((r for r in rows if happened in r), None)
        assert row is not None and f"| {code} |" in row, happened
    assert any("corrupt or truncated file" in r and f"| {faults.USAGE} |" in r for r in rows)


def test_the_architecture_page_names_every_wing():
    page = (ROOT / "docs" / "development" / "architecture.md").read_text()
    wings = sorted(p.name for p in (ROOT / "padless").iterdir() if p.is_dir() and any(p.glob("*.py")))
    assert len(wings) > 5
    assert [w for w in wings if f"`padless/{w}/`" not in page] == []
