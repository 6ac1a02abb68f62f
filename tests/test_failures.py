"""The failure sweep: bad inputs and faults, run through ``padless.cli.main`` as a user would.

Every case asserts the exit code (2: the input needs fixing; 1: the run failed while running), that the
message is one line naming the culprit (file, row, key or path), that it says how to fix it, and that no
traceback reaches the user. Most cases fail before training starts: config errors before anything loads,
model and data errors right after the model loads. A few run a step or two (divergence, resume).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def model_folder(
    *, drop: tuple[str, ...] = (), config: dict | None = None, tokenizer: bool = True, template: str = ""
):
    """A tiny model saved with save_pretrained, then damaged: files dropped, config.json edited, the chat
    template replaced."""

    def make(tmp: Path) -> Path:
        path = tmp / "model"
        build_tiny_model("tiny-llama").save_pretrained(path)
        if tokenizer:
            tok = tiny_tokenizer()
            tok.chat_template = template or tok.chat_template
            tok.save_pretrained(path)
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


def adapter_of_a_moved_base(tmp: Path) -> Path:
    path = adapter_without_base(tmp)
    (path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "base_model_name_or_path": str(tmp / "moved-base")})
    )
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


def symlink_loop(tmp: Path) -> Path:
    path = tmp / "loop"
    path.symlink_to(path)
    return path


def small_vocabulary(tmp: Path) -> Path:
    """A tiny Llama whose embeddings hold 512 token ids (the embedded tokenizer writes 4,096)."""
    from transformers import AutoModelForCausalLM

    from padless.tiny import tiny_config

    config = tiny_config("tiny-llama")
    config.vocab_size = 512
    path = tmp / "small"
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
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
    "reporter": Case(["sft", "train.report_to=[neptune]"], 2, ("train.report_to", "neptune", "subset")),
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
        ("varlen_kernel", "has no effect", "fix:"),
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
    # a template that fails on every conversation is the template's fault, named with its file
    "template raises": Case(
        ["sft", "model.name={m}"],
        2,
        ("chat_template.jinja", "cannot render even a plain question and answer", "roles must alternate"),
        {"m": model_folder(template="{{ raise_exception('roles must alternate') }}")},
    ),
    "template syntax": Case(
        ["sft", "model.name={m}"],
        2,
        ("chat_template.jinja", "TemplateSyntaxError", "fix: correct the template"),
        {"m": model_folder(template="{% for m in messages %}{{ m.content }")},
    ),
    "slice past the end": Case(
        ["sft", "data.train=tiny:sft_eval[5000:]"],
        2,
        ("tiny:sft_eval has", "selects none", "fix: slice within"),
    ),
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
    "adapter whose base moved": Case(
        ["sft", "model.name={m}"],
        2,
        ("adapter_config.json", "moved-base", "no such folder", "fix: put the base model back"),
        {"m": adapter_of_a_moved_base},
    ),
    "lora targets not in the model": Case(
        ["sft", "model.lora.target_modules=[qproj]"],
        2,
        ("model.lora.target_modules=['qproj']", "named down_proj, gate_proj, k_proj", "q_proj", "fix:"),
    ),
    "lora target as one string": Case(
        ["sft", "model.lora.target_modules=q_proj"], 2, ("'q_proj'", "a regular expression", "fix: list")
    ),
    "config fails transformers' validation": Case(
        ["sft", "model.name={m}"],
        2,
        ("config.json does not validate", "output_attentions", "fix: remove or correct 'output_attentions'"),
        {"m": model_folder(config={"output_attentions": True})},
    ),
    "value model with a smaller vocabulary": Case(
        ["ppo", "ppo.value_model={m}", "rollout.prompts_per_step=2", "rollout.max_new_tokens=4"],
        2,
        ("ppo.value_model", "embeds 512 token ids", "vocabulary has 4096", "policy's tokenizer"),
        {"m": small_vocabulary},
    ),
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
    "symlink loop": Case(
        ["sft", "train.output_dir={o}"],
        2,
        ("loop", "a symbolic link that leads nowhere", "fix: remove the link", "train.output_dir"),
        {"o": symlink_loop},
    ),
    "not empty": Case(
        ["sft", "train.output_dir={o}"], 2, ("used", "not empty", "overwrite_output_dir"), {"o": used_folder}
    ),
    "is a file": Case(["sft", "train.output_dir={o}"], 2, ("afile", "is a file", "fix:"), {"o": a_file}),
    "cannot create": Case(
        ["sft", "train.output_dir={o}/run"],
        2,
        ("is a file, not a folder", "creating the run folder", "fix:"),
        {"o": a_file},
    ),
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

if not torch.cuda.is_available():
    MODEL_CASES["check on cuda without one"] = Case(
        ["check", "--device", "cuda"], 2, ("--device cuda", "fix:")
    )

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
        own = [a.partition("=")[0] for a in argv if "=" in a]
        defaults = [f"train.output_dir={tmp_path / 'out'}", *LLAMA]
        defaults = [d for d in defaults if d.partition("=")[0] not in own]  # each key once
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
    "interrupted": (KeyboardInterrupt(), 130, ("interrupted (Ctrl-C)",)),  # outside a run: no advice
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
    assert "resume_from_checkpoint" not in err  # no run folder was taken: there is nothing to resume


def test_the_advice_after_ctrl_c_is_checked_against_the_run_folder(trained, tmp_path, capsys, monkeypatch):
    """Interrupted in its first step, a run has no checkpoint to resume: the message says so; a resumed
    run interrupted the same way names the checkpoint it can continue from."""
    from padless.trainers.sft import SFTRecipe

    monkeypatch.setattr(SFTRecipe, "loss", raise_in_run(KeyboardInterrupt()))
    fresh = ["sft", *LLAMA, f"train.output_dir={tmp_path / 'fresh'}", "data.train=tiny:sft_eval"]
    code, err = run([*fresh, "train.max_steps=2"], capsys)
    assert code == 130, err
    check_message(err, "sft", ("interrupted (Ctrl-C) before any checkpoint was written", "nothing to resume"))
    assert "resume_from_checkpoint" not in err
    argv, out = _resume(trained, tmp_path, "sft", "train.max_steps=2")
    code, err = run(argv, capsys)
    assert code == 130, err
    check_message(
        err, "sft", (f"continue from {out.resolve() / 'checkpoint-1'}", "resume_from_checkpoint=latest")
    )


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


# --------------------------------------------------------------------------------------------------
# Faults by category (issue 19): file operations, resume terms, user code, signals, inputs that mean
# something else. Cases written for these categories, not the issue's own list.

RUN1 = [*LLAMA, "data.train=tiny:sft_eval"]


def test_file_errors_are_sorted_by_category_with_path_action_and_fix(tmp_path: Path) -> None:
    import errno

    import pyarrow as pa
    from safetensors import SafetensorError

    from padless.faults import FAULT, USAGE, translate

    where = str(tmp_path / "x")
    cases = [
        (OSError(errno.ENOSPC, "No space", where), FAULT, "no space left"),
        (OSError(errno.EDQUOT, "Quota", where), FAULT, "quota"),
        (OSError(errno.EROFS, "Read-only", where), USAGE, "read-only"),
        (PermissionError(errno.EACCES, "denied", where), USAGE, "permission denied"),
        (FileNotFoundError(errno.ENOENT, "missing", where), USAGE, "no such file"),
        (NotADirectoryError(errno.ENOTDIR, "not a dir", where), USAGE, "is a file, not a folder"),
        (OSError(errno.ENAMETOOLONG, "too long", where), USAGE, "name is too long"),
        (OSError(errno.EIO, "I/O", where), FAULT, "input/output error"),
        (SafetensorError("Error while deserializing header: MetadataIncompleteBuffer"), USAGE, "corrupt"),
        (json.JSONDecodeError("Expecting value", "{", 1), USAGE, "corrupt"),
        (pa.ArrowInvalid("Not an Arrow file"), USAGE, "corrupt"),
    ]
    for error, code, words in cases:
        fault = translate(error, "writing checkpoint 3", where, setting="train.output_dir")
        assert fault is not None and fault.code == code, error
        text = str(fault)
        assert text.startswith(where) and words in text and "while writing checkpoint 3; fix: " in text, text
        assert "\n" not in text
    assert translate(RuntimeError("a bug"), "anything") is None  # not a file error: keeps its own message


@pytest.fixture
def tmpfs(tmp_path: Path):
    """A 1 MiB tmpfs (root only); ``remount(ro=True)`` makes it read-only. Skipped where mounting is not
    permitted (not root, or a container without CAP_SYS_ADMIN)."""
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)")

    def remount(ro: bool) -> None:
        subprocess.run(["mount", "-o", f"remount,{'ro' if ro else 'rw'}", str(mount)], check=True)

    try:
        yield mount, remount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_a_full_disk_while_writing_a_checkpoint_is_named_and_leaves_nothing_half_written(
    tmpfs, capsys
) -> None:
    mount, _ = tmpfs
    out = mount / "run"
    code, err = run(["sft", *RUN1, f"train.output_dir={out}", "train.max_steps=1"], capsys)
    assert code == 1, err
    check_message(
        err, "sft", ("no space left on the device", "while writing checkpoint 1", "train.output_dir")
    )
    assert not list(out.glob("*checkpoint-1*")) and not (out / "run.lock").exists()


def test_a_read_only_output_folder_or_cache_is_named_with_the_setting(tmpfs, tmp_path, capsys) -> None:
    mount, remount = tmpfs
    (mount / "cache").mkdir()
    remount(ro=True)
    code, err = run(["sft", *RUN1, f"train.output_dir={mount / 'run'}"], capsys)
    assert code == 2, err
    check_message(
        err, "sft", (str(mount / "run"), "read-only", "creating the run folder", "train.output_dir")
    )
    argv = ["sft", *RUN1, f"train.output_dir={tmp_path / 'run'}", f"data.cache_dir={mount / 'cache'}"]
    code, err = run(argv, capsys)
    assert code == 2, err
    check_message(
        err, "sft", ("read-only", "building the data cache of data tiny:sft_eval", "data.cache_dir")
    )
    assert not (tmp_path / "run" / "run.lock").exists()


def test_a_cache_dir_that_is_a_file_is_named(tmp_path: Path, capsys) -> None:
    (tmp_path / "cachefile").write_text("x")
    argv = ["sft", *RUN1, f"train.output_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cachefile'}"]
    code, err = run(argv, capsys)
    assert code == 2, err
    check_message(
        err, "sft", ("cachefile", "is a file, not a folder", "building the data cache", "data.cache_dir")
    )
    assert "already exists" not in err


@pytest.mark.parametrize(
    "damage", ["garbage arrow", "random arrow", "arrow removed", "record removed", "record garbage"]
)
def test_a_damaged_cache_entry_is_set_aside_and_rebuilt(damage: str, tmp_path: Path, caplog) -> None:
    import logging

    from padless.data.sft import SFTLayout
    from padless.data.tokenized import load_set

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in GOOD * 3))
    layout, tok = SFTLayout(max_length=64), tiny_tokenizer()
    first, _ = load_set(str(data), layout, tok, cache_dir=tmp_path / "cache")
    lengths, entry = [len(e.input_ids) for e in first], first.path
    arrow = next(entry.glob("*.arrow"))
    if damage == "garbage arrow":  # same size: only reading it tells
        arrow.write_bytes(b"\0" * arrow.stat().st_size)
    elif damage == "random arrow":  # same size, not Arrow: pyarrow says so with an OSError without errno
        arrow.write_bytes(bytes(random.Random(0).getrandbits(8) for _ in range(arrow.stat().st_size)))
    elif damage == "arrow removed":
        arrow.unlink()
    elif damage == "record removed":  # half-built: a folder under the name without its record
        (entry / "padless.json").unlink()
    else:
        (entry / "padless.json").write_text('{"rows": ')
    with caplog.at_level(logging.WARNING, logger="padless"):
        again, _ = load_set(str(data), layout, tok, cache_dir=tmp_path / "cache")
    assert [len(e.input_ids) for e in again] == lengths and min(lengths) > 0  # rebuilt, the same rows
    assert not again.cached
    if damage != "record removed":
        assert "is damaged" in caplog.text and "set aside" in caplog.text
    assert len(list((tmp_path / "cache").glob(".damaged-*"))) == 1


def test_a_data_file_edited_in_place_with_the_same_size_and_time_is_a_new_set(tmp_path: Path) -> None:
    from padless.data.sft import SFTLayout
    from padless.data.tokenized import load_set

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(chat("What is 2 + 3?", "5")) + "\n")
    stat = data.stat()
    first, _ = load_set(str(data), SFTLayout(max_length=64), tiny_tokenizer(), cache_dir=tmp_path / "c")
    data.write_text(json.dumps(chat("What is 2 + 4?", "6")) + "\n")
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    again, _ = load_set(str(data), SFTLayout(max_length=64), tiny_tokenizer(), cache_dir=tmp_path / "c")
    assert not again.cached and next(iter(again)).input_ids != next(iter(first)).input_ids


def _resume(trained, tmp_path: Path, command: str = "sft", *extra: str) -> tuple[list[str], Path]:
    out = tmp_path / "run"
    shutil.copytree(trained["full"].parent, out)
    argv = [command, *FAST, "model.name=tiny-llama", f"train.output_dir={out}"]
    return [*argv, "train.resume_from_checkpoint=latest", "data.train=tiny:sft_eval", *extra], out


RESUME_TERMS = {
    "another trainer": (
        ["dpo", "data.train=tiny:preference_eval", "train.max_steps=2"],
        ("written by padless sft (SFTRecipe)", "padless dpo", "fix: resume it with padless sft", "a new run"),
    ),
    # a reward model has a score head where the checkpoint has an LM head: the trainer is named, not the files
    "another trainer, other files": (
        ["rm", "data.train=tiny:preference_eval", "train.max_steps=2"],
        ("written by padless sft", "this run is padless rm", "fix: resume it with padless sft"),
    ),
    "another batching mid-epoch": (
        ["sft", "train.max_steps=2", "train.max_tokens_per_batch=2048"],
        ("data plan changed", "max_tokens_per_batch", "-> 2048", "skip or repeat rows", "fix: resume with"),
    ),
    "nothing left to train": (["sft", "train.max_steps=1"], ("is at step 1", "nothing left", "max_steps")),
}


@pytest.mark.parametrize("name", list(RESUME_TERMS))
def test_resume_refuses_what_the_checkpoint_does_not_belong_to(name: str, trained, tmp_path, capsys) -> None:
    (command, *extra), fragments = RESUME_TERMS[name]
    argv, out = _resume(trained, tmp_path, command, *extra)
    if command in ("dpo", "rm"):
        argv = [a for a in argv if a != "data.train=tiny:sft_eval"]
    code, err = run(argv, capsys)
    assert code == 2, err
    check_message(err, command, fragments)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]


def test_a_changed_learning_rate_is_applied_and_logged_on_resume(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    argv = [
        "sft",
        *RUN1,
        f"train.output_dir={out}",
        "train.lr_scheduler=constant",
        "train.learning_rate=1e-4",
    ]
    assert main([*argv, "train.max_steps=1"]) == 0
    resumed = [
        *argv[:-1],
        "train.learning_rate=5e-4",
        "train.max_steps=2",
        "train.resume_from_checkpoint=latest",
    ]
    assert main(resumed) == 0
    lrs = {
        r["step"]: r["train/lr"] for r in map(json.loads, (out / "metrics.jsonl").open()) if "train/lr" in r
    }
    assert lrs == {1: pytest.approx(1e-4), 2: pytest.approx(5e-4)}
    assert "train.learning_rate 0.0001 -> 0.0005" in (out / "log.txt").read_text()


@pytest.mark.slow
def test_a_branch_resume_keeps_every_newer_checkpoint_and_metric(tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = ["sft", *RUN1, f"train.output_dir={out}", "train.save_steps=1", "train.max_steps=3"]
    assert main(argv) == 0
    before = {p.name: (p / "model.safetensors").read_bytes() for p in out.glob("checkpoint-*")}
    metrics = (out / "metrics.jsonl").read_text()
    branch = [*argv, "train.save_total_limit=1", f"train.resume_from_checkpoint={out / 'checkpoint-1'}"]
    assert main(branch) == 0
    (aside,) = out.glob("superseded-*")
    assert {p.name: (p / "model.safetensors").read_bytes() for p in aside.glob("checkpoint-*")} == {
        k: v for k, v in before.items() if k != "checkpoint-1"
    }
    assert (aside / "metrics.jsonl").read_text() == metrics
    assert [p.name for p in out.glob("checkpoint-*")] == [
        "checkpoint-3"
    ]  # the branch's own, kept by the limit
    assert [r["step"] for r in map(json.loads, (out / "metrics.jsonl").open()) if "train/loss" in r] == [
        1,
        2,
        3,
    ]


@pytest.mark.slow
def test_a_refused_branch_resume_moves_nothing(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    argv = ["sft", *RUN1, f"train.output_dir={out}", "train.save_steps=1", "train.max_steps=2"]
    assert main(argv) == 0
    before = sorted(p.name for p in out.iterdir())
    metrics = (out / "metrics.jsonl").read_text()
    changed = [
        *argv,
        "train.max_tokens_per_batch=2048",
        f"train.resume_from_checkpoint={out / 'checkpoint-1'}",
    ]
    code, err = run(changed, capsys)
    assert code == 2 and "data plan changed" in err, err
    assert sorted(p.name for p in out.iterdir()) == before  # no superseded-*: checkpoint-2 stays in place
    assert (out / "metrics.jsonl").read_text() == metrics


def test_overwrite_deletes_only_what_the_manifest_lists_and_keeps_the_users_config(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    mine = "# my run\ntrain:\n  max_steps: 1\n"
    (out / "config.yaml").write_text(mine)
    (out / "notes.txt").write_text("mine")
    argv = [
        "sft",
        str(out / "config.yaml"),
        *RUN1,
        f"train.output_dir={out}",
        "train.overwrite_output_dir=true",
    ]
    assert main(argv) == 0
    assert main(argv) == 0  # a second overwrite of the same folder
    assert (out / "config.yaml").read_text() == mine and (out / "notes.txt").read_text() == "mine"
    assert "max_steps: 1" in (out / "padless-config.yaml").read_text()
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-1"]


def test_a_checkpoint_loads_only_the_files_it_lists(trained, tmp_path: Path, capsys) -> None:
    argv, out = _resume(trained, tmp_path, "sft", "train.max_steps=2")
    weights = safetensors_load(out / "checkpoint-1" / "model.safetensors")
    save_file(
        {k: torch.full_like(v, float("nan")) for k, v in weights.items()},
        out / "checkpoint-1" / "a.safetensors",
    )
    code, err = run(argv, capsys)
    assert code == 0, err  # the NaN copy sorts first and would be loaded over the real weights
    assert torch.isfinite(
        safetensors_load(out / "checkpoint-2" / "model.safetensors")["lm_head.weight"]
    ).all()


def safetensors_load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


STATE_DAMAGE = {
    "truncated optimizer": ("state/optimizer-0.safetensors", lambda b: b[: len(b) // 2]),
    "garbage schedule": ("state/scheduler.json", lambda b: b'{"last_epoch": '),
    "truncated rng": ("state/rng-0.json", lambda b: b[:10]),
}


@pytest.mark.parametrize("name", list(STATE_DAMAGE))
def test_damaged_training_state_is_named_as_corrupt(name: str, trained, tmp_path: Path, capsys) -> None:
    file, damage = STATE_DAMAGE[name]
    argv, out = _resume(trained, tmp_path, "sft", "train.max_steps=2")
    target = out / "checkpoint-1" / file
    target.write_bytes(damage(target.read_bytes()))
    code, err = run(argv, capsys)
    assert code == 2, err
    check_message(err, "sft", (file.split("/")[-1], "corrupt or truncated", "reading checkpoint", "fix:"))


def test_half_a_metrics_line_left_by_a_kill_is_dropped_on_resume(trained, tmp_path: Path, capsys) -> None:
    argv, out = _resume(trained, tmp_path, "sft", "train.max_steps=2")
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "train/lo')
    code, err = run(argv, capsys)
    assert code == 0, err
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").open()][-1] == 2
    logged = (out / "log.txt").read_text()
    assert (
        "dropped 1 line(s) that are not whole records" in logged and """'{"step": 2, "train/lo'""" in logged
    )


GRPO = [
    "model.name=tiny-llama",
    "rollout.prompts_per_step=2",
    "rollout.num_generations=2",
    "rollout.max_new_tokens=4",
    "rollout.mask_truncated=false",
    *FAST,
]


# --------------------------------------------------------------------------------------------------
# Saved RL state: a checkpoint taken mid-rollout with a rollout sampled ahead, damaged in well-formed ways

AHEAD = [*GRPO, "rollout.max_staleness=1", "grpo.mini_batches_per_rollout=2", "train.max_steps=4"]


@pytest.fixture(scope="module")
def mid_rollout(tmp_path_factory) -> Path:
    """checkpoint-1 of a GRPO run of two rollouts of two mini-batch steps each, the second rollout sampled
    ahead: it holds the first rollout half-trained and the second queued (``state/recipe-0.json``)."""
    root = tmp_path_factory.mktemp("mid_rollout")
    assert main(["grpo", *AHEAD, f"train.output_dir={root}", "train.save_steps=1"]) == 0
    return root / "checkpoint-1"


def rehash(ckpt: Path) -> None:
    """Record the checkpoint's files as they are now, as a writer that did not know better would."""
    from padless.run.checkpoint import _checksum, file_digest

    record = json.loads((ckpt / "trainer_state.json").read_text())
    del record["checksum"]
    record["digests"] = {name: file_digest(ckpt / name) for name in record["digests"]}
    (ckpt / "trainer_state.json").write_text(json.dumps({**record, "checksum": _checksum(record)}))


def edit_json(name: str, change: Callable[[Any], Any]) -> Callable[[Path], None]:
    def damage(ckpt: Path) -> None:
        data = json.loads((ckpt / name).read_text())
        (ckpt / name).write_text(json.dumps(change(data)))

    return damage


def _halve(state: dict) -> dict:
    return {**state, "rollout": state["rollout"][: len(state["rollout"]) // 2]}


def _shorter_advantages(state: dict) -> dict:
    state["rollout"][0]["algorithm"]["advantages"] = state["rollout"][0]["algorithm"]["advantages"][:-1]
    return state


RECIPE = "state/recipe-0.json"
RL_STATE_DAMAGE = {  # (damage, record the damaged files as they are, what the message says)
    "plan with half its samples": (edit_json(RECIPE, _halve), False, ("recipe-0.json", "changed after")),
    "rollouts ahead replaced by []": (
        edit_json(RECIPE, lambda s: {**s, "ahead": []}),
        False,
        ("recipe-0.json", "changed after"),
    ),
    "trainer state at another step": (
        edit_json("trainer_state.json", lambda s: {**s, "step": 2}),
        False,
        ("trainer_state.json", "changed after", "checksum"),
    ),
    "schedule moved": (
        edit_json("state/scheduler.json", lambda s: {**s, "last_epoch": s["last_epoch"] + 1}),
        False,
        ("scheduler.json", "changed after"),
    ),
    # a record that agrees with the files: the structure is checked against the run's settings
    "recorded plan with half its samples": (
        edit_json(RECIPE, _halve),
        True,
        ("recipe-0.json", "its rollout holds 2 samples; this run's rollouts hold 4"),
    ),
    "recorded empty queue ahead": (
        edit_json(RECIPE, lambda s: {**s, "ahead": []}),
        True,
        ("recipe-0.json", "holds the rollouts [] sampled ahead", "holds [1]"),
    ),
    "recorded advantages of another length": (
        edit_json(RECIPE, _shorter_advantages),
        True,
        ("recipe-0.json", "algorithm.advantages has"),
    ),
}


@pytest.mark.parametrize("name", list(RL_STATE_DAMAGE))
def test_saved_rl_state_changed_in_a_well_formed_way_is_refused(name, mid_rollout, tmp_path, capsys) -> None:
    """Every file of a checkpoint is covered by the size and sha256 recorded when it was written (and the
    record by its checksum); a recipe state that agrees with the record is still checked against the run:
    the rollout's sample count, each sample's values per target, the queue of rollouts sampled ahead."""
    damage, recorded, fragments = RL_STATE_DAMAGE[name]
    out = tmp_path / "run"
    shutil.copytree(mid_rollout, out / "checkpoint-1")
    damage(out / "checkpoint-1")
    if recorded:
        rehash(out / "checkpoint-1")
    code, err = run(
        ["grpo", *AHEAD, f"train.output_dir={out}", "train.resume_from_checkpoint=latest"], capsys
    )
    assert code == 2, err
    check_message(err, "grpo", (str(out / "checkpoint-1"), *fragments, "fix:"))
    assert not (out / "checkpoint-2").exists()


@pytest.mark.slow
def test_a_reward_function_calling_sys_exit_is_an_error_with_a_checkpoint(tmp_path: Path, capsys) -> None:
    reward = tmp_path / "quitter.py"
    reward.write_text(
        "import sys\ncalls = []\n\n\ndef quitter(prompts, completions, **fields):\n    calls.append(1)\n"
        "    if len(calls) == 2:\n        sys.exit(0)\n    return [1.0] * len(completions)\n"
    )
    out = tmp_path / "run"
    argv = [
        "grpo",
        *GRPO,
        f"train.output_dir={out}",
        "train.max_steps=3",
        f"reward.functions=[{reward}:quitter]",
    ]
    code, err = run(argv, capsys)
    assert code == 2, err
    check_message(err, "grpo", ("at step 2", "'quitter'", "sys.exit(0)", "checkpoint-1", "fix:"))
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-1"] and not (out / "run.lock").exists()


@pytest.mark.slow
def test_a_failing_evaluation_names_the_eval_set_and_keeps_the_trained_steps(tmp_path: Path, capsys) -> None:
    evals = tmp_path / "eval.jsonl"
    evals.write_text(json.dumps({"prompt": "What is 2 + 3?"}) + "\n")  # no answer for the arithmetic reward
    out = tmp_path / "run"
    argv = ["grpo", *GRPO, f"train.output_dir={out}", "train.max_steps=1", f"data.eval={evals}"]
    code, err = run(argv, capsys)
    assert code == 2, err
    check_message(err, "grpo", ("evaluation after step 1 failed", "data.eval", "checkpoint-1"))
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-1"]


def test_epochs_with_nothing_to_train_warn_and_a_run_of_them_stops(caplog) -> None:
    import logging
    from types import SimpleNamespace

    from padless.run.loop import IDLE_LIMIT, MicroBatch, Trainer

    trainer = SimpleNamespace(_idle=0)
    masked = [MicroBatch([], 0.0, 10)]
    with caplog.at_level(logging.WARNING, logger="padless"):
        for epoch in range(IDLE_LIMIT - 1):
            Trainer._check_trainable(trainer, epoch, masked)
    assert caplog.text.count("has nothing to train on") == IDLE_LIMIT - 1
    Trainer._check_trainable(trainer, 9, [MicroBatch([], 3.0, 10)])  # one that trains resets the count
    for epoch in range(IDLE_LIMIT - 1):
        Trainer._check_trainable(trainer, epoch, masked)
    with pytest.raises(
        ValueError, match=r"3 epochs / rollouts in a row had nothing to train on.*max_new_tokens"
    ):
        Trainer._check_trainable(trainer, 5, masked)


def test_a_non_finite_policy_while_sampling_stops_as_divergence() -> None:
    from padless.errors import DivergenceError
    from padless.rl.generate import sampling_guard

    expected = r"not finite .* while sampling a rollout.*learning_rate"
    with pytest.raises(DivergenceError, match=expected), sampling_guard():
        torch.multinomial(torch.tensor([[float("inf"), 1.0]]), 1)


@pytest.mark.slow
def test_sigterm_mid_cache_build_leaves_no_process_lock_or_half_cache(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    rows = [chat(f"What is {i} plus {i}? " * 8, str(2 * i) * 10) for i in range(12000)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [sys.executable, "-m", "padless.cli", "sft", *RUN1[:-1], f"data.train={data}", "data.num_proc=2"]
    argv += [f"data.cache_dir={tmp_path / 'cache'}", f"train.output_dir={tmp_path / 'run'}"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
    err = tmp_path / "err.txt"
    with err.open("w") as stderr:
        proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=stderr, env=env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 240
        workers: list[str] = []
        while time.monotonic() < deadline and len(workers) < 2 and proc.poll() is None:
            time.sleep(0.1)  # until the map's worker processes exist (a file of the map may come first)
            if list((tmp_path / "cache").glob(".tmp-*/work/*map*")):
                workers = subprocess.run(
                    ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
                ).stdout.split()
        assert len(workers) >= 2, "the build never started its worker processes"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(1)
    alive = [w for w in workers if Path(f"/proc/{w}").exists()]
    assert not alive, f"worker processes left running: {alive}"
    text = err.read_text()
    assert "Traceback" not in text and "padless sft: error: terminated (SIGTERM)" in text, text[-2000:]
    assert list((tmp_path / "cache").iterdir()) == []  # no half-built entry, no temporary folder
    assert not (tmp_path / "run" / "run.lock").exists()


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(checkpoint / "model.safetensors")


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.slow
def test_sigterm_during_a_rollout_checkpoints_the_trained_steps_and_the_resume_continues(
    tmp_path: Path, capsys
) -> None:
    """SIGTERM while a reward function scores the second rollout (one step per rollout, no checkpoint
    asked for before step 3): exit 143 with one line, step 1 checkpointed on the way out; resumed, the run
    ends with the very weights of an uninterrupted one (1e-6: the same operations)."""
    armed = tmp_path / "armed"
    reward = tmp_path / "stopper.py"
    reward.write_text(
        "import os, pathlib, signal\n\n\ndef stopper(prompts, completions, **fields):\n"
        f"    armed = pathlib.Path({str(armed)!r})\n"
        "    if armed.exists() and armed.read_text() == '1':\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    if armed.exists():\n        armed.write_text('1')\n"
        "    return [float(len(set(c))) for c in completions]\n"
    )
    argv = [
        "grpo",
        *GRPO,
        "train.max_steps=3",
        "train.learning_rate=1e-3",
        f"reward.functions=[{reward}:stopper]",
    ]
    assert main([*argv, f"train.output_dir={tmp_path / 'straight'}"]) == 0
    out = tmp_path / "run"
    armed.write_text("0")  # the first rollout passes and arms it; the second is interrupted
    code, err = run([*argv, f"train.output_dir={out}"], capsys)
    assert code == 143, err
    check_message(err, "grpo", ("terminated (SIGTERM)",))
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-1"]
    assert not (out / "run.lock").exists()
    armed.unlink()
    assert main([*argv, f"train.output_dir={out}", "train.resume_from_checkpoint=latest"]) == 0
    assert _max_diff(_weights(out / "checkpoint-3"), _weights(tmp_path / "straight" / "checkpoint-3")) <= 1e-6


@pytest.mark.slow
def test_sigterm_during_a_checkpoint_write_finishes_it_and_the_resume_continues(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """SIGTERM while checkpoint 2 is being written (its optimizer state, half way): the write is finished,
    then the run stops with 143; nothing half-written is left, and the resumed run ends with the weights
    of an uninterrupted one."""
    from padless.run import checkpoint

    argv = ["sft", *RUN1, "train.max_steps=4", "train.save_steps=2"]
    assert main([*argv, f"train.output_dir={tmp_path / 'straight'}"]) == 0
    write = checkpoint.save_tree

    def interrupted(tree, path: Path) -> None:
        if path.parent.parent.name == ".tmp-checkpoint-2" and path.name.startswith("optimizer"):
            os.kill(os.getpid(), signal.SIGTERM)
        write(tree, path)

    monkeypatch.setattr(checkpoint, "save_tree", interrupted)
    out = tmp_path / "run"
    code, err = run([*argv, f"train.output_dir={out}"], capsys)
    assert code == 143, err
    check_message(err, "sft", ("terminated (SIGTERM)",))
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-2"]
    assert (out / "checkpoint-2" / "trainer_state.json").exists() and not (out / "run.lock").exists()
    monkeypatch.setattr(checkpoint, "save_tree", write)
    assert main([*argv, f"train.output_dir={out}", "train.resume_from_checkpoint=latest"]) == 0
    assert _max_diff(_weights(out / "checkpoint-4"), _weights(tmp_path / "straight" / "checkpoint-4")) <= 1e-6


def _image(mode: str) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    if mode == "I;16":
        image = Image.fromarray((np.arange(16 * 16).reshape(16, 16) * 200).astype(np.uint16))
    elif mode == "P":
        image = Image.new("P", (16, 16), 0)
        image.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
        image.info["transparency"] = 0
    elif mode == "CMYK":
        image = Image.new("CMYK", (16, 16), (0, 255, 255, 0))  # red
    else:
        frames = [Image.new("RGB", (16, 16), c) for c in ("red", "blue")]
        buffer = io.BytesIO()
        frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:])
        return buffer.getvalue()
    buffer = io.BytesIO()
    image.save(buffer, "PNG" if mode != "CMYK" else "JPEG", **({"transparency": 0} if mode == "P" else {}))
    return buffer.getvalue()


def test_image_modes_are_converted_as_they_look_or_refused() -> None:
    import numpy as np

    from padless.data.images import load_image
    from padless.data.records import Row
    from padless.errors import DataError

    row = Row(data={}, source="rows.jsonl", index=3)
    grey = np.asarray(load_image(row, "images", _image("I;16")))[..., 0]
    assert grey.min() == 0 and 180 < grey.max() < 255 and len(np.unique(grey)) > 100  # not clipped to white
    assert np.asarray(load_image(row, "images", _image("P"))).min() == 255  # transparent: white, not black
    red = np.asarray(load_image(row, "images", _image("CMYK"))).astype(int)
    assert red[..., 0].min() > 200 and red[..., 1:].max() < 60
    with pytest.raises(DataError, match="is an animation \\(2 frames\\)"):
        load_image(row, "images", _image("GIF"))


def _reward_model(tmp: Path) -> Path:
    path = tmp / "rm"
    build_tiny_model("tiny-llama", task="score").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


MEANING = {
    "debug env not a switch": (["doctor"], {"PADLESS_DEBUG": "maybe"}, 2, ("PADLESS_DEBUG='maybe'", "fix:")),
    "rm score to csv": (
        ["rm", "score", "--model", "tiny-llama", "--data", "x.jsonl", "--out", "s.csv"],
        {},
        2,
        ("--out s.csv", ".jsonl", ".parquet", "fix:"),
    ),
    "generate with a reward model": (
        ["generate", "--model", "{rm}", "--prompt", "hi"],
        {},
        2,
        ("is a reward model", "rm score", "fix:"),
    ),
    "comment-only config": (["sft", "{cfg}"], {}, 2, ("is empty", "leave the file out")),
}


@pytest.mark.parametrize("name", list(MEANING))
def test_inputs_that_mean_something_else_are_refused(name: str, tmp_path: Path, capsys, monkeypatch) -> None:
    argv, env, code, fragments = MEANING[name]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg = tmp_path / "run.yaml"
    cfg.write_text("# nothing yet\n")
    rm = _reward_model(tmp_path) if "{rm}" in argv else ""
    got, err = run([a.format(rm=rm, cfg=cfg) for a in argv], capsys)
    assert got == code, err
    check_message(err, argv[0], fragments)


def test_padless_debug_false_means_off(capsys, monkeypatch) -> None:
    monkeypatch.setattr("padless.trainers.sft.run_sft", raise_in_run(RuntimeError("boom")))
    monkeypatch.setenv("PADLESS_DEBUG", "false")
    code, err = run(["sft"], capsys)
    assert code == 1 and "Traceback" not in err
