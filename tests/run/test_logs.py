"""Logging: a run states what it runs on in its log file, only the main process writes, handlers do not
pile up across runs, and no process-global setting (the varlen kernel pin) outlives its run."""

from __future__ import annotations

import logging

import pytest
import torch

from padless.cli import main
from padless.config.loading import load_config
from padless.config.schema import SFTConfig
from padless.forward import attention
from padless.proof.load import load_model
from padless.run.logs import LOG_FILE, setup_logging
from padless.trainers.sft import run_sft

FAST = [
    "model.name=tiny-llama",
    "data.train=tiny:sft_eval",
    "train.progress_bar=false",
    "train.report_to=[jsonl]",
]


def file_handlers() -> list[logging.Handler]:
    return [h for h in logging.getLogger("padless").handlers if isinstance(h, logging.FileHandler)]


def test_a_run_states_backend_kernel_precision_engine_and_world_size(tmp_path):
    run_sft(load_config(SFTConfig, None, [*FAST, f"train.output_dir={tmp_path}", "train.max_steps=1"]))
    text = (tmp_path / LOG_FILE).read_text()
    for fragment in (
        "model tiny-llama: 1.4M parameters",
        "attention varlen, kernel sdpa (proved by the load-time probe: 2 calls",
        "precision float32 (dtype auto on cpu)",
        "engine single process (NO), world size 1, device cpu",
        "data.train tiny:sft_eval: 40 rows",
    ):
        assert fragment in text, (fragment, text)
    assert file_handlers() == []  # the run closed its log file


def test_runs_in_one_process_keep_their_own_logs_and_defaults(tmp_path):
    """A run that pins the varlen kernel pins it on its own models only (a model loaded after it runs
    ``auto``); a second run's lines stay out of the first run's log; a failing run (through the CLI)
    releases its lock and log file too."""
    first, second = tmp_path / "a", tmp_path / "b"
    run_sft(
        load_config(
            SFTConfig,
            None,
            [*FAST, f"train.output_dir={first}", "train.max_steps=1", "model.varlen_kernel=sdpa"],
        )
    )
    assert attention.kernel_of(load_model("tiny-llama", probe=False)) == "auto"
    size = (first / LOG_FILE).stat().st_size
    run_sft(load_config(SFTConfig, None, [*FAST, f"train.output_dir={second}", "train.max_steps=1"]))
    assert (first / LOG_FILE).stat().st_size == size
    assert "model tiny-llama" in (second / LOG_FILE).read_text()
    bad = [
        *(o for o in FAST if not o.startswith("data.train=")),  # a key given twice is refused before the run
        f"train.output_dir={tmp_path / 'c'}",
        "model.varlen_kernel=sdpa",
        "data.train=tiny:nope",
    ]
    assert main(["sft", *bad]) == 2
    assert attention.kernel_of(load_model("tiny-llama", probe=False)) == "auto" and file_handlers() == []
    assert not (tmp_path / "c" / "run.lock").exists()
    assert (
        "ERROR padless: padless sft: error: tiny:nope: no embedded dataset"
        in (tmp_path / "c" / LOG_FILE).read_text()
    )


def test_only_the_main_process_logs(monkeypatch):
    logger = setup_logging("info", main_process=False)
    assert logger.level == logging.ERROR
    assert setup_logging("debug").level == logging.DEBUG
    setup_logging()
    monkeypatch.setenv("PADLESS_LOG_LEVEL", "loud")
    with pytest.raises(ValueError, match="PADLESS_LOG_LEVEL"):
        setup_logging()


def test_the_console_says_what_padless_adjusts(capsys, monkeypatch):
    """Through the CLI (no logging configured by anyone else), the decoding switch reaches stderr."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # as in a plain `padless` process
    assert main(["generate", "--model", "tiny-llama", "--prompt", "Hi", "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "padless INFO: decoding with sdpa: the varlen backend runs whole sequences" in err


def test_run_line_names_the_proven_kernel_or_says_there_is_no_attention_layer():
    """A state-space model's probe counts no attention call and proves no kernel (Bamba's derived tiny
    config): its run line says so instead of an empty kernel name."""
    from types import SimpleNamespace

    from padless.run.logs import describe_run

    accelerator = SimpleNamespace(device=torch.device("cpu"), mixed_precision="no", num_processes=1,
                                  distributed_type=SimpleNamespace(value="NO"))  # fmt: skip
    model = torch.nn.Linear(2, 2)
    proven = {"kernel": "sdpa", "calls": 4, "max_delta_logps": 1e-6}
    model.padless_probe = proven
    assert "kernel sdpa (proved by the load-time probe: 4 calls; packed" in describe_run(
        accelerator, model, "m", "auto"
    )
    model.padless_probe = {**proven, "kernel": "", "calls": 0}
    line = describe_run(accelerator, model, "m", "auto")
    assert "no attention layer (proved by the load-time probe: packed" in line and "kernel  (" not in line
