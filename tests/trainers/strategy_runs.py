"""Runs several padless CLI runs one after another in one ``accelerate launch`` (process start-up is the
costly part on CPU), recording after each what the prepared model really was.

Usage: ``accelerate launch ... strategy_runs.py RUNS.json``, where RUNS.json is a list of
``{"argv": [...], "facts": "path.json"}``. Each run starts from accelerate's state as a fresh process
finds it (``padless.run.strategy.start_accelerator`` resets it; the process group stays).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from accelerate import PartialState

from padless import cli
from padless.run import loop


def main(spec: str) -> int:
    seen: dict[str, object] = {}
    verify = loop.verify_strategy

    def recording_verify(accelerator, model, strategy):
        param = next(model.parameters())
        seen.update(
            strategy=strategy,
            model_type=type(model).__name__,
            param_type=type(param).__name__,
            zero_stage=model.zero_optimization_stage() if hasattr(model, "zero_optimization_stage") else None,
            world=accelerator.num_processes,
        )
        return verify(accelerator, model, strategy)

    loop.verify_strategy = recording_verify
    runs = json.loads(Path(spec).read_text())
    cli.settle(sorted({run["argv"][0] for run in runs}))  # as the process of each run would settle
    for run in runs:
        seen.clear()
        code = cli.main(run["argv"])
        if code != 0:
            return code
        if PartialState().is_main_process:
            Path(run["facts"]).write_text(json.dumps(seen))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
