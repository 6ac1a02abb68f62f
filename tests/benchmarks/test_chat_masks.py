"""The chat-mask benchmark runs (``--quick``): its three contenders agree on every row (it asserts so) and
one render per row serves the chats that prefix rendering renders 2k+1 times."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "chat_masks.py"


def test_quick_run_renders_once_per_row():
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])}
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = re.findall(r"^\|\s+(\d+) \|\s+20 \|[^|]+\|\s+([\d.]+) \|\s+([\d.]+) \|", done.stdout, re.M)
    assert [int(k) for k, _, _ in rows] == [1, 4]
    for k, prefixes, layout in rows:  # 20 rows; the shape's 2k+1 renders and the tail probe's 2 once
        assert float(prefixes) >= 2 * int(k) + 1
        assert float(layout) == round((20 + 2 * int(k) + 3) / 20, 2)
