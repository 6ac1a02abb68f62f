"""Every benchmark's ``--quick`` mode runs to its report: a benchmark nothing runs rots (issue 22: the GRPO
one crashed unnoticed after the RL refactor)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# benchmarks whose --quick run a test of their own already checks more closely (not run twice)
OWN_TEST = {
    "sp_memory.py": "tests/benchmarks/test_sp_memory.py",
    "vllm_rollout.py": "tests/rl/test_vllm_engine.py",
    "row_to_loss.py": "tests/benchmarks/test_row_to_loss.py",
}
# benchmarks whose --quick another benchmark's --quick runs whole (not run twice): the GPU run's smoke runs
# the tree-packing benchmark's
RUN_BY = {"tree_packing.py": "gpu.py"}
SCRIPTS = sorted(
    p.name
    for p in (ROOT / "benchmarks").glob("*.py")
    if p.name != "common.py" and p.name not in OWN_TEST and p.name not in RUN_BY
)
# the trainer benchmarks (benchmarks/common.py options): one timed step and no warm-up runs every contender's
# code to its table; the warm-up and the second step of --quick run the same code again
ONE_STEP = ("--warmup", "0", "--steps", "1")
# contenders the smoke runs where a benchmark has variants one setting apart (the setting's code is tested in
# the suite: staleness in tests/trainers/test_rl.py, per-prompt generate calls in tests/rl/test_generate.py,
# padded DPO in tests/trainers/test_dpo_rm.py, padded SFT in tests/trainers/test_sft.py and test_vision.py);
# the benchmark's own code for each is shared with these. sft_throughput's padless-padded is the function
# hybrid_packing's smoke runs; its trl-padded is trl-padding-free's with padding_free=False.
SMOKE_CONTENDERS = {
    "grpo_throughput.py": ("--contenders", "padless,trl"),
    "dpo_throughput.py": ("--contenders", "padless-packed,trl"),
    "sft_throughput.py": ("--contenders", "padless-packed,trl-padding-free,dense-ideal"),
    "vlm_sft_throughput.py": ("--contenders", "padless-packed,trl-padded"),
}
TRAINERS = {
    "sft_throughput.py",
    "dpo_throughput.py",
    "grpo_throughput.py",
    "vlm_sft_throughput.py",
    "hybrid_packing.py",
}


def test_every_benchmark_is_found():
    assert {"grpo_throughput.py", "sft_throughput.py", "chat_masks.py"} <= set(SCRIPTS)
    for script in TRAINERS:  # each takes the shared --warmup / --steps options
        assert "parse_benchmark_args" in (ROOT / "benchmarks" / script).read_text(), script
    for script, test in OWN_TEST.items():  # each one left out here is run where it says
        assert "benchmarks" in (ROOT / test).read_text() and script in (ROOT / test).read_text(), script
    for script, runner in RUN_BY.items():
        assert f"{script.removesuffix('.py')}.main(" in (ROOT / "benchmarks" / runner).read_text(), script


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_quick_mode_runs(script, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    steps = (*ONE_STEP, *SMOKE_CONTENDERS.get(script, ())) if script in TRAINERS else ()
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick", *steps],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,  # minutes when idle; a loaded 2-core machine is many times slower
    )
    assert done.returncode == 0, f"{script} --quick failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    # a result table: markdown ("| ... |") or plain columns of side-by-side ratios ("0.59x")
    table = "|" in done.stdout or re.search(r"\d\.\d+x\b", done.stdout)
    assert table, f"{script} --quick printed no result table:\n{done.stdout[-2000:]}"
