"""The row -> loss count (issue 17): one SFT row runs through the padless modules the newcomer reads, and
no more than the count the structure reached (12; 15 before the last merges, 12 at 79f82f0)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "row_to_loss.py"
# measured with this script; a module that joins the path has to be argued for. 12: padless/forward/hybrid.py
# left again (stateful layers no wrapper keeps apart are refused where the model is loaded, proven or put in
# an engine, not by the per-forward guard)
MOST = 11  # 12 at 79f82f0 by this script; 11 once rows are checked for images in records.py


def test_one_sft_row_runs_through_the_expected_modules_and_no_more():
    spec = importlib.util.spec_from_file_location("row_to_loss", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    modules = script.measure()
    # the row's own path: read, rendered, tokenized, packed, through the engine and its kernel, to the loss
    assert {
        "padless/data/records.py",
        "padless/data/chat.py",
        "padless/data/sft.py",
        "padless/data/tokenized.py",
        "padless/forward/packing.py",
        "padless/forward/engine.py",
        "padless/forward/varlen.py",
        "padless/losses.py",
        "padless/trainers/sft.py",
    } <= set(modules)
    assert "padless/data/cache.py" not in modules  # the cache decides whether to build, not what a row is
    assert len(modules) <= MOST, modules
