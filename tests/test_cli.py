"""``padless doctor`` and ``padless check``, run in-process through ``padless.cli.main``."""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from padless.cli import main
from padless.forward.attention import BACKENDS, VARLEN_NAME, varlen_kernel
from padless.forward.varlen import varlen_attention_forward
from padless.proof.check import LAYOUTS, TREE_LAYOUTS

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts what a CPU-only machine reports")


def test_doctor_lists_every_backend(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("attention backends on"))
    section = lines[start + 1 : start + 1 + len(BACKENDS)]
    assert [line.split()[0] for line in section] == list(BACKENDS)
    for line in section:
        assert line.split()[1] in ("ok", "missing:")
    for name in ("torch", "transformers", "python"):
        assert any(line.split()[:1] == [name] for line in lines), name
    assert "settings known to break packed training elsewhere" in out


@cpu_only
def test_doctor_on_cpu(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and line.split()}
    assert rows["varlen"].split()[1] == "ok"
    assert rows["sdpa"].split()[1] == "ok"
    assert "missing: flex_attention has no backward pass on CPU" in rows["flex_attention"]
    assert "missing: flash_attention_2 needs a CUDA device" in rows["flash_attention_2"]
    auto = next(line.split() for line in out.splitlines() if line.strip().startswith("auto picks"))
    assert auto[2:] == [varlen_kernel(torch.device("cpu"), torch.float32), "for", "float32", "on", "cpu"]


def test_check_passes_on_cpu(capsys):
    assert main(["check", "--device", "cpu", "--backends", "varlen,sdpa,eager"]) == 0
    out = capsys.readouterr().out
    assert "OK: every cell that ran is within its bound" in out
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("backend"))
    layouts = [*LAYOUTS, *TREE_LAYOUTS]  # the tree cells: a tree row vs alone, its gradient vs flat
    assert header.split()[-len(layouts) :] == layouts
    rows = {
        line.split()[0]: line.split()
        for line in lines
        if line.split()[:1] in (["varlen"], ["sdpa"], ["eager"])
    }
    assert list(rows) == ["varlen", "sdpa", "eager"]
    assert rows["varlen"][1] == "sdpa" and rows["sdpa"][1] == "sdpa" and rows["eager"][1] == "eager"
    for backend, tokens in rows.items():
        cells = [tokens[i : i + 3] for i in range(2, len(tokens), 3)]  # "delta <= bound" beside each other
        assert len(cells) == len(layouts)
        for delta, sign, limit in cells:
            assert sign == "<=" and 0.0 <= float(delta) <= float(limit) < 1e-4, (backend, cells)
    assert "dtype float32" in out and "16 * eps(dtype) * max(M, 1)" in out


def test_check_unknown_backend(capsys):
    assert main(["check", "--device", "cpu", "--backends", "varlen,nope"]) != 0
    captured = capsys.readouterr()
    assert "unknown attention backend 'nope'" in captured.err
    assert "OK" not in captured.out


def test_check_typo_suggests_backend(capsys):
    assert main(["check", "--device", "cpu", "--backends", "sdpaa"]) != 0
    assert "Did you mean 'sdpa'" in capsys.readouterr().err


def test_check_varlen_kernel_on_wrong_device(capsys):
    # conftest.py resets the process-wide kernel choice that this command sets.
    assert main(["check", "--device", "cpu", "--varlen-kernel", "torch", "--backends", "varlen"]) == 2
    assert "varlen kernel 'torch' needs a CUDA device" in capsys.readouterr().err


def _leaky_varlen(module, query, key, value, attention_mask, **kwargs):
    for k in ("cu_seq_lens_q", "cu_seq_lens_k", "position_ids"):
        kwargs.pop(k, None)
    return varlen_attention_forward(module, query, key, value, attention_mask, **kwargs)


def test_check_refuses_a_leaking_kernel(capsys, monkeypatch):
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, VARLEN_NAME, _leaky_varlen)
    assert main(["check", "--device", "cpu", "--backends", "varlen"]) != 0
    assert "leaks between packed sequences" in capsys.readouterr().err


@cpu_only
def test_check_that_checked_nothing_fails(capsys):
    assert main(["check", "--device", "cpu", "--backends", "flash_attention_2"]) == 1
    captured = capsys.readouterr()
    assert "nothing was checked" in captured.err and "OK" not in captured.out
    assert "flash_attention_2: flash_attention_2 needs a CUDA device" in captured.err


@cpu_only
def test_check_fails_when_a_named_backend_cannot_run(capsys):
    assert main(["check", "--device", "cpu", "--backends", "varlen,flash_attention_2"]) == 1
    captured = capsys.readouterr()
    assert "flash_attention_2 did not run" in captured.err and "nothing was checked" not in captured.err


@cpu_only
def test_check_zoo_that_checked_nothing_fails(capsys):
    assert main(["check", "--zoo", "--backends", "flash_attention_2"]) == 1
    err = capsys.readouterr().err
    assert "flash_attention_2: flash_attention_2 needs a CUDA device" in err and "nothing was checked" in err


def test_check_zoo_markdown(capsys):
    names = "gemma2,gpt-oss,qwen3-next,bloom"
    assert main(["check", "--zoo", names, "--backends", "varlen", "--markdown"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| architecture | verdict | what its tiny config exercises | bound | varlen |"
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines[2:] if line.startswith("|")}
    assert list(rows) == names.split(",")
    assert rows["gemma2"].startswith("| gemma2 | exact |") and rows["gemma2"].endswith("| exact |")
    assert rows["qwen3-next"].endswith("| exact |") and rows["bloom"].endswith("| refused [1] |")
    assert "4 architectures: 3 exact, 1 refused" in lines
    assert any(
        line.startswith(
            "[1] AttentionError: BloomForCausalLM (bloom) runs 'eager' attention whatever is asked"
        )
        for line in lines
    )


def test_check_zoo_refuses_an_unknown_name(capsys):
    assert main(["check", "--zoo", "llama3,lama4"]) == 2
    assert "unknown zoo architecture lama4" in capsys.readouterr().err


def test_check_option_errors(capsys):
    assert main(["check", "--markdown"]) == 2
    assert "--markdown prints the zoo's support table: add --zoo" in capsys.readouterr().err
    assert main(["check", "--zoo", "--model", "tiny-llama"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_cli_rejects_unknown_command_and_options(capsys):
    assert main(["frobnicate"]) == 2
    assert main(["check", "--device", "tpu"]) == 2
    assert "invalid choice" in capsys.readouterr().err
