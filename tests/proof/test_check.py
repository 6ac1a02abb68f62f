"""The invariance matrix: models x backends x layouts, per token, against each sequence run alone."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from padless.forward.attention import (
    VARLEN_NAME,
    attention_in_use,
    hf_name,
    runtime_context,
)
from padless.forward.varlen import (
    varlen_attention_forward,
)
from padless.proof.check import (
    LAYOUTS,
    BackendRow,
    Cell,
    ZooResult,
    alone_logps,
    failures,
    format_matrix,
    format_zoo,
    layout_logps,
    max_delta,
    probe_sequences,
    run_matrix,
    tree_case,
    tree_cell,
    zoo_failures,
)
from padless.proof.load import load_model
from padless.proof.probe import (
    bound,
    count_attention_calls,
)

MODELS = ("tiny-qwen2", "tiny-llama")
CPU_BACKENDS = ("varlen", "sdpa", "eager", "flex_attention")


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
def references(probe_seqs):
    """Per model: each probe sequence run alone through a plain forward on eager attention."""
    with torch.no_grad():
        return {
            name: alone_logps(load_model(name, attn_implementation="eager"), probe_seqs) for name in MODELS
        }


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
    reference = references[name]
    delta = per_token_delta(got, reference.logps)
    limit = bound(torch.float32, reference.magnitude)
    assert delta <= limit, f"{name} / {backend} / {layout}: max |delta log-prob| {delta:.3g} > {limit:.3g}"


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
    rows, limit = run_matrix(
        qwen2, probe_seqs, pad_id, backends=("varlen", "sdpa", "eager", "flash_attention_2")
    )
    # The model is handed back as it came: its backend and its mode.
    assert qwen2.padless_attention == "varlen" and attention_in_use(qwen2) == "varlen"
    assert qwen2.training
    qwen2.eval()

    with torch.no_grad():
        reference = alone_logps(qwen2, probe_seqs)
    # run_matrix's reference runs on eager, this one on varlen: the magnitudes agree to round-off
    assert limit == pytest.approx(bound(torch.float32, reference.magnitude), rel=1e-6)
    by_backend = {r.backend: r for r in rows}
    assert list(by_backend) == ["varlen", "sdpa", "eager", "flash_attention_2"]
    flash = by_backend["flash_attention_2"]
    assert (
        flash.unavailable is not None and "CUDA" in flash.unavailable and flash.cells == [] and not flash.ran
    )
    for backend, kernel in (("varlen", "sdpa"), ("sdpa", "sdpa"), ("eager", "eager")):
        row = by_backend[backend]
        assert row.ran and row.kernel == kernel
        assert [c.layout for c in row.cells] == list(LAYOUTS)
        for c in row.cells:
            assert c.ok and c.bound == limit and 0.0 <= c.max_delta <= limit, c
    assert failures(rows) == []  # flash_attention_2 is not on this machine: not requested by default
    assert failures(rows, requested=("varlen", "flash_attention_2")) == [
        "flash_attention_2 did not run: " + flash.unavailable
    ]
    # 'alone' on eager is the reference itself: bit-identical.
    assert by_backend["eager"].cells[0].max_delta == 0.0


def _leaky_varlen(module, query, key, value, attention_mask, **kwargs):
    for k in ("cu_seq_lens_q", "cu_seq_lens_k", "position_ids"):
        kwargs.pop(k, None)
    return varlen_attention_forward(module, query, key, value, attention_mask, **kwargs)


def test_a_leaking_kernel_is_refused_and_its_cells_would_show_it(qwen2, probe_seqs, pad_id, monkeypatch):
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, VARLEN_NAME, _leaky_varlen)
    (row,), limit = run_matrix(qwen2, probe_seqs, pad_id, backends=("varlen",))
    assert not row.ran and row.cells == []
    assert "leaks between packed sequences" in row.refused
    assert failures([row]) == [
        f"varlen did not run: {row.refused}",
        "nothing was checked: no requested backend ran",
    ]
    table = format_matrix([row])
    assert "refused" in table.splitlines()[2] and f"note: varlen: {row.refused}" in table
    # The cells see it on their own too: one sequence alone cannot leak, packed ones do.
    with torch.no_grad():
        reference = alone_logps(qwen2, probe_seqs)
        alone = layout_logps(qwen2, probe_seqs, "alone", pad_id)
        packed = layout_logps(qwen2, probe_seqs, "packed", pad_id)
    assert max_delta(alone, reference.logps) <= limit
    assert max_delta(packed, reference.logps) > 1e3 * limit


def test_a_sibling_leak_fails_the_tree_cells(qwen2, probe_seqs, sibling_leak):
    """``padless check``'s tree cells on a tree row whose second leaf also sees its sibling's keys: both the
    log-probs against each sequence alone and the gradient against the flat packed row leave their bound."""
    qwen2.eval()
    with torch.no_grad():
        case = tree_case(qwen2, probe_seqs, alone_logps)
        cell = tree_cell(qwen2, "varlen", case, "tree")
    grad = tree_cell(qwen2, "varlen", case, "tree-grad")
    assert not cell.ok and cell.max_delta > 100 * cell.bound, cell
    assert not grad.ok and grad.max_delta > 100 * grad.bound, grad


def _row(backend="sdpa", deltas=(1e-6, 2e-6), limit=1e-5, **kw):
    cells = [
        Cell(backend, lay, max_delta=d, bound=limit)
        for lay, d in zip(("left", "packed"), deltas, strict=True)
    ]
    return BackendRow(backend, kw.pop("kernel", "sdpa"), cells, **kw)


def test_failures_and_format():
    layouts = ("left", "packed")
    good = [_row("varlen"), _row("sdpa")]
    assert failures(good) == []
    table = format_matrix(good, layouts)
    data = table.splitlines()[2:4]
    assert [line.split()[0] for line in data] == ["varlen", "sdpa"]
    assert "2.0e-06 <= 1.0e-05" in data[1]  # the bound beside each cell
    assert "16 * eps(dtype) * max(M, 1)" in table  # and the formula under the table

    over = [_row("varlen"), _row("sdpa", deltas=(1e-6, 3e-5))]
    assert failures(over) == ["sdpa/packed: 3e-05 > bound 1e-05"]
    sdpa_line = next(line for line in format_matrix(over, layouts).splitlines() if line.startswith("sdpa"))
    assert "3.0e-05 >  1.0e-05" in sdpa_line

    errored = [_row("sdpa", deltas=(1e-6, 1e-6))]
    errored[0].cells[1] = Cell("sdpa", "packed", bound=1e-5, error="RuntimeError: boom")
    assert failures(errored) == ["sdpa/packed: RuntimeError: boom"]
    table = format_matrix(errored, layouts)
    assert "ERROR" in table and "note: sdpa/packed: RuntimeError: boom" in table

    refused = [_row("varlen"), BackendRow("sdpa", refused="ValueError: no sdpa for this model")]
    assert failures(refused) == []  # a refusal of another backend is a result: loading on it stops
    assert failures(refused, requested=("varlen", "sdpa")) == [
        "sdpa did not run: ValueError: no sdpa for this model"
    ]
    varlen_refused = [BackendRow("varlen", refused="AttentionError: leaks"), _row("sdpa")]
    assert failures(varlen_refused) == ["varlen did not run: AttentionError: leaks"]  # the training backend

    unavailable = [_row("varlen"), BackendRow("flash_attention_2", unavailable="needs CUDA")]
    assert failures(unavailable) == []  # not on this machine, not asked for: reported, not failed
    assert failures(unavailable, requested=("flash_attention_2",)) == [
        "flash_attention_2 did not run: needs CUDA",
    ]
    table = format_matrix(unavailable, layouts)
    assert "unavailable" in table and "note: flash_attention_2: needs CUDA" in table

    nothing = [BackendRow("flash_attention_2", unavailable="needs CUDA")]
    assert failures(nothing) == ["nothing was checked: no requested backend ran"]


def test_zoo_failures_and_table():
    ok = ZooResult(
        "llama3", "GQA", [_row("varlen"), BackendRow("sdpa", refused="ValueError: no. More text")], 1e-5
    )
    bad = ZooResult(
        "mistral", "window", [_row("varlen", deltas=(1e-6, 1.0)), BackendRow("sdpa", refused="x")], 1e-5
    )
    assert zoo_failures([ok]) == []  # a refusal is a result of the zoo, not a failure
    assert zoo_failures([ok, bad]) == ["mistral varlen/packed: 1 > bound 1e-05"]
    missing = ZooResult("llama3", "GQA", [BackendRow("flash_attention_2", unavailable="needs CUDA")], 1e-5)
    assert zoo_failures([missing]) == ["nothing was checked: no requested backend ran on any architecture"]
    assert zoo_failures([ok, missing], requested=("flash_attention_2",)) == [
        "flash_attention_2 is not on this machine: needs CUDA"
    ]
    none = ZooResult("bert", "", [], math.nan, no_config="TypeError: no tiny config. Details")
    assert [ok.verdict, bad.verdict, none.verdict] == ["exact", "FAILED", "no tiny config"]
    table = format_zoo([ok, bad, none]).splitlines()
    assert table[1].split()[:4] == ["llama3", "exact", "GQA", "1.0e-05"]
    assert table[1].split()[4:] == ["exact", "refused", "[1]"]
    assert table[2].split()[:2] == ["mistral", "FAILED"] and table[2].split()[4:] == [
        "FAILED",
        "refused",
        "[2]",
    ]
    assert table[3].split()[:5] == ["bert", "no", "tiny", "config", "[3]"]
    assert "3 architectures: 1 exact, 1 no tiny config, 1 FAILED" in table
    assert table[-3:] == ["[1] ValueError: no", "[2] x", "[3] TypeError: no tiny config"]
    markdown = format_zoo([ok], markdown=True).splitlines()
    assert (
        markdown[0] == "| architecture | verdict | what its tiny config exercises | bound | varlen | sdpa |"
    )
    assert markdown[2] == "| llama3 | exact | GQA | 1.0e-05 | exact | refused [1] |"


# ----------------------------------------------------------------------------------------------------------
# CUDA: the bf16 matrix
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", MODELS)
def test_invariance_matrix_bf16_cuda(name, probe_seqs, pad_id):
    from padless.forward.attention import available_backends

    model = load_model(name, attn_implementation="varlen", dtype="bfloat16", device="cuda")
    backends = tuple(available_backends("cuda"))
    assert "varlen" in backends and "sdpa" in backends
    rows, _ = run_matrix(model, probe_seqs, pad_id, backends=backends)
    assert failures(rows) == [], format_matrix(rows)


def test_a_crash_in_padless_is_a_failed_cell_not_a_missing_tiny_config(monkeypatch, probe_seqs, pad_id):
    """Only transformers failing to build or run a config is "no tiny config"; padless's own probe
    crashing (a bf16 Mamba head once did) is reported in the cells and fails the run."""
    import padless.proof.check as check

    def crash(model, backend, reference=None):
        raise RuntimeError("expected m1 and m2 to have the same dtype")

    monkeypatch.setattr(check, "prove_packing", crash)
    [result] = check.run_zoo(probe_seqs, pad_id, ("varlen",), ("qwen2",))
    assert result.no_config is None
    assert [c.layout for c in result.rows[0].cells] == list(check.LAYOUTS)
    assert any("the load-time probe crashed" in f for f in check.zoo_failures([result]))
