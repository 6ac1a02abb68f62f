"""How many padless modules a newcomer reads to follow one SFT row from data to loss (issue 17), and to
follow the whole command from its YAML to the first loss it reports (issue 29).

The count is measured, not read off a drawing: the code of one SFT step runs under ``sys.settrace`` and
every padless module in which a line of code runs is recorded. What is traced is exactly the path of one
row, in the order a newcomer follows it:

1. ``load_set``: the row is read from its jsonl file, rendered, tokenized and stored (the data cache,
   ``padless/data/cache.py``, is left out of the count: it decides whether to build, not what a row becomes);
2. the SFT recipe plans the micro-batch (``plan``) and computes its loss (``loss``): packing, the engine's
   forward through the model's attention, the head and the loss weights.

Loading the model and tokenizer (setup, not the row's path) runs before tracing starts. The script uses only
names that exist since 79f82f0 (``SFTLayout``, ``load_set``, ``SFTRecipe``, ``ModelEngine``; ``SFTLayout`` and
the modules that moved into wings at 62703fd are looked up where they sit), so the same command counts any
commit of the project from there on::

The second count is the whole command: from reading the YAML to the first loss reported, the modules in
which a function runs while ``padless sft examples/sft_tiny.yaml train.max_steps=1`` (through the CLI's
``main``, a fresh output folder and data cache) goes from its arguments to its first report (the first call
of ``log`` in ``reporting.py``, where the reporter sits at every commit since c4a7570). Modules are imported
before tracing starts, and module bodies run by a lazy import are not counted: what counts is code a
newcomer follows, not code that loads::

    python benchmarks/row_to_loss.py            # the modules of both counts, one a line, and the counts
    python benchmarks/row_to_loss.py --quick    # the same (it is one step of the tiny model)
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
import threading
from pathlib import Path

EXCLUDED = ("padless/data/cache.py",)  # the cache decides whether to build, not what the row becomes


def _recorder(root: Path, seen: set[str]):
    """A trace function recording the padless files that run (the call event of each frame)."""
    prefix = str(root / "padless") + "/"

    def trace(frame, event, arg):
        name = frame.f_code.co_filename
        if name.startswith(prefix):
            seen.add(str(Path(name).relative_to(root)))
        return None  # the call event names the file: no line events needed

    return trace


def _traced(fn, root: Path, seen: set[str]):
    """``fn()`` with every padless file whose code runs in it (any thread) added to ``seen``."""
    trace = _recorder(root, seen)
    sys.settrace(trace)
    threading.settrace(trace)
    try:
        return fn()
    finally:
        sys.settrace(None)
        threading.settrace(None)


def measure() -> list[str]:
    """The padless modules whose code runs on one SFT row, from its file to its loss."""
    import torch

    import padless
    from padless.data.tokenized import load_set

    try:
        from padless.data.sft import SFTLayout
    except ImportError:  # before the layouts sat beside their tasks
        from padless.data.tokenized import SFTLayout
    try:
        from padless.config.schema import TrainSettings
        from padless.forward.engine import ModelEngine
        from padless.proof.load import load_model, load_tokenizer
    except ImportError:  # before the wings (62703fd): root modules
        from padless import config, engine, model

        TrainSettings, ModelEngine = config.TrainSettings, engine.ModelEngine
        load_model, load_tokenizer = model.load_model, model.load_tokenizer
    from padless.tiny import data_path
    from padless.trainers.sft import SFTRecipe

    root = Path(padless.__file__).resolve().parents[1]
    tokenizer = load_tokenizer("tiny-qwen2")
    model = load_model("tiny-qwen2", training=True)
    engine = ModelEngine(model)
    first_row = data_path("sft").read_text().splitlines()[0]
    seen: set[str] = set()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "one_row.jsonl"
        data.write_text(first_row + "\n")
        layout = SFTLayout(max_length=512)
        kw = {"cache_dir": str(Path(tmp) / "cache")}
        if "num_proc" in inspect.signature(load_set).parameters:
            kw["num_proc"] = 1
        examples, _ = _traced(lambda: load_set(str(data), layout, tokenizer, **kw), root, seen)
        cfg = TrainSettings(output_dir=tmp, max_tokens_per_batch=1024)
        recipe = SFTRecipe(examples, cfg, tokenizer, torch.device("cpu"))

        def step():
            micro = recipe.plan(0)[0]
            loss, _ = recipe.loss(engine, micro, float(micro.units))
            return loss

        loss = _traced(step, root, seen)
    assert torch.isfinite(loss), loss
    return sorted(f for f in seen if f not in EXCLUDED and not f.endswith("__init__.py"))


def measure_run() -> list[str]:
    """The padless modules in which a function runs from reading the YAML to the first loss reported."""
    import padless
    import padless.trainers.sft  # what the CLI loads for `sft`: imported before tracing
    from padless.cli import main

    root = Path(padless.__file__).resolve().parents[1]
    prefix = str(root / "padless") + "/"
    seen: set[str] = set()
    reported = threading.Event()

    def trace(frame, event, arg):
        code = frame.f_code
        if reported.is_set() or not code.co_filename.startswith(prefix) or code.co_name == "<module>":
            return None
        seen.add(str(Path(code.co_filename).relative_to(root)))
        if code.co_name == "log" and code.co_filename.endswith("/reporting.py"):
            reported.set()  # the first report: what follows (evaluation, the checkpoint) is not counted
        return None

    with tempfile.TemporaryDirectory() as tmp:
        argv = [
            "sft",
            str(root / "examples" / "sft_tiny.yaml"),
            "train.max_steps=1",
            f"train.output_dir={Path(tmp) / 'run'}",
            f"data.cache_dir={Path(tmp) / 'cache'}",
            "train.progress_bar=false",
        ]
        sys.settrace(trace)
        threading.settrace(trace)
        try:
            code = main(argv)
        finally:
            sys.settrace(None)
            threading.settrace(None)
    assert code == 0 and reported.is_set(), (code, sorted(seen))
    return sorted(seen)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="the same measurement (it is already small)")
    parser.add_argument("--json", action="store_true", help="print the list as JSON")
    args = parser.parse_args()
    modules, run = measure(), measure_run()
    if args.json:
        print(json.dumps({"row_to_loss": modules, "yaml_to_first_loss": run}))
        return
    print("padless modules whose code runs on one SFT row, data -> loss (cache and __init__ excluded):")
    for m in modules:
        print(f"  {m}")
    print("padless modules in which a function runs from the YAML to the first loss reported:")
    for m in run:
        print(f"  {m}")
    print(f"| modules on the row -> loss path | {len(modules)} |")
    print(f"| modules from the YAML to the first loss reported | {len(run)} |")


if __name__ == "__main__":
    main()
