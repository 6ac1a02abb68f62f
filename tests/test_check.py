"""The invariance matrix: models x backends x layouts, per token, against each sequence run alone."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from padless.attention import (
    VARLEN_NAME,
    attention_in_use,
    count_attention_calls,
    hf_name,
    runtime_context,
    varlen_attention_forward,
)
from padless.check import (
    LAYOUTS,
    BackendRow,
    Cell,
    format_matrix,
    layout_logps,
    matrix_ok,
    max_delta,
    probe_sequences,
    run_matrix,
    tolerance,
)
from padless.model import load_model

MODELS = ("tiny-qwen2", "tiny-llama")
CPU_BACKENDS = ("varlen", "sdpa", "eager", "flex_attention")
FP32_TOL = 1e-5


def _cells():
    """Every (model, backend, layout) cell. flex_attention compiles one kernel per distinct shape on CPU
    (seconds each), so it runs the three multi-sequence layouts only: two shapes per model."""
    for name in MODELS:
        for backend in CPU_BACKENDS:
            for layout in ("alone", "left", "right", "packed"):
                if backend == "flex_attention" and layout == "alone":
                    continue
                yield pytest.param(name, backend, layout, id=f"{name}-{backend}-{layout}")


@pytest.fixture(scope="module")
def references(alone_logps, probe_seqs) -> dict[str, list[torch.Tensor]]:
    """Per model: each probe sequence run alone through a plain forward on eager attention."""
    return {name: alone_logps(load_model(name, attn_implementation="eager"), probe_seqs) for name in MODELS}


@pytest.fixture(scope="module")
def layout_results(probe_seqs, pad_id):
    """Computes every layout of one (model, backend) once, on first request, for the whole module."""
    cache: dict[tuple[str, str], tuple[dict[str, list[torch.Tensor]], dict[str, int]]] = {}

    def get(name: str, backend: str) -> tuple[dict[str, list[torch.Tensor]], dict[str, int]]:
        """Per-layout log-probs, and the attention functions called (by name) while computing them."""
        if (name, backend) not in cache:
            flex = backend == "flex_attention"
            # The probe runs three more shapes (each a compile for flex); the call counts below stand in.
            model = load_model(name, attn_implementation=backend, probe=not flex)
            layouts = ("left", "right", "packed") if flex else ("alone", "left", "right", "packed")
            with torch.no_grad(), runtime_context(backend, "cpu"), count_attention_calls() as calls:
                logps = {lay: layout_logps(model, probe_seqs, lay, pad_id) for lay in layouts}
            cache[name, backend] = logps, dict(calls)
        return cache[name, backend]

    return get


@pytest.mark.parametrize(("name", "backend", "layout"), list(_cells()))
def test_invariance_matrix_fp32(name, backend, layout, layout_results, references, per_token_delta):
    results, calls = layout_results(name, backend)
    # The requested kernel ran, and only it (eager is the built-in default: no registered function).
    assert set(calls) == (set() if backend == "eager" else {hf_name(backend)}), calls
    got = results[layout]
    delta = per_token_delta(got, references[name])
    assert delta <= FP32_TOL, f"{name} / {backend} / {layout}: max |delta log-prob| {delta:.3g}"


# ----------------------------------------------------------------------------------------------------------
# The pieces of `padless check`
# ----------------------------------------------------------------------------------------------------------


def test_probe_sequences_are_real_text_of_requested_lengths(tokenizer):
    seqs = probe_sequences(tokenizer, (4, 50, 7))
    assert [len(s) for s in seqs] == [4, 50, 7]
    # Consecutive, non-overlapping cuts of the corpus: decoding them in order gives running text.
    text = tokenizer.decode([t for s in seqs for t in s])
    assert len(text.split()) > 20
    assert tokenizer.pad_token_id not in {t for s in seqs for t in s}
    # Longer than the corpus still works (the corpus is repeated).
    assert [len(s) for s in probe_sequences(tokenizer, (5000, 5000))] == [5000, 5000]


def test_tolerance_by_dtype():
    assert tolerance(torch.float32) == 1e-5
    assert tolerance(torch.bfloat16) == tolerance(torch.float16) == 0.1


def test_max_delta():
    a = [torch.tensor([1.0, 2.0]), torch.tensor([3.0])]
    b = [torch.tensor([1.0, 2.5]), torch.tensor([2.0])]
    assert max_delta(a, b) == 1.0
    assert max_delta(a, a) == 0.0
    with pytest.raises(ValueError):
        max_delta(a, b[:1])


@pytest.fixture(scope="module")
def qwen2(probe_seqs):
    return load_model("tiny-qwen2", attn_implementation="varlen")


def test_run_matrix_cpu(qwen2, probe_seqs, pad_id):
    qwen2.train()
    rows = run_matrix(qwen2, probe_seqs, pad_id, backends=("varlen", "sdpa", "eager", "flash_attention_2"))
    # The model is handed back as it came: its backend and its mode.
    assert qwen2.padless_attention == "varlen" and attention_in_use(qwen2) == "varlen"
    assert qwen2.training
    qwen2.eval()

    by_backend = {r.backend: r for r in rows}
    assert list(by_backend) == ["varlen", "sdpa", "eager", "flash_attention_2"]
    flash = by_backend["flash_attention_2"]
    assert flash.skipped is not None and "CUDA" in flash.skipped and flash.cells == []
    for backend, kernel in (("varlen", "sdpa"), ("sdpa", "sdpa"), ("eager", "eager")):
        row = by_backend[backend]
        assert row.skipped is None and row.kernel_ok and row.kernel == kernel
        assert [c.layout for c in row.cells] == list(LAYOUTS)
        for c in row.cells:
            assert c.error is None and c.max_delta is not None and 0.0 <= c.max_delta <= FP32_TOL, c
    assert matrix_ok(rows, FP32_TOL)
    # 'alone' on eager is the reference itself: bit-identical.
    assert by_backend["eager"].cells[0].max_delta == 0.0


def _leaky_varlen(module, query, key, value, attention_mask, **kwargs):
    for k in ("cu_seq_lens_q", "cu_seq_lens_k", "position_ids"):
        kwargs.pop(k, None)
    return varlen_attention_forward(module, query, key, value, attention_mask, **kwargs)


def test_run_matrix_flags_a_leaking_kernel(qwen2, probe_seqs, pad_id, monkeypatch):
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, VARLEN_NAME, _leaky_varlen)
    (row,) = run_matrix(qwen2, probe_seqs, pad_id, backends=("varlen",), layouts=("alone", "packed"))
    alone, packed = row.cells
    assert alone.max_delta <= FP32_TOL  # one sequence alone has nothing to leak into
    assert packed.max_delta > 0.05
    assert not matrix_ok([row], FP32_TOL)
    table = format_matrix([row], FP32_TOL, layouts=("alone", "packed"))
    assert "!" in table.splitlines()[2]


def _row(backend="sdpa", deltas=(1e-6, 2e-6), **kw):
    cells = [Cell(backend, lay, max_delta=d) for lay, d in zip(("left", "packed"), deltas, strict=True)]
    return BackendRow(backend, kw.pop("kernel", "sdpa"), kw.pop("kernel_ok", True), cells, **kw)


def test_matrix_ok_and_format():
    layouts = ("left", "packed")
    good = [_row("varlen"), _row("sdpa")]
    assert matrix_ok(good, 1e-5)
    table = format_matrix(good, 1e-5, layouts)
    data = table.splitlines()[2:4]
    assert [line.split()[0] for line in data] == ["varlen", "sdpa"]
    assert not any("!" in line or "ERROR" in line for line in data)
    assert "2.0e-06" in data[1] and "tolerance 1e-05" in table

    over = [_row("varlen"), _row("sdpa", deltas=(1e-6, 3e-5))]
    assert not matrix_ok(over, 1e-5)
    sdpa_line = next(
        line for line in format_matrix(over, 1e-5, layouts).splitlines() if line.startswith("sdpa")
    )
    assert "3.0e-05!" in sdpa_line

    errored = [_row("sdpa", deltas=(1e-6, 1e-6))]
    errored[0].cells[1] = Cell("sdpa", "packed", error="RuntimeError: boom")
    assert not matrix_ok(errored, 1e-5)
    table = format_matrix(errored, 1e-5, layouts)
    assert "ERROR" in table and "note: sdpa/packed: RuntimeError: boom" in table

    wrong_kernel = [_row("flex_attention", kernel="requested flex but ran sdpa", kernel_ok=False)]
    assert not matrix_ok(wrong_kernel, 1e-5)
    table = format_matrix(wrong_kernel, 1e-5, layouts)
    assert "NO" in table.splitlines()[2] and "note: flex_attention: requested flex but ran sdpa" in table

    skipped = [_row("varlen"), BackendRow("flash_attention_2", None, False, [], skipped="needs CUDA")]
    assert matrix_ok(skipped, 1e-5)  # an unavailable backend is reported, not failed
    table = format_matrix(skipped, 1e-5, layouts)
    assert "skipped" in table and "note: flash_attention_2: needs CUDA" in table


# ----------------------------------------------------------------------------------------------------------
# CUDA: the bf16 matrix
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", MODELS)
def test_invariance_matrix_bf16_cuda(name, probe_seqs, pad_id):
    from padless.attention import available_backends

    model = load_model(name, attn_implementation="varlen", dtype="bfloat16", device="cuda")
    backends = tuple(available_backends("cuda"))
    assert "varlen" in backends and "sdpa" in backends
    rows = run_matrix(model, probe_seqs, pad_id, backends=backends)
    tol = tolerance(torch.bfloat16)
    assert matrix_ok(rows, tol), format_matrix(rows, tol)
    deltas = [c.max_delta for r in rows for c in r.cells]
    assert deltas and all(math.isfinite(d) for d in deltas)
