"""The row -> loss count (issue 17): one SFT row runs through the padless modules the newcomer reads, and
no more than the count the structure reached (12; 15 before the last merges, 12 at 79f82f0); and the whole
command's count (issue 29), from its YAML to its first loss reported: for the work c4a7570 did, below its
count then."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "row_to_loss.py"
# measured with this script; a module that joins the path has to be argued for. 12: padless/forward/hybrid.py
# left again (stateful layers no wrapper keeps apart are refused where the model is loaded, proven or put in
# an engine, not by the per-forward guard)
MOST = 11  # 12 at 79f82f0 by this script; 11 once rows are checked for images in records.py
# `padless sft examples/sft_tiny.yaml train.max_steps=1`, YAML -> first loss reported, by this script: 34 at
# c4a7570 (measured in a worktree of that commit), 39 on main just before issue 29's third part landed
# (6ea78f2: the Python API, the objects it hands over, tree packing and the MoE router loss had joined the
# path). 37 once a text run no longer builds an image side, a run without sequence parallelism no group, and
# the divergence advice is worded only when a run diverges; less the four modules of features c4a7570 did
# not have, 33. 36 once SFT runs tree rows only where asked (its examples share no prompt by construction).
# 33 once the run folder's manifest joined the run folder (run/rundir.py), and the round-off bound and the
# proof reused within a process joined the probe that applies them (proof/probe.py).
BEFORE_THE_WINGS = 34
RUN_MOST = 33
SINCE = {  # modules of features that joined the path after c4a7570
    "padless/api.py",
    "padless/data/given.py",
    "padless/forward/routers.py",
}


def _script():
    spec = importlib.util.spec_from_file_location("row_to_loss", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_one_sft_row_runs_through_the_expected_modules_and_no_more():
    modules = _script().measure()
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


@pytest.mark.slow
def test_the_whole_command_runs_through_fewer_modules_than_before_the_wings():
    modules = _script().measure_run()
    # from the command line and the YAML, through the session, the proven model and the data, to the loop
    assert {
        "padless/cli.py",
        "padless/config/loading.py",
        "padless/run/session.py",
        "padless/proof/load.py",
        "padless/proof/probe.py",
        "padless/data/tokenized.py",
        "padless/forward/engine.py",
        "padless/run/loop.py",
        "padless/run/reporting.py",
        "padless/trainers/sft.py",
    } <= set(modules)
    assert "padless/data/images.py" not in modules  # a text model's run builds no image side
    assert "padless/forward/sequence_parallel.py" not in modules  # nor, without sequence parallelism, a group
    assert "padless/errors.py" not in modules  # a run that does not diverge words no advice
    assert "padless/forward/tree.py" not in modules  # SFT shares no prompt: no tree rows unless asked
    assert len(modules) <= RUN_MOST, modules
    assert len(set(modules) - SINCE) < BEFORE_THE_WINGS, modules  # the same work as at c4a7570
