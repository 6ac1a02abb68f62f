"""The Python API (``padless.api``): every trainer from in-memory data and callables gives the metrics the
command line gives on the same inputs from files; loaded models are proven and refused as folders are;
failures raise ``PadlessError`` with the command line's line and category."""

from __future__ import annotations

import json
import math
from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

import padless
from padless import api
from padless.cli import main
from padless.tiny import build_tiny_model, data_path, tiny_config, tiny_tokenizer

QUICK = {"max_steps": 2, "progress_bar": False, "report_to": ["jsonl"], "logging_steps": 1}
RL = {"prompts_per_step": 2, "num_generations": 2, "max_new_tokens": 4}


def first_digit(prompts: list[str], completions: list[str], answer: list[str], **fields) -> list[float]:
    """1 when the completion holds the answer's first digit (the tiny model is random: some do)."""
    return [float(a[:1] in c) for c, a in zip(completions, answer, strict=True)]


def rows(name: str, n: int) -> list[dict]:
    return [json.loads(line) for line in data_path(name).read_text().splitlines()[:n]]


# command -> (its data, keyword sections of its quick config); a trainer missing here fails the test below
RUNS = {
    "sft": ("sft", {}),
    "dpo": ("preference", {}),
    "rm": ("preference", {}),
    "kto": ("preference", {}),
    "orpo": ("preference", {}),
    "grpo": ("rl", {"rollout": RL}),
    "ppo": ("rl", {"rollout": RL}),
    "distill": ("sft", {"distill": {"mode": "offline"}}),  # the teacher: a model object, below
}


def test_every_command_has_an_api_trainer_and_a_run_here():
    assert set(RUNS) == set(api.TRAINERS) == set(api.CLASSES)
    for command, cls in api.CLASSES.items():
        assert getattr(padless, command.upper()) is cls and cls.command == command


def _overrides(sections: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in sections.items():
        if isinstance(value, dict):
            out += _overrides(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={json.dumps(value)}")
    return out


def _compared(metrics: dict[str, float]) -> dict[str, float]:
    """Everything but wall-clock rates and durations, which differ between any two runs."""
    return {k: v for k, v in metrics.items() if not (k.endswith("_s") or "per_s" in k or "seconds" in k)}


# The command line runs `api.trainer(command, config).train()` on the config it reads: the runs compared
# with it are those whose inputs differ in kind (a Dataset, a list of rows, a Python reward function).
COMPARED = ("sft", "dpo", "grpo")


@pytest.mark.slow
@pytest.mark.parametrize("command", list(RUNS))
def test_api_with_in_memory_data_and_callables_equals_the_cli_on_files(command, tmp_path, capsys):
    """Every trainer from in-memory rows (SFT: a ``datasets.Dataset``, else a list) and, for RL, a Python
    reward function; for :data:`COMPARED`, ``padless <command>`` on the same rows from a file and the
    function as ``file.py:function`` gives equal final metrics (the runs are deterministic on CPU, so equal
    means to the last bit)."""
    name, sections = RUNS[command]
    data = rows(name, 8)
    file = tmp_path / f"{name}.jsonl"
    file.write_text("".join(json.dumps(r) + "\n" for r in data))
    rl = command in ("grpo", "ppo")
    if command == "distill":  # a model object at another model key: it takes the student's tokenizer
        sections = {"distill": {**sections["distill"], "teacher": build_tiny_model("tiny-llama", seed=1)}}
    train = {**QUICK, "output_dir": str(tmp_path / "api")}
    in_memory = datasets.Dataset.from_list(data) if command == "sft" else data
    trainer = api.trainer(
        command,
        train_data=in_memory,
        train=train,
        **({"reward_functions": [first_digit]} if rl else {}),
        **sections,
    )
    assert trainer.config.data.train == "python:data.train"
    metrics = trainer.train()
    assert metrics and all(math.isfinite(v) for v in metrics.values())
    assert (tmp_path / "api" / "config.yaml").exists() and (tmp_path / "api" / "checkpoint-2").is_dir()
    if rl:
        assert any(k.endswith("reward/first_digit") for k in metrics), sorted(metrics)
    if command not in COMPARED:
        return
    cli = [f"data.train={file}", f"train.output_dir={tmp_path / 'cli'}"]
    cli += _overrides({"train": QUICK, **sections})
    if rl:
        cli.append(f'reward.functions=["{Path(__file__).resolve()}:first_digit"]')
    assert main([command, *cli]) == 0, capsys.readouterr().err
    printed = dict(item.split("=") for item in capsys.readouterr().out.strip().splitlines()[-1].split())
    assert set(printed) == set(metrics)
    logged = [json.loads(line) for line in (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()]
    last = {k: v for record in logged for k, v in record.items()}  # each metric's last value
    assert _compared({k: last[k] for k in metrics}) == _compared(metrics)


@pytest.mark.slow
def test_a_loaded_model_and_tokenizer_train_as_their_folder_and_the_config_names_it(tmp_path):
    """A ``PreTrainedModel`` object and a tokenizer object: written to a folder named by their hash, proven
    at load like any folder (the run log says so), and the same metrics as the embedded name they equal."""
    data = rows("sft", 8)
    by_object = padless.SFT(
        model=build_tiny_model("tiny-qwen2"),
        tokenizer=tiny_tokenizer(),
        train_data=data,
        train={**QUICK, "output_dir": str(tmp_path / "o")},
    ).train()
    by_name = padless.SFT(train_data=data, train={**QUICK, "output_dir": str(tmp_path / "n")}).train()
    assert _compared(by_object) == _compared(by_name)
    saved = (tmp_path / "o" / "config.yaml").read_text()
    folder = Path(
        next(line.split(": ", 1)[1] for line in saved.splitlines() if line.strip().startswith("name:"))
    )
    assert (folder / "config.json").exists() and (folder / "tokenizer.json").exists()
    log = (tmp_path / "o" / "log.txt").read_text()
    assert f"model {folder}" in log and "proved by the load-time probe" in log


class ShiftedConfig(Qwen2Config):
    model_type = "padless_test_api_shifted"


class ShiftedForCausalLM(Qwen2ForCausalLM):
    """Qwen2 whose own forward raises one token's logit after the LM head: padless's head cannot know it."""

    config_class = ShiftedConfig

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits[..., 7] += 5.0
        return out


def test_a_loaded_model_is_refused_by_the_probe_as_its_folder_is(tmp_path):
    """A model object goes through the load-time proof: a forward padless's head does not reproduce stops
    the run before training with the probe's message, as ``model.name=<its folder>`` does."""
    AutoConfig.register(ShiftedConfig.model_type, ShiftedConfig, exist_ok=True)
    AutoModelForCausalLM.register(ShiftedConfig, ShiftedForCausalLM, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = ShiftedForCausalLM(ShiftedConfig(**tiny_config("tiny-qwen2").to_dict()))
    trainer = padless.SFT(
        model=model,
        tokenizer=tiny_tokenizer(),
        train_data=rows("sft", 4),
        train={**QUICK, "output_dir": str(tmp_path)},
    )
    with pytest.raises(padless.PadlessError) as caught:
        trainer.train()
    error = caught.value
    assert error.category == "input" and error.exit_code == 2
    assert (
        error.message.startswith("ShiftedForCausalLM")
        and "differ from the model's own forward" in error.message
    )
    assert not (tmp_path / "checkpoint-1").exists()


def test_errors_carry_the_command_lines_line_and_category(tmp_path, capsys):
    """A bad key, a bad row in a list and an unknown object name: one line each, as the CLI prints it."""
    config = tmp_path / "dpo.yaml"
    config.write_text("train:\n  max_stepz: 1\n")
    with pytest.raises(padless.PadlessError) as caught:
        padless.DPO(config)
    assert caught.value.category == "input" and caught.value.exit_code == 2
    assert "unknown key 'train.max_stepz'" in caught.value.message
    assert main(["dpo", str(config)]) == 2
    assert capsys.readouterr().err.strip() == f"padless dpo: error: {caught.value.message}"

    bad = [{"prompt": "hi", "completion": " there"}, {"prompt": 3, "completion": "x"}]
    with pytest.raises(padless.PadlessError) as caught:
        padless.SFT(train_data=bad, train={**QUICK, "output_dir": str(tmp_path / "bad")}).train()
    assert caught.value.category == "input"
    assert caught.value.message.startswith("python:data.train row 1 (0-based)"), caught.value.message

    with pytest.raises(padless.PadlessError) as caught:
        padless.SFT(
            data={"train": "python:data.train"}, train={**QUICK, "output_dir": str(tmp_path / "x")}
        ).train()
    assert "names an object handed to padless.api" in caught.value.message

    with pytest.raises(padless.PadlessError, match=r"both set data\.train"):
        padless.SFT(train_data=bad, data={"train": "tiny:sft"})
