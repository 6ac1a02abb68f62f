"""The failure sweep: bad inputs and faults, run through ``padless.cli.main`` as a user would.

Every case asserts the exit code (2: the input needs fixing; 1: the run failed while running), that the
message is one line naming the culprit (file, row, key or path), that it says how to fix it, and that no
traceback reaches the user. Most cases fail before training starts: config errors before anything loads,
model and data errors right after the model loads. A few run a step or two (divergence, resume).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from padless.cli import main
from padless.tiny import build_tiny_model, tiny_tokenizer

FAST = ["train.progress_bar=false", "train.report_to=[jsonl]", "train.logging_steps=1"]
LLAMA = ["model.name=tiny-llama", *FAST]


@dataclass
class Case:
    """``argv`` may hold ``{tmp}`` (a fresh folder) and ``{name}`` placeholders filled from ``files``."""

    argv: list[str]
    code: int
    fragments: tuple[str, ...]  # the culprit and the fix, all in the message
    files: dict[str, Callable[[Path], Path]] = field(default_factory=dict)


def text_file(content: str | bytes, name: str) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        path = tmp / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return path

    return make


def jsonl(rows: list, name: str = "data.jsonl") -> Callable[[Path], Path]:
    return text_file("".join(json.dumps(r) + "\n" for r in rows), name)


def chat(user: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


GOOD = [chat("What is 2 + 3?", "5"), chat("Name a colour.", "Blue.")]


def model_folder(*, drop: tuple[str, ...] = (), config: dict | None = None, tokenizer: bool = True):
    """A tiny model saved with save_pretrained, then damaged: files dropped, config.json edited."""

    def make(tmp: Path) -> Path:
        path = tmp / "model"
        build_tiny_model("tiny-llama").save_pretrained(path)
        if tokenizer:
            tiny_tokenizer().save_pretrained(path)
        for name in drop:
            (path / name).unlink()
        if config is not None:
            data = json.loads((path / "config.json").read_text())
            data.update(config)
            (path / "config.json").write_text(json.dumps(data))
        return path

    return make


def pickle_only(tmp: Path) -> Path:
    path = model_folder()(tmp)
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    return path


def truncated_weights(tmp: Path) -> Path:
    path = model_folder()(tmp)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    return path


def garbage_weights(tmp: Path) -> Path:
    path = model_folder()(tmp)
    (path / "model.safetensors").write_bytes(b"\xff" * 64)
    return path


def remote_code(tmp: Path) -> Path:
    """A model folder whose config maps to code in the folder; the code would write a marker."""
    path = model_folder(config={"auto_map": {"AutoModelForCausalLM": "evil.EvilModel"}})(tmp)
    (path / "evil.py").write_text(f"open({str(tmp / 'EXECUTED')!r}, 'w').write('ran')\n")
    return path


def adapter_without_base(tmp: Path) -> Path:
    path = tmp / "adapter"
    path.mkdir()
    (path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "base_model_name_or_path": None})
    )
    save_file({"x": torch.zeros(1)}, path / "adapter_model.safetensors")
    return path


def run_folder_with_checkpoints(tmp: Path) -> Path:
    path = tmp / "runs"
    (path / "checkpoint-3").mkdir(parents=True)
    return path


def used_folder(tmp: Path) -> Path:
    path = tmp / "used"
    path.mkdir()
    (path / "metrics.jsonl").write_text('{"step": 1}\n')
    return path


def locked_folder(tmp: Path) -> Path:
    """A folder whose lock names a live process (this test's parent) on this host."""
    path = tmp / "locked"
    path.mkdir()
    holder = {"pid": os.getppid(), "host": socket.gethostname(), "started": "earlier"}
    (path / "run.lock").write_text(json.dumps(holder))
    return path


def a_file(tmp: Path) -> Path:
    path = tmp / "afile"
    path.write_text("not a folder")
    return path


def not_a_dataset_dir(tmp: Path) -> Path:
    path = tmp / "somedir"
    path.mkdir()
    (path / "notes.txt").write_text("hello")
    return path


CONFIG_CASES = {
    "unknown key": Case(
        ["sft", "train.learnig_rate=1e-4"], 2, ("train.learnig_rate", "learning_rate", "did you mean")
    ),
    "unknown section": Case(
        ["sft", "trian.max_steps=1"], 2, ("trian", "valid top-level keys", "did you mean 'train'")
    ),
    "lr inf": Case(["sft", "train.learning_rate=.inf"], 2, ("train.learning_rate", "finite", "fix:")),
    "lr nan": Case(["sft", "train.learning_rate=.nan"], 2, ("train.learning_rate", "finite", "fix:")),
    "lr overflow": Case(["sft", "train.learning_rate=1e400"], 2, ("train.learning_rate", "finite", "fix:")),
    "lr zero": Case(["sft", "train.learning_rate=0"], 2, ("train.learning_rate", "must be > 0", "fix:")),
    "lr negative": Case(
        ["sft", "train.learning_rate=-1e-4"], 2, ("train.learning_rate", "must be > 0", "fix:")
    ),
    "lr text": Case(["sft", "train.learning_rate=fast"], 2, ("train.learning_rate", "write a number")),
    "max_steps float": Case(["sft", "train.max_steps=1.5"], 2, ("train.max_steps", "whole number")),
    "accumulation 0": Case(
        ["sft", "train.gradient_accumulation_steps=0"], 2, ("gradient_accumulation", "> 0", "fix:")
    ),
    "grad norm inf": Case(["sft", "train.max_grad_norm=.inf"], 2, ("train.max_grad_norm", "finite", "fix:")),
    "warmup ratio": Case(["sft", "train.warmup_ratio=1.5"], 2, ("train.warmup_ratio", "[0, 1)", "fix:")),
    "adam beta": Case(["sft", "train.adam_beta2=1"], 2, ("train.adam_beta2", "[0, 1)", "fix:")),
    "no steps": Case(
        ["sft", "train.num_epochs=0"], 2, ("train.num_epochs", "max_steps", "no training steps", "fix:")
    ),
    "reporter": Case(["sft", "train.report_to=[wandb]"], 2, ("train.report_to", "wandb", "subset")),
    "resume empty": Case(
        ["sft", "train.resume_from_checkpoint=''"], 2, ("resume_from_checkpoint", "empty", "fix:")
    ),
    "overwrite and resume": Case(
        ["sft", "train.overwrite_output_dir=true", "train.resume_from_checkpoint=latest"],
        2,
        ("overwrite_output_dir", "resume_from_checkpoint", "fix:"),
    ),
    "nonfinite policy": Case(
        ["sft", "train.on_nonfinite=ignore"], 2, ("train.on_nonfinite", "'stop', 'skip'", "fix:")
    ),
    "log level": Case(["sft", "train.log_level=verbose"], 2, ("train.log_level", "'debug'", "did you mean")),
    "attention typo": Case(["sft", "model.attn_implementation=sdpaa"], 2, ("attn_implementation", "'sdpa'")),
    "dtype": Case(["sft", "model.dtype=fp16"], 2, ("model.dtype", "float16")),
    "lora r": Case(["sft", "model.lora.r=0"], 2, ("model.lora.r", "> 0", "fix:")),
    "trust remote code": Case(
        ["sft", "model.trust_remote_code=yes"], 2, ("trust_remote_code", "true or false")
    ),
    "max length": Case(["sft", "data.max_length=0"], 2, ("data.max_length", "> 0", "fix:")),
    "model name empty": Case(["sft", "model.name=''"], 2, ("model.name", "empty", "fix:")),
    "kernel ignored": Case(
        ["sft", "model.attn_implementation=sdpa", "model.varlen_kernel=sdpa"],
        2,
        ("varlen_kernel", "ignored", "fix:"),
    ),
    "eval without data": Case(["sft", "train.eval_steps=5"], 2, ("train.eval_steps", "data.eval", "fix:")),
    "override without =": Case(["sft", "train.max_steps"], 2, ("train.max_steps", "key=value")),
    "config missing": Case(["sft", "{tmp}/nope.yaml"], 2, ("nope.yaml", "not found", "fix:")),
    "config syntax": Case(
        ["sft", "{cfg}"],
        2,
        ("run.yaml line", "YAML syntax", "fix:"),
        {"cfg": text_file("train:\n  a: [\n", "run.yaml")},
    ),
    "config list": Case(
        ["sft", "{cfg}"],
        2,
        ("run.yaml", "mapping of sections", "fix:"),
        {"cfg": text_file("- 1\n", "run.yaml")},
    ),
    "config duplicate": Case(
        ["sft", "{cfg}"],
        2,
        ("run.yaml", "duplicate key", "fix:"),
        {"cfg": text_file("train:\n  max_steps: 1\n  max_steps: 2\n", "run.yaml")},
    ),
    "config directory": Case(["sft", "{tmp}"], 2, ("is a directory", "fix:")),
    "dpo beta": Case(["dpo", "dpo.beta=0"], 2, ("dpo.beta", "> 0", "fix:")),
    "dpo beta inf": Case(["dpo", "dpo.beta=.inf"], 2, ("dpo.beta", "finite", "fix:")),
    "rm margin": Case(["rm", "rm.margin=maybe"], 2, ("rm.margin", "true or false")),
    "grpo temperature": Case(["grpo", "rollout.temperature=0"], 2, ("rollout.temperature", "greedy", "fix:")),
    "grpo generations": Case(
        ["grpo", "rollout.num_generations=1"], 2, ("rollout.num_generations", "at least 2", "fix:")
    ),
    "ppo value lr": Case(
        ["ppo", "ppo.value_learning_rate=.inf"], 2, ("ppo.value_learning_rate", "finite", "fix:")
    ),
    "ppo gamma": Case(["ppo", "ppo.gamma=2"], 2, ("ppo.gamma", "[0, 1]", "fix:")),
    "unknown command": Case(["frobnicate"], 2, ("invalid choice", "choose from")),
    "generate temperature": Case(
        ["generate", "--model", "tiny-llama", "--prompt", "hi", "--temperature", "-1"],
        2,
        ("--temperature", "fix:"),
    ),
    "generate tokens": Case(
        ["generate", "--model", "tiny-llama", "--prompt", "hi", "--max-new-tokens", "0"],
        2,
        ("--max-new-tokens", "fix:"),
    ),
    "generate empty prompt": Case(
        ["generate", "--model", "tiny-llama", "--prompt", " "], 2, ("--prompt", "fix:")
    ),
    "check varlen kernel": Case(
        ["check", "--device", "cpu", "--varlen-kernel", "torch", "--backends", "varlen"],
        2,
        ("'torch'", "CUDA", "use varlen_kernel=sdpa"),
    ),
}

DATA_CASES = {
    "missing file": Case(
        ["sft", "data.train={tmp}/nope.jsonl"], 2, ("nope.jsonl", "no such file", "Accepted")
    ),
    "empty file": Case(
        ["sft", "data.train={d}"], 2, ("data.jsonl", "no rows", "fix:"), {"d": text_file("", "data.jsonl")}
    ),
    "blank lines": Case(
        ["sft", "data.train={d}"], 2, ("data.jsonl", "no rows"), {"d": text_file("\n\n  \n", "data.jsonl")}
    ),
    "invalid json": Case(
        ["sft", "data.train={d}"],
        2,
        ("data.jsonl row 2 (line 2)", "not valid JSON", "fix"),
        {"d": text_file(json.dumps(GOOD[0]) + "\n{oops\n", "data.jsonl")},
    ),
    "not an object": Case(
        ["sft", "data.train={d}"],
        2,
        ("data.jsonl row 1", "expected a JSON object", "fix the row"),
        {"d": jsonl([[1, 2]])},
    ),
    "csv": Case(
        ["sft", "data.train={d}"],
        2,
        ("data.csv", "unsupported file type", "Accepted"),
        {"d": text_file("a,b\n", "data.csv")},
    ),
    "plain dir": Case(
        ["sft", "data.train={d}"], 2, ("somedir", "save_to_disk", "Accepted"), {"d": not_a_dataset_dir}
    ),
    "invalid utf8": Case(
        ["sft", "data.train={d}"],
        2,
        ("data.jsonl row 1", "UTF-8", "Re-encode"),
        {"d": text_file(b'{"text": "\xff\xfe"}\n', "data.jsonl")},
    ),
    "json not list": Case(
        ["sft", "data.train={d}"],
        2,
        ("data.json", "list of objects", "Wrap the rows"),
        {"d": text_file('{"rows": 1}', "data.json")},
    ),
    "missing field": Case(
        ["sft", "data.train={d}"],
        2,
        ("data.jsonl row 2", "messages", "skip_bad_rows"),
        {"d": jsonl([GOOD[0], {"prompt": "x", "completion": "y"}])},
    ),
    "all skipped": Case(
        ["sft", "data.train={d}", "data.skip_bad_rows=true"],
        2,
        ("data.train", "data.jsonl", "all 2 rows were skipped", "Fix the row"),
        {"d": jsonl([{"messages": []}, {"messages": 3}])},
    ),
    "eval all skipped": Case(
        ["sft", "data.train={d}", "data.eval={e}", "data.skip_bad_rows=true"],
        2,
        ("data.eval", "eval.jsonl", "all 1 rows were skipped", "Fix the row"),
        {"d": jsonl(GOOD), "e": jsonl([{"messages": []}], "eval.jsonl")},
    ),
    "too long": Case(
        ["sft", "data.train={d}", "data.max_length=8"],
        2,
        ("data.jsonl row 1", "max_length", "skip_bad_rows"),
        {"d": jsonl(GOOD)},
    ),
    "unknown embedded": Case(["sft", "data.train=tiny:nope"], 2, ("tiny:nope", "tiny:sft", "valid:")),
    "dpo equal sides": Case(
        ["dpo", "data.train={d}"],
        2,
        ("data.jsonl row 1", "chosen", "rejected", "Fix the row"),
        {"d": jsonl([{"prompt": "Hi", "chosen": " same", "rejected": " same"}])},
    ),
    "dpo missing rejected": Case(
        ["dpo", "data.train={d}"],
        2,
        ("data.jsonl row 1", "rejected", "Give every row"),
        {"d": jsonl([{"prompt": "Hi", "chosen": " a"}])},
    ),
    "grpo missing prompt": Case(
        ["grpo", "data.train={d}"],
        2,
        ("data.jsonl row 1", "prompt", "Add a 'prompt'"),
        {"d": jsonl([{"q": "x"}])},
    ),
    "grpo empty": Case(
        ["grpo", "data.train={d}"], 2, ("data.jsonl", "no rows", "fix:"), {"d": text_file("", "data.jsonl")}
    ),
    "rm score empty": Case(
        ["rm", "score", "--model", "{m}", "--data", "{d}"],
        2,
        ("data.jsonl", "no rows", "fix:"),
        {
            "m": model_folder(config={"architectures": ["LlamaForSequenceClassification"]}),
            "d": text_file("", "data.jsonl"),
        },
    ),
}

MODEL_CASES = {
    "missing path": Case(
        ["sft", "model.name={tmp}/no/such/model"], 2, ("no/such/model", "no such folder", "fix:")
    ),
    "uncached id": Case(
        ["sft", "model.name=someone/uncached-model"], 2, ("someone/uncached-model", "cache", "hf download")
    ),
    "empty folder": Case(["sft", "model.name={tmp}"], 2, ("not a model folder", "config.json", "fix:")),
    "run folder": Case(
        ["sft", "model.name={m}"],
        2,
        ("not a model folder", "checkpoint-3"),
        {"m": run_folder_with_checkpoints},
    ),
    "a file": Case(["sft", "model.name={m}"], 2, ("afile", "is a file", "fix:"), {"m": a_file}),
    "no weights": Case(
        ["sft", "model.name={m}"],
        2,
        ("no weights", "safetensors", "fix:"),
        {"m": model_folder(drop=("model.safetensors",))},
    ),
    "pickle only": Case(
        ["sft", "model.name={m}"], 2, ("pytorch_model.bin", "pickle", "fix:"), {"m": pickle_only}
    ),
    "truncated weights": Case(
        ["sft", "model.name={m}"], 2, ("model.safetensors", "truncated", "fix:"), {"m": truncated_weights}
    ),
    "garbage weights": Case(
        ["sft", "model.name={m}"], 2, ("model.safetensors", "corrupt", "fix:"), {"m": garbage_weights}
    ),
    "no tokenizer": Case(
        ["sft", "model.name={m}"],
        2,
        ("no tokenizer files", "save_pretrained"),
        {"m": model_folder(tokenizer=False)},
    ),
    "remote code": Case(
        ["sft", "model.name={m}"], 2, ("auto_map", "model.trust_remote_code: true"), {"m": remote_code}
    ),
    "config not json": Case(
        ["sft", "model.name={m}"],
        2,
        ("config.json", "not valid JSON", "fix:"),
        {"m": lambda t: _bad_config(t)},
    ),
    "no model type": Case(
        ["sft", "model.name={m}"],
        2,
        ("config.json", "model_type", "fix:"),
        {"m": lambda t: _no_model_type(t)},
    ),
    "seed suffix": Case(["sft", "model.name=tiny-llama@x"], 2, ("tiny-llama@x", "whole number", "fix:")),
    "flash on cpu": Case(
        ["sft", *LLAMA, "model.attn_implementation=flash_attention_2"],
        2,
        ("flash_attention_2", "CUDA", "use attn_implementation=varlen"),
    ),
    "flex training on cpu": Case(
        ["sft", *LLAMA, "model.attn_implementation=flex_attention"],
        2,
        ("flex_attention", "backward", "train with attn_implementation=varlen"),
    ),
    "varlen torch on cpu": Case(
        ["sft", *LLAMA, "model.varlen_kernel=torch"], 2, ("'torch'", "CUDA", "use varlen_kernel=sdpa")
    ),
    "generate missing": Case(
        ["generate", "--model", "{tmp}/gone", "--prompt", "hi"], 2, ("gone", "no such folder", "fix:")
    ),
    "generate adapter without base": Case(
        ["generate", "--model", "{m}", "--prompt", "hi"],
        2,
        ("base_model_name_or_path", "fix:"),
        {"m": adapter_without_base},
    ),
    "rm score plain lm": Case(
        ["rm", "score", "--model", "{m}", "--data", "tiny:preference_eval"],
        2,
        ("LlamaForCausalLM", "not a reward model", "fix:"),
        {"m": model_folder()},
    ),
    "rm score embedded": Case(
        ["rm", "score", "--model", "tiny-llama", "--data", "tiny:preference_eval"],
        2,
        ("randomly initialised", "padless rm"),
    ),
    "grpo reward model plain lm": Case(
        ["grpo", *LLAMA, "reward.model={m}"], 2, ("not a reward model", "fix:"), {"m": model_folder()}
    ),
    "dpo ref model missing": Case(
        ["dpo", *LLAMA, "dpo.ref_model={tmp}/ref"], 2, ("ref", "no such folder", "fix:")
    ),
}

RUN_FOLDER_CASES = {
    "not empty": Case(
        ["sft", "train.output_dir={o}"], 2, ("used", "not empty", "overwrite_output_dir"), {"o": used_folder}
    ),
    "is a file": Case(["sft", "train.output_dir={o}"], 2, ("afile", "is a file", "fix:"), {"o": a_file}),
    "cannot create": Case(["sft", "train.output_dir={o}/run"], 2, ("cannot create", "fix:"), {"o": a_file}),
    "locked": Case(
        ["sft", "train.output_dir={o}"],
        2,
        ("in use by another padless run", "run.lock", "wait for that run"),
        {"o": locked_folder},
    ),
    "latest without checkpoint": Case(
        ["sft", "train.resume_from_checkpoint=latest"], 2, ("no complete checkpoint", "auto")
    ),
    "resume path not a checkpoint": Case(
        ["sft", "train.resume_from_checkpoint={tmp}/elsewhere"],
        2,
        ("elsewhere", "not a complete padless checkpoint", "use latest, auto"),
    ),
}

CASES = {
    **{f"config: {k}": v for k, v in CONFIG_CASES.items()},
    **{f"data: {k}": v for k, v in DATA_CASES.items()},
    **{f"model: {k}": v for k, v in MODEL_CASES.items()},
    **{f"run folder: {k}": v for k, v in RUN_FOLDER_CASES.items()},
}


def _bad_config(tmp: Path) -> Path:
    path = model_folder()(tmp)
    (path / "config.json").write_text("{not json")
    return path


def _no_model_type(tmp: Path) -> Path:
    path = model_folder()(tmp)
    data = json.loads((path / "config.json").read_text())
    del data["model_type"]
    (path / "config.json").write_text(json.dumps(data))
    return path


def run(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err
    return code, err


def check_message(err: str, command: str, fragments: tuple[str, ...]) -> None:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if ": error: " in line or "error:" in line]
    assert lines, err
    message = lines[-1]
    assert message.startswith(f"padless {command}: error:") or command == "frobnicate", message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_bad_input_is_one_clear_message(case: Case, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    paths = {name: str(make(work)) for name, make in case.files.items()}
    argv = [a.format(tmp=work, **paths) for a in case.argv]
    if argv[0] in ("sft", "dpo", "rm", "grpo", "ppo") and argv[1:2] != ["score"]:
        defaults = [f"train.output_dir={tmp_path / 'out'}", *LLAMA]  # before the case's own: those win
        at = 2 if len(argv) > 1 and "=" not in argv[1] else 1  # after a config file
        argv = [*argv[:at], *defaults, *argv[at:]]
    code, err = run(argv, capsys)
    assert code == case.code, err
    check_message(err, argv[0], case.fragments)
    assert not (work / "EXECUTED").exists(), "code shipped with a model ran"


# --------------------------------------------------------------------------------------------------
# Checkpoints: a real checkpoint of a one-step run, damaged, then resumed


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """One-step runs of the embedded Llama, full and LoRA; their checkpoint-1 folders."""
    root = tmp_path_factory.mktemp("trained")
    runs = {"full": [], "lora": ["model.lora.r=2", "model.lora.target_modules=[q_proj,v_proj]"]}
    for name, extra in runs.items():
        argv = [
            "sft",
            *LLAMA,
            f"train.output_dir={root / name}",
            "train.max_steps=1",
            "data.train=tiny:sft_eval",
        ]
        assert main([*argv, *extra]) == 0
    return {name: root / name / "checkpoint-1" for name in runs}


def truncate(name: str) -> Callable[[Path], None]:
    def damage(ckpt: Path) -> None:
        (ckpt / name).write_bytes((ckpt / name).read_bytes()[:-100])

    return damage


def write(name: str, text: str) -> Callable[[Path], None]:
    return lambda ckpt: (ckpt / name).write_text(text)


LORA = ["model.lora.r=2", "model.lora.target_modules=[q_proj,v_proj]"]
CHECKPOINT_CASES = {
    "truncated weights": (
        "full",
        truncate("model.safetensors"),
        [],
        ("model.safetensors", "truncated", "fix:"),
    ),
    "garbage weights": ("full", write("model.safetensors", "garbage"), [], ("model.safetensors", "corrupt")),
    "pickle-only weights": (
        "full",
        lambda c: (c / "model.safetensors").rename(c / "pytorch_model.bin"),
        [],
        ("pytorch_model.bin", "pickle", "fix:"),
    ),
    "no weights": (
        "full",
        lambda c: (c / "model.safetensors").unlink(),
        [],
        ("no weights", "checkpoint", "fix:"),
    ),
    "other model": ("full", None, ["model.name=tiny-qwen2"], ("does not fit", "model.name")),
    "lora on full": ("full", None, LORA, ("holds full weights", "model.lora")),
    "full on lora": ("lora", None, ["model.lora=null"], ("holds a LoRA adapter", "model.lora")),
    "lora other targets": (
        "lora",
        None,
        ["model.lora.r=2", "model.lora.target_modules=[k_proj,o_proj]"],
        ("does not fit", "missing", "model.lora"),
    ),
    "lora other rank": (
        "lora",
        None,
        ["model.lora.r=4", "model.lora.target_modules=[q_proj,v_proj]"],
        ("other shapes", "fix:"),
    ),
    "truncated adapter": (
        "lora",
        truncate("adapter_model.safetensors"),
        LORA,
        ("adapter_model.safetensors", "truncated", "fix:"),
    ),
    "state unreadable": (
        "full",
        write("trainer_state.json", "{"),
        [],
        ("trainer_state.json", "unreadable", "fix:"),
    ),
    "state incomplete": (
        "full",
        write("trainer_state.json", '{"step": 1}'),
        [],
        ("trainer_state.json", "epoch", "fix:"),
    ),
}


@pytest.mark.parametrize("name", list(CHECKPOINT_CASES))
def test_bad_checkpoint_is_named_before_resuming(name: str, trained, tmp_path: Path, capsys) -> None:
    source, damage, overrides, fragments = CHECKPOINT_CASES[name]
    model = [o for o in overrides if o.startswith("model.name")] or ["model.name=tiny-llama"]
    out = tmp_path / "run"
    shutil.copytree(trained[source], out / "checkpoint-1")
    if damage is not None:
        damage(out / "checkpoint-1")
    argv = ["sft", *FAST, *model, *[o for o in overrides if not o.startswith("model.name")]]
    argv += [f"train.output_dir={out}", "train.resume_from_checkpoint=latest", "train.max_steps=2"]
    argv += ["data.train=tiny:sft_eval", *(LORA if source == "lora" and not overrides else [])]
    code, err = run(argv, capsys)
    assert code == 2, err
    check_message(err, "sft", (str(out / "checkpoint-1"), *fragments))
    assert not (out / "checkpoint-2").exists()


# --------------------------------------------------------------------------------------------------
# Runtime faults


def raise_in_run(error: BaseException) -> Callable[..., None]:
    def fail(*args, **kwargs) -> None:
        raise error

    return fail


RUNTIME_CASES = {
    "unexpected error": (RuntimeError("boom"), 1, ("unexpected RuntimeError: boom", "--debug")),
    "interrupted": (KeyboardInterrupt(), 130, ("interrupted", "resume_from_checkpoint")),
    "out of memory": (
        torch.OutOfMemoryError("CUDA out of memory."),
        1,
        ("out of memory", "max_tokens_per_batch"),
    ),
    "disk full": (
        OSError(28, "No space left on device", "/runs/x/checkpoint-5"),
        1,
        ("no space left", "/runs/x", "fix:"),
    ),
    "missing file": (FileNotFoundError(2, "No such file", "/data/x.jsonl"), 2, ("/data/x.jsonl", "fix:")),
}


@pytest.mark.parametrize("name", list(RUNTIME_CASES))
def test_fault_is_one_message_with_its_exit_code(name: str, capsys, monkeypatch) -> None:
    error, code, fragments = RUNTIME_CASES[name]
    monkeypatch.setattr("padless.trainers.sft.run_sft", raise_in_run(error))
    got, err = run(["sft", "train.max_steps=1"], capsys)
    assert got == code, err
    check_message(err, "sft", fragments)


def test_debug_shows_the_traceback(capsys, monkeypatch) -> None:
    monkeypatch.setattr("padless.trainers.sft.run_sft", raise_in_run(RuntimeError("boom")))
    code, err = run(["sft", "--debug"], capsys)
    assert code == 1 and "Traceback" in err and "raise error" in err
    monkeypatch.setenv("PADLESS_DEBUG", "1")
    code, err = run(["sft"], capsys)
    assert code == 1 and "Traceback" in err


def test_diverging_run_stops_naming_step_and_micro_batch(tmp_path: Path, capsys) -> None:
    """A learning rate of 1e30 gives a NaN loss at step 2: the run stops there (exit 1) and writes no
    checkpoint of the diverged state."""
    out = tmp_path / "run"
    argv = ["sft", *LLAMA, f"train.output_dir={out}", "train.learning_rate=1e30", "train.max_steps=4"]
    code, err = run([*argv, "train.save_steps=1", "data.train=tiny:sft_eval"], capsys)
    assert code == 1, err
    check_message(
        err, "sft", ("diverged at step 2", "micro-batch 1 of", "learning_rate", "on_nonfinite=skip")
    )
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]
    assert not (out / "run.lock").exists()


def test_the_sweep_covers_at_least_80_cases() -> None:
    assert len(CASES) + len(CHECKPOINT_CASES) + len(RUNTIME_CASES) + 2 >= 80
