"""The varlen kernel: attention within each sequence, its arguments, its grouped and fused branches."""

from __future__ import annotations

import contextlib
import itertools
import math
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import padless.forward.attention as attention
import padless.forward.varlen as varlen
from padless.forward.attention import (
    VARLEN_NAME,
    AttentionError,
    pin_kernel,
    pinned,
)
from padless.forward.engine import forward_packed, forward_padded
from padless.forward.packing import Example, pack, to_padded
from padless.forward.varlen import (
    KERNEL_CALLS,
    SequenceGroups,
    padded_length,
    varlen_attention_forward,
)
from padless.proof.load import load_model
from padless.proof.probe import (
    bound,
    probe_attention,
)
from padless.tiny import tiny_config

FP32_TOL = 1e-5
CONTAMINATED = 0.05  # packed sequences that attend to each other move log-probs far more than this


# ----------------------------------------------------------------------------------------------------------
# The varlen function itself, against attention written out by hand
# ----------------------------------------------------------------------------------------------------------


def _naive(q, k, v, scale, window=None, causal=True, softcap=None, sinks=None):
    """One sequence written out in fp64: q ``[H, L, Dqk]``, k ``[Hkv, L, Dqk]``, v ``[Hkv, L, Dv]`` ->
    ``[L, H, Dv]``. Soft-cap on the scaled scores, sinks as one extra logit per head with a zero value
    (as transformers' eager kernels for Gemma 2 and gpt-oss write them)."""
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0).double(), v.repeat_interleave(rep, 0).double()
    scores = q.double() @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(q.shape[1])
    allowed = i[:, None] >= i[None] if causal else torch.ones(len(i), len(i), dtype=torch.bool)
    if window is not None:
        allowed &= i[:, None] - i[None] < window
    scores = scores.masked_fill(~allowed, -math.inf)
    if sinks is not None:
        column = sinks.double().reshape(-1, 1, 1).expand(-1, q.shape[1], 1)
        weights = torch.cat([scores, column], -1).softmax(-1)[..., :-1]
    else:
        weights = scores.softmax(-1)
    return (weights @ v).transpose(0, 1).float()


def _qkv(batch, length, heads=4, kv_heads=2, dim=8, seed=0, v_dim=None):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, dim, generator=gen)
    k = torch.randn(batch, kv_heads, length, dim, generator=gen)
    v = torch.randn(batch, kv_heads, length, v_dim or dim, generator=gen)
    return q, k, v


MODULE = torch.nn.Module()
LENS = (3, 9, 1, 6)


def _expected_packed(q, k, v, scale, window=None, **kwargs):
    out, start = [], 0
    for n in LENS:
        piece = slice(start, start + n)
        out.append(_naive(q[0, :, piece], k[0, :, piece], v[0, :, piece], scale, window, **kwargs))
        start += n
    return torch.cat(out)


CU = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("bounds", ["cu_seqlens", "position_ids"])
def test_varlen_function_packed_row(bounds):
    q, k, v = _qkv(1, sum(LENS))
    scale = 0.3
    if bounds == "cu_seqlens":
        cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
        kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 9, "max_length_k": 9}
    else:
        kwargs = {"position_ids": torch.cat([torch.arange(n) for n in LENS])[None]}
    out, weights = varlen_attention_forward(MODULE, q, k, v, None, scaling=scale, **kwargs)
    assert weights is None
    assert out.shape == (1, sum(LENS), 4, 8)
    torch.testing.assert_close(out[0], _expected_packed(q, k, v, scale), rtol=0, atol=1e-5)


def test_varlen_function_sliding_window():
    q, k, v = _qkv(1, sum(LENS), seed=1)
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    out, _ = varlen_attention_forward(MODULE, q, k, v, None, scaling=0.5, sliding_window=4, cu_seq_lens_q=cu)
    want = _expected_packed(q, k, v, 0.5, window=4)
    torch.testing.assert_close(out[0], want, rtol=0, atol=1e-5)
    # The window matters here: without it the 9- and 6-token sequences come out different.
    assert (want - _expected_packed(q, k, v, 0.5)).abs().max() > 1e-2


def test_varlen_function_padded_rows():
    q, k, v = _qkv(2, 7, seed=2)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]])  # left- and right-padded rows
    out, _ = varlen_attention_forward(MODULE, q, k, v, mask.bool(), scaling=0.25)
    torch.testing.assert_close(
        out[0, 3:], _naive(q[0, :, 3:], k[0, :, 3:], v[0, :, 3:], 0.25), rtol=0, atol=1e-5
    )
    torch.testing.assert_close(
        out[1, :5], _naive(q[1, :, :5], k[1, :, :5], v[1, :, :5], 0.25), rtol=0, atol=1e-5
    )
    assert (out[0, :3] == 0).all() and (out[1, 5:] == 0).all()


def test_varlen_function_refusals():
    q, k, v = _qkv(2, 6)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(AttentionError, match="one packed row"):
        varlen_attention_forward(MODULE, q, k, v, None, cu_seq_lens_q=cu)
    with pytest.raises(AttentionError, match="holes"):
        varlen_attention_forward(MODULE, q, k, v, torch.tensor([[1, 1, 0, 1, 1, 1]] * 2).bool())
    with pytest.raises(AttentionError, match="no KV cache"):
        varlen_attention_forward(MODULE, q[:, :, :1], k, v, None)


def _spans(lengths) -> list[tuple[int, int, int]]:
    return [(0, s, e) for s, e in itertools.pairwise([0, *itertools.accumulate(lengths)])]


def test_padded_lengths():
    assert [padded_length(n) for n in (1, 8, 9, 64, 65, 128, 129, 300, 513)] == [
        8, 8, 16, 64, 72, 128, 144, 320, 576
    ]  # fmt: skip
    assert all(n <= padded_length(n) <= max(n + 7, n * 9 // 8) for n in range(1, 5000))


def test_sequence_groups_one_call_per_padded_length():
    cpu = torch.device("cpu")
    similar = SequenceGroups.plan(_spans([60, 64, 62, 64]), 1, 250, cpu)
    assert similar.shapes == ((4, 64),) and similar.covered and similar.padded
    ragged = SequenceGroups.plan(_spans([5, 300, 5, 6]), 1, 316, cpu)
    assert ragged.shapes == ((1, 320), (3, 8))
    assert not SequenceGroups.plan(_spans([8] * 5), 1, 40, cpu).padded
    # A padding slot repeats its sequence's last token and belongs to no position.
    small = SequenceGroups.plan(_spans([2, 3]), 1, 5, cpu)
    assert small.shapes == ((2, 8),)
    assert small.slots.tolist() == [0, 1, *[1] * 6, 2, 3, 4, *[4] * 5]
    assert small.owner.tolist() == [0, 1, *[5] * 6, 2, 3, 4, *[5] * 5]
    assert small.back.tolist() == [0, 1, 8, 9, 10]
    # Padded rows: positions outside every sequence read the zero slot past the end.
    rows = SequenceGroups.plan([(0, 3, 7), (1, 0, 5)], 2, 7, cpu)
    assert rows.shapes == ((2, 8),) and not rows.covered
    assert [rows.back[i].item() for i in (0, 1, 2, 12, 13)] == [16] * 5


def test_grouped_attention_of_a_sequence_does_not_depend_on_its_batch():
    """Bit for bit: a sequence's outputs and q, k, v gradients are the same alone and among others of
    other lengths (its padded length depends on its own length only)."""
    gen = torch.Generator().manual_seed(12)
    mine = [torch.randn(1, h, 37, 8, generator=gen) for h in (4, 2, 2)]
    results = []
    for others in ([], [5, 70], [37, 1, 36]):
        lengths = [37, *others]
        q, k, v = (
            torch.cat([m, torch.randn(1, m.shape[1], sum(others), 8, generator=gen)], 2).requires_grad_()
            for m in mine
        )
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        out, _ = varlen_attention_forward(MODULE, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu)
        grads = torch.autograd.grad(out[:, :37].square().sum(), (q, k, v))
        results.append([out[:, :37], *(g[:, :, :37] for g in grads)])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


@pytest.mark.parametrize(
    "extra",
    [{}, {"sliding_window": 4}, {"softcap": 1.5, "s_aux": torch.tensor([0.5, -1.0, 2.0, 0.0])}],
    ids=["causal", "window", "softcap+sinks"],
)
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_grouped_attention_gradients_match_each_sequence_written_out(layout, extra):
    """Sequences padded within their group (LENS, 3 to 9 tokens, padded to 8 and 16; padded rows: 4 and
    5 tokens padded to 8, and positions with no sequence): forward and q, k, v gradients equal each
    sequence's attention written out in fp64."""
    window, softcap, sinks = extra.get("sliding_window"), extra.get("softcap"), extra.get("s_aux")
    if layout == "packed":
        q, k, v = (t.requires_grad_() for t in _qkv(1, sum(LENS), seed=9))
        kwargs = {"cu_seq_lens_q": CU.clone()}
        spans, mask = _spans(LENS), None
    else:
        q, k, v = (t.requires_grad_() for t in _qkv(2, 7, seed=10))
        mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]]).bool()
        kwargs, spans = {}, [(0, 3, 7), (1, 0, 5)]
    assert SequenceGroups.plan(spans, q.shape[0], q.shape[2], q.device).padded
    out, _ = varlen_attention_forward(MODULE, q * 3, k, v, mask, scaling=0.4, **extra, **kwargs)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(11))
    got = torch.autograd.grad((out * weights).sum(), (q, k, v))
    want_out = torch.zeros_like(out)
    for row, start, end in spans:
        piece = slice(start, end)
        want_out[row, piece] = _naive(
            q[row, :, piece] * 3, k[row, :, piece], v[row, :, piece], 0.4, window, True, softcap, sinks
        )
    want = torch.autograd.grad((want_out * weights).sum(), (q, k, v))
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-5)
    for g, w, name in zip(got, want, "qkv", strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5, msg=name)


HOST_CONVERSIONS = (
    "tolist",
    "item",
    "cpu",
    "numpy",
    "nonzero",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
)


@contextlib.contextmanager
def _host_conversions() -> Iterator[Counter[str]]:
    """Count tensor-to-host conversions (on CUDA each waits for the GPU): ``inside`` the varlen attention
    function, and ``total`` apart from the CPU stand-ins of the fused kernels (which read the bounds
    themselves where the real kernels read them on the GPU)."""
    counts: Counter[str] = Counter()
    inside = [False]

    def counted(original):
        def wrapper(*args, **kwargs):
            if not sys._getframe(1).f_code.co_filename.endswith("testing/kernels.py"):
                counts["inside"] += inside[0]
                counts["total"] += 1
            return original(*args, **kwargs)

        return wrapper

    def attention_function(*args, **kwargs):
        inside[0] = True
        try:
            return varlen_attention_forward(*args, **kwargs)
        finally:
            inside[0] = False

    with contextlib.ExitStack() as stack:
        for name in HOST_CONVERSIONS:
            stack.enter_context(mock.patch.object(torch.Tensor, name, counted(getattr(torch.Tensor, name))))
        for name in ("equal", "nonzero"):
            stack.enter_context(mock.patch.object(torch, name, counted(getattr(torch, name))))
        mapping = ALL_ATTENTION_FUNCTIONS._global_mapping
        stack.enter_context(mock.patch.dict(mapping, {VARLEN_NAME: attention_function}))
        yield counts


@pytest.mark.parametrize("kernel", ["sdpa", "torch", "flash_attn"])
def test_varlen_converts_nothing_to_host_inside_layers(kernel, probe_seqs):
    """The packed row's bounds are read to the host once per batch (model_inputs) and every layer reuses
    them, on the exact path and on the fused kernels' branch. Over a training forward and backward the
    attention function converts nothing, and a model twice as deep converts no more in all."""
    from padless.testing.kernels import fused_kernels_on_cpu

    totals = {}
    for layers in (2, 4):
        config = tiny_config("tiny-qwen2")
        config.num_hidden_layers = layers
        model = AutoModelForCausalLM.from_config(config, attn_implementation=VARLEN_NAME).train()
        model.padless_attention = "varlen"
        batch = pack([Example(s) for s in probe_seqs])
        fused = fused_kernels_on_cpu(FP32_ONLY) if kernel != "sdpa" else contextlib.nullcontext()
        before = KERNEL_CALLS[f"varlen:{kernel}"]
        with fused:
            pin_kernel(model, kernel)
            with _host_conversions() as counts:
                forward_packed(model, batch).logps.sum().backward()
        assert KERNEL_CALLS[f"varlen:{kernel}"] - before == layers
        assert counts["inside"] == 0
        totals[layers] = counts["total"]
    assert totals[2] == totals[4] <= 3, totals  # the bounds, the head's labelled rows, one in transformers


class _Attention(torch.nn.Module):
    """Stands in for a transformers attention layer: what varlen reads from the module it is given."""

    def __init__(self, is_causal: bool = True, model_type: str = "toy"):
        super().__init__()
        self.is_causal = is_causal
        self.config = type("Config", (), {"model_type": model_type})()


def test_varlen_function_softcap():
    q, k, v = _qkv(1, sum(LENS), seed=3)
    q = q * 3  # scores well beyond the cap
    out, _ = varlen_attention_forward(MODULE, q, k, v, None, scaling=0.5, softcap=2.0, cu_seq_lens_q=CU)
    want = _expected_packed(q, k, v, 0.5, softcap=2.0)
    torch.testing.assert_close(out[0], want, rtol=0, atol=1e-5)
    assert (want - _expected_packed(q, k, v, 0.5)).abs().max() > 1e-2  # dropping it would show


def test_varlen_function_sinks():
    q, k, v = _qkv(1, sum(LENS), seed=4)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out, _ = varlen_attention_forward(MODULE, q, k, v, None, scaling=0.3, s_aux=sinks, cu_seq_lens_q=CU)
    want = _expected_packed(q, k, v, 0.3, sinks=sinks)
    torch.testing.assert_close(out[0], want, rtol=0, atol=1e-5)
    assert (want - _expected_packed(q, k, v, 0.3)).abs().max() > 1e-2


def test_varlen_function_sinks_softcap_and_window_together():
    q, k, v = _qkv(1, sum(LENS), seed=5)
    sinks = torch.tensor([1.0, 0.0, -0.5, 0.2])
    out, _ = varlen_attention_forward(
        MODULE, q * 3, k, v, None, scaling=0.4, softcap=1.5, s_aux=sinks, sliding_window=3, cu_seq_lens_q=CU
    )
    want = _expected_packed(q * 3, k, v, 0.4, window=3, softcap=1.5, sinks=sinks)
    torch.testing.assert_close(out[0], want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("how", ["kwarg", "module"])
def test_varlen_function_bidirectional(how):
    q, k, v = _qkv(1, sum(LENS), seed=6)
    module, kwargs = (MODULE, {"is_causal": False}) if how == "kwarg" else (_Attention(is_causal=False), {})
    out, _ = varlen_attention_forward(module, q, k, v, None, scaling=0.3, cu_seq_lens_q=CU, **kwargs)
    want = _expected_packed(q, k, v, 0.3, causal=False)
    torch.testing.assert_close(out[0], want, rtol=0, atol=1e-5)
    assert (want - _expected_packed(q, k, v, 0.3)).abs().max() > 1e-2
    # The kwarg wins over the module's attribute, as in transformers' own kernels.
    out, _ = varlen_attention_forward(
        _Attention(is_causal=False), q, k, v, None, scaling=0.3, is_causal=True, cu_seq_lens_q=CU
    )
    torch.testing.assert_close(out[0], _expected_packed(q, k, v, 0.3), rtol=0, atol=1e-5)


def test_varlen_function_mla_head_sizes_on_padded_rows():
    """Value heads narrower than query heads (DeepSeek MLA): output and padding take the value's width."""
    q, k, v = _qkv(2, 7, heads=4, kv_heads=4, dim=24, v_dim=8, seed=7)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]]).bool()
    out, _ = varlen_attention_forward(MODULE, q, k, v, mask, scaling=0.2)
    assert out.shape == (2, 7, 4, 8)
    torch.testing.assert_close(
        out[0, 3:], _naive(q[0, :, 3:], k[0, :, 3:], v[0, :, 3:], 0.2), rtol=0, atol=1e-5
    )
    torch.testing.assert_close(
        out[1, :5], _naive(q[1, :, :5], k[1, :, :5], v[1, :, :5], 0.2), rtol=0, atol=1e-5
    )
    assert (out[0, :3] == 0).all() and (out[1, 5:] == 0).all()


def test_varlen_function_default_scale_is_the_query_head_size():
    q, k, v = _qkv(1, sum(LENS), heads=2, kv_heads=2, dim=24, v_dim=8, seed=8)
    out, _ = varlen_attention_forward(MODULE, q, k, v, None, cu_seq_lens_q=CU)
    torch.testing.assert_close(out[0], _expected_packed(q, k, v, 24**-0.5), rtol=0, atol=1e-5)


def test_varlen_function_refuses_what_it_does_not_implement():
    q, k, v = _qkv(1, sum(LENS))
    layer = _Attention(model_type="t5")
    with pytest.raises(AttentionError, match=r"_Attention \(t5\) passes alibi_slopes, position_bias to its"):
        varlen_attention_forward(layer, q, k, v, None, position_bias=1, alibi_slopes=2, cu_seq_lens_q=CU)
    with pytest.raises(AttentionError, match="output_attentions=True"):
        varlen_attention_forward(layer, q, k, v, None, output_attentions=True, cu_seq_lens_q=CU)
    with pytest.raises(AttentionError, match="bidirectional sliding-window"):
        varlen_attention_forward(layer, q, k, v, None, sliding_window=4, is_causal=False, cu_seq_lens_q=CU)
    with pytest.raises(AttentionError, match="sinks of shape"):
        varlen_attention_forward(layer, q, k, v, None, s_aux=torch.zeros(2), cu_seq_lens_q=CU)
    with pytest.raises(AttentionError, match="cu_seq_lens_k differs"):
        varlen_attention_forward(layer, q, k, v, None, cu_seq_lens_q=CU, cu_seq_lens_k=CU.flip(0))
    with pytest.raises(AttentionError, match="takes a 2D padding mask, got a 4D mask"):
        varlen_attention_forward(layer, q, k, v, torch.ones(1, 1, sum(LENS), sum(LENS)).bool())
    # Flags of the forward that change nothing are accepted.
    out, _ = varlen_attention_forward(
        layer,
        q,
        k,
        v,
        None,
        use_cache=False,
        output_attentions=False,
        output_router_logits=False,
        logits_to_keep=0,  # the head's argument, handed down by LLaVA-OneVision-style wrappers
        encoder_hidden_states=None,  # an argument given as None asks for nothing (BERT-style decoders)
        cu_seq_lens_q=CU,
    )
    torch.testing.assert_close(out[0], _expected_packed(q, k, v, 8**-0.5), rtol=0, atol=1e-5)


def _with_extra_kwarg(module, query, key, value, attention_mask, **kwargs):
    return varlen_attention_forward(module, query, key, value, attention_mask, alibi_slopes=2.0, **kwargs)


def test_unknown_attention_argument_stops_at_load_time(monkeypatch):
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, VARLEN_NAME, _with_extra_kwarg)
    with pytest.raises(AttentionError, match=r"LlamaAttention \(llama\) passes alibi_slopes"):
        load_model("tiny-llama", attn_implementation="varlen")


# ----------------------------------------------------------------------------------------------------------
# The fused branch on CPU, through stand-ins written from the kernels' contracts (padless.testing.kernels)
# ----------------------------------------------------------------------------------------------------------

FP32_ONLY = (torch.float32,)
# What each zoo architecture puts through the fused branch.
FUSED_ARCHS = {
    "qwen2": "GQA 4:2",
    "mistral": "sliding window",
    "gemma2": "soft-cap",
    "deepseek-v3": "MLA head sizes",
    "gemma3-bidirectional": "bidirectional",
}


@pytest.fixture(scope="module")
def zoo_varlen() -> dict[str, torch.nn.Module]:
    from padless.proof.zoo import build_zoo_model

    models = {}
    for name in FUSED_ARCHS:
        models[name] = build_zoo_model(name, VARLEN_NAME)
        models[name].padless_attention = "varlen"
    return models


def _logps_and_grads(model, seqs, layout, pad_id) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token log-probs of the real tokens in ``layout`` and the gradient of their sum, per parameter."""
    model.zero_grad()
    batch = pack([Example(s) for s in seqs])
    if layout == "packed":
        logps = forward_packed(model, batch).logps
    else:
        padded = to_padded(batch, layout, pad_id)
        logps = forward_padded(model, padded)[padded.attention_mask.bool()]
    logps.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logps.detach(), grads


@pytest.fixture(scope="module")
def exact_results(zoo_varlen, probe_seqs, pad_id):
    """The exact per-sequence path's log-probs and gradients, per (architecture, layout)."""
    cache = {}

    def get(name, layout):
        if (name, layout) not in cache:
            with pinned(zoo_varlen[name], "sdpa"):
                cache[name, layout] = _logps_and_grads(zoo_varlen[name], probe_seqs, layout, pad_id)
        return cache[name, layout]

    return get


def _fused_cases():
    for kernel in ("torch", "flash_attn"):
        for name, what in FUSED_ARCHS.items():
            if kernel == "torch" and name == "gemma2":
                continue  # varlen_attn has no soft-cap: refused, see the test below
            for layout in ("packed", "left", "right"):
                yield pytest.param(kernel, name, layout, id=f"{kernel}-{name}-{what}-{layout}")


@pytest.mark.parametrize(("kernel", "name", "layout"), list(_fused_cases()))
def test_fused_branch_forward_and_backward_match_exact(
    kernel, name, layout, zoo_varlen, exact_results, probe_seqs, pad_id
):
    """The fused branch (packing padded rows, head-size padding, window and causal mapping, GQA,
    soft-cap) through a whole model, forward and backward, equals the exact path to fp32 round-off."""
    from padless.testing.kernels import fused_kernels_on_cpu

    model = zoo_varlen[name]
    want_logps, want_grads = exact_results(name, layout)
    before = KERNEL_CALLS[f"varlen:{kernel}"]
    with fused_kernels_on_cpu(FP32_ONLY), pinned(model, kernel):
        logps, grads = _logps_and_grads(model, probe_seqs, layout, pad_id)
    assert KERNEL_CALLS[f"varlen:{kernel}"] - before == model.config.num_hidden_layers  # every layer fused
    assert (logps - want_logps).abs().max() <= bound(torch.float32, want_logps.abs().max())
    assert grads.keys() == want_grads.keys()
    for param, want in want_grads.items():
        # Measured: at most 8.8 eps * max|grad| (MLA, whose head sizes the fused branch pads).
        assert (grads[param] - want).abs().max() <= bound(torch.float32, want.abs().max()), param


def _varlen_attn_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1)):  # fmt: skip
    """PyTorch 2.11's ``varlen_attn`` signature (no ``enable_gqa``: equal head counts only), seen failing on
    an H200 when padless passed it ``enable_gqa``."""
    from padless.testing.kernels import reference_varlen_attn

    return reference_varlen_attn(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size,
        dtypes=FP32_ONLY,
    )  # fmt: skip


def _varlen_attn_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False,
                     return_aux=None, scale=None):  # fmt: skip
    """PyTorch 2.10's signature: causal or not, no window."""
    raise AssertionError("padless must not call a varlen_attn without window_size")


def test_torch_kernel_of_each_pytorch_version(zoo_varlen, exact_results, probe_seqs, pad_id):
    """GQA through PyTorch 2.11's varlen_attn (no enable_gqa) repeats the kv heads and equals the exact
    path; 2.10's (no window_size) is not picked by auto and, pinned, refused with the upgrade."""
    import torch.nn.attention.varlen as torch_varlen

    from padless.testing.kernels import fused_kernels_on_cpu

    want_logps, _ = exact_results("qwen2", "packed")
    with (
        fused_kernels_on_cpu(FP32_ONLY),
        mock.patch.object(torch_varlen, "varlen_attn", _varlen_attn_2_11),
        pinned(zoo_varlen["qwen2"], "torch"),
    ):
        logps, _ = _logps_and_grads(zoo_varlen["qwen2"], probe_seqs, "packed", pad_id)
    assert (logps - want_logps).abs().max() <= bound(torch.float32, want_logps.abs().max())
    with mock.patch.object(torch_varlen, "varlen_attn", _varlen_attn_2_10):
        assert not attention.torch_varlen_available()
        with mock.patch.object(attention, "flash_attn_installed", lambda: False):
            assert attention.varlen_kernel(torch.device("cuda"), torch.bfloat16) == "sdpa"
        assert "PyTorch >= 2.11" in attention.varlen_kernel_problem("torch", torch.device("cuda"))


def test_fused_branch_in_bf16_with_the_kernels_own_dtype_checks(probe_seqs, pad_id):
    from padless.proof.check import alone_logps, layout_logps
    from padless.proof.zoo import build_zoo_model
    from padless.testing.kernels import fused_kernels_on_cpu

    model = build_zoo_model("qwen2", VARLEN_NAME, dtype=torch.bfloat16)
    model.padless_attention = "varlen"
    with torch.no_grad():
        exact = alone_logps(model, probe_seqs)
        for kernel in ("torch", "flash_attn"):
            with fused_kernels_on_cpu(), pinned(model, kernel):  # fp16/bf16 only, as the real kernels
                assert probe_attention(model, "varlen")["kernel"] == kernel
                for layout in ("left", "right", "packed"):
                    got = layout_logps(model, probe_seqs, layout, pad_id)
                    delta = max((g - w).abs().max().item() for g, w in zip(got, exact.logps, strict=True))
                    assert delta <= bound(torch.bfloat16, exact.magnitude), (kernel, layout)
    model32 = build_zoo_model("qwen2", VARLEN_NAME)
    model32.padless_attention = "varlen"
    pin_kernel(model32, "torch")
    with fused_kernels_on_cpu(), pytest.raises(AttentionError, match="runs fp16/bf16 only"):
        probe_attention(model32, "varlen")


def _two_engines_in_two_threads(probe_seqs, process_pin: dict[str, str] | None = None) -> dict[str, Any]:
    """Two engines on two copies of tiny-qwen2, one pinned to each fused kernel (their CPU stand-ins), each
    running a packed forward and backward (gradient checkpointing: the backward recomputes every layer's
    attention) in a thread of its own. The threads start their passes together and take turns at every
    kernel call (a barrier inside the kernels), so each pass runs while the other is half-way through
    its own. Returns what each thread's kernel calls ran and each engine's log-probs and gradients.

    ``process_pin`` plants the design this replaced: the kernel read from process state that each thread
    sets before its pass."""
    import torch.nn.attention.varlen as torch_varlen

    from padless.forward.engine import EngineSettings, ModelEngine
    from padless.testing.kernels import fused_kernels_on_cpu

    kernels = ("torch", "flash_attn")
    batch = pack([Example(s) for s in probe_seqs])
    barrier = threading.Barrier(len(kernels), timeout=120)
    ran: dict[str, list[str]] = {kernel: [] for kernel in kernels}
    out: dict[str, Any] = {}

    def recorded(kernel: str, run: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> torch.Tensor:
            ran[threading.current_thread().name].append(kernel)
            barrier.wait()  # the other thread is inside its pass too
            return run(*args, **kwargs)

        return call

    def train(engine: ModelEngine, kernel: str) -> None:
        if process_pin is not None:
            process_pin["kernel"] = kernel
        barrier.wait()
        logps = engine(batch, logps=True).logps
        logps.sum().backward()
        grads = {n: p.grad for n, p in engine.named_parameters() if p.grad is not None}
        out[kernel] = (logps.detach(), grads)

    engines = {}
    for kernel in kernels:
        model = load_model("tiny-qwen2", training=True, probe=False)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        engines[kernel] = ModelEngine(model, settings=EngineSettings(varlen_kernel=kernel))
    with contextlib.ExitStack() as stack:
        stack.enter_context(fused_kernels_on_cpu(FP32_ONLY))
        flash = sys.modules["flash_attn"]
        run_torch, run_flash = torch_varlen.varlen_attn, flash.flash_attn_varlen_func
        stack.enter_context(mock.patch.object(torch_varlen, "varlen_attn", recorded("torch", run_torch)))
        stack.enter_context(
            mock.patch.object(flash, "flash_attn_varlen_func", recorded("flash_attn", run_flash))
        )
        if process_pin is not None:
            stack.enter_context(
                mock.patch.object(attention, "kernel_of", lambda module: process_pin["kernel"])
            )
        threads = [threading.Thread(target=train, args=(engines[k], k), name=k, daemon=True) for k in kernels]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
    return {"ran": ran, "out": out, "layers": engines["torch"].config.num_hidden_layers}


def test_two_engines_in_two_threads_each_run_their_own_kernel(probe_seqs):
    """The kernel travels with the engine's model, not through process state: two engines pinned to
    different kernels, interleaved in two threads (a sampler beside a trainer), each run the kernel they
    were given in every attention call of their forward and of the backward that recomputes it, and both
    compute the same numbers (same weights, two exact kernels: fp32 round-off apart)."""
    got = _two_engines_in_two_threads(probe_seqs)
    calls = 2 * got["layers"]  # each layer in the forward, and again recomputed in the backward
    assert got["ran"] == {"torch": ["torch"] * calls, "flash_attn": ["flash_attn"] * calls}
    (logps, grads), (other_logps, other_grads) = got["out"]["torch"], got["out"]["flash_attn"]
    assert (logps - other_logps).abs().max() <= bound(torch.float32, logps.abs().max())
    assert grads.keys() == other_grads.keys() and grads
    for name, grad in grads.items():
        assert (grad - other_grads[name]).abs().max() <= bound(torch.float32, grad.abs().max()), name


def test_a_kernel_read_from_process_state_mixes_the_two_threads(probe_seqs):
    """The check above catches the design it replaced: with the kernel read from process state that each
    thread sets before its pass, the thread that set it first runs the other's kernel."""
    ran = _two_engines_in_two_threads(probe_seqs, process_pin={})["ran"]
    assert len({kernel for calls in ran.values() for kernel in calls}) == 1  # the last one set, for both
    assert any(set(calls) != {kernel} for kernel, calls in ran.items())


def _args(**kw):
    base = {"scale": 0.1, "causal": True, "window": None, "softcap": None, "sinks": None, "dropout": 0.0}
    return varlen.AttentionArgs(**{**base, **kw})


def test_what_each_fused_kernel_lacks():
    lacks = varlen.fused_kernel_lacks
    assert (
        lacks("torch", _args(), 128) is None
        and lacks("flash_attn", _args(window=8, causal=False), 256) is None
    )
    assert lacks("flash_attn", _args(softcap=50.0, dropout=0.1), 128) is None
    assert lacks("torch", _args(softcap=50.0), 128) == "attention soft-capping (softcap)"
    assert lacks("torch", _args(dropout=0.1), 128) == "attention dropout"
    for kernel in ("torch", "flash_attn"):
        assert lacks(kernel, _args(sinks=torch.zeros(4)), 64) == "attention sinks (s_aux)"
        assert lacks(kernel, _args(), 512) == "head size 512 (at most 256)"


def test_pinned_fused_kernel_refuses_what_it_lacks():
    from padless.proof.zoo import build_zoo_model
    from padless.testing.kernels import fused_kernels_on_cpu

    for kernel, name, lacking in (
        ("torch", "gemma2", "attention soft-capping"),
        ("flash_attn", "gpt-oss", "attention sinks"),
    ):
        model = build_zoo_model(name, VARLEN_NAME)
        model.padless_attention = "varlen"
        pin_kernel(model, kernel)
        with (
            fused_kernels_on_cpu(FP32_ONLY),
            pytest.raises(AttentionError, match=f"varlen kernel '{kernel}' has no {lacking}"),
        ):
            probe_attention(model, "varlen")


def test_auto_runs_what_the_fused_kernel_lacks_exactly_and_says_so(monkeypatch, caplog, probe_seqs, pad_id):
    """gpt-oss's sinks on CUDA: auto picks the fused kernel, which has no sinks, so those layers run the
    exact path and one log line says so (never a silent drop)."""
    from padless.proof.check import alone_logps, layout_logps
    from padless.proof.zoo import build_zoo_model

    model = build_zoo_model("gpt-oss", VARLEN_NAME)
    model.padless_attention = "varlen"
    monkeypatch.setattr(
        attention, "varlen_kernel", lambda device, dtype, choice: "flash_attn"
    )  # what CUDA bf16 picks
    monkeypatch.setattr(varlen, "_logged", set())
    before = dict(KERNEL_CALLS)
    with torch.no_grad(), caplog.at_level("WARNING", logger="padless.forward.varlen"):
        packed = layout_logps(model, probe_seqs, "packed", pad_id)
    assert KERNEL_CALLS["varlen:sdpa"] - before.get("varlen:sdpa", 0) == model.config.num_hidden_layers
    assert KERNEL_CALLS["varlen:flash_attn"] == before.get("varlen:flash_attn", 0)
    lines = [r.getMessage() for r in caplog.records if "has no attention sinks" in r.getMessage()]
    assert lines == [
        "varlen: flash_attn has no attention sinks (s_aux) (GptOssAttention (gpt_oss)): those layers run "
        "exact per-sequence attention instead"
    ]  # once, not once per layer
    model.set_attn_implementation("eager")
    with torch.no_grad():
        reference = alone_logps(model, probe_seqs)
    delta = max((g - w).abs().max().item() for g, w in zip(packed, reference.logps, strict=True))
    assert delta <= bound(torch.float32, reference.magnitude)


# ----------------------------------------------------------------------------------------------------------
# CUDA: the fused varlen kernels in bf16
# ----------------------------------------------------------------------------------------------------------


def _kernel_params():
    return [
        pytest.param(
            "torch",
            marks=pytest.mark.skipif(
                not attention.torch_varlen_available(), reason="needs torch.nn.attention.varlen"
            ),
        ),
        pytest.param(
            "flash_attn",
            marks=pytest.mark.skipif(not attention.flash_attn_installed(), reason="flash-attn not installed"),
        ),
    ]


@pytest.mark.parametrize("kernel", _kernel_params())
@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_varlen_fused_kernel_bf16_matches_alone(name, kernel, probe_seqs, pad_id, per_token_delta):
    from padless.proof.check import alone_logps, layout_logps
    from padless.proof.probe import bound

    model = load_model(
        name, attn_implementation="varlen", dtype="bfloat16", device="cuda", varlen_kernel=kernel
    )
    info = probe_attention(model, "varlen")
    assert info["kernel"] == kernel
    before = KERNEL_CALLS[f"varlen:{kernel}"]
    with torch.no_grad():
        alone = alone_logps(model, probe_seqs)
        for layout in ("left", "right", "packed"):
            got = layout_logps(model, probe_seqs, layout, pad_id)
            assert per_token_delta(got, alone.logps) <= bound(torch.bfloat16, alone.magnitude), layout
    assert KERNEL_CALLS[f"varlen:{kernel}"] > before


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_varlen_auto_kernel_on_cuda():
    model = load_model("tiny-qwen2", attn_implementation="varlen", dtype="bfloat16", device="cuda")
    expected = "flash_attn" if attention.flash_attn_installed() else "torch"
    assert probe_attention(model, "varlen")["kernel"] == expected
    model32 = load_model("tiny-qwen2", attn_implementation="varlen", device="cuda")
    assert probe_attention(model32, "varlen")["kernel"] == "sdpa"


def test_sdpa_reference_agrees_with_naive():
    """Sanity of the hand-written reference used above (so a wrong reference cannot pass silently)."""
    q, k, v = _qkv(1, 5, heads=2, kv_heads=2)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.4)[0].transpose(0, 1)
    torch.testing.assert_close(_naive(q[0], k[0], v[0], 0.4), want, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------
# Llama 4: chunked attention and query temperature per sequence
# ----------------------------------------------------------------------------------------------------------


class _Llama4Layer(torch.nn.Module):
    """What varlen reads from a Llama 4 attention layer: its kind (config.layer_types at layer_idx), the
    chunk size, and for NoPE layers the query temperature settings."""

    def __init__(self, kind: str, chunk: int = 4, use_rope: bool = True, floor_scale: int = 8):
        super().__init__()
        self.config = type(
            "Config", (), {"model_type": "llama4_text", "layer_types": [kind], "attention_chunk_size": chunk}
        )()
        self.layer_idx = 0
        self.is_causal = True
        self.use_rope = use_rope
        self.attn_temperature_tuning = True
        self.floor_scale = floor_scale
        self.attn_scale = 0.1


def _expected_chunked(q, k, v, scale, chunk):
    """Each sequence of LENS cut into chunks counted from its first token, each chunk attended alone."""
    out, start = [], 0
    for n in LENS:
        for c in range(start, start + n, chunk):
            piece = slice(c, min(c + chunk, start + n))
            out.append(_naive(q[0, :, piece], k[0, :, piece], v[0, :, piece], scale))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("kernel", ["sdpa", "torch", "flash_attn"])
def test_chunked_attention_attends_within_chunks_of_each_sequence(kernel):
    """Llama 4's chunked layers in a packed row: chunks start at each sequence's first token, on the exact
    path and on the fused kernels' branch (their stand-ins), whose cu_seqlens become the chunks'."""
    from padless.testing.kernels import fused_kernels_on_cpu

    q, k, v = _qkv(1, sum(LENS), seed=7)
    fused = fused_kernels_on_cpu(FP32_ONLY) if kernel != "sdpa" else contextlib.nullcontext()
    chunked_layer, whole_layer = _Llama4Layer("chunked_attention"), _Llama4Layer("full_attention")
    pin_kernel(chunked_layer, kernel)
    pin_kernel(whole_layer, kernel)
    with fused:
        chunked, _ = varlen_attention_forward(chunked_layer, q, k, v, None, scaling=0.4, cu_seq_lens_q=CU)
        whole, _ = varlen_attention_forward(whole_layer, q, k, v, None, scaling=0.4, cu_seq_lens_q=CU)
    torch.testing.assert_close(chunked[0], _expected_chunked(q, k, v, 0.4, 4), rtol=0, atol=1e-5)
    torch.testing.assert_close(whole[0], _expected_packed(q, k, v, 0.4), rtol=0, atol=1e-5)
    assert (chunked - whole).abs().max() > 1e-2  # the 9- and 6-token sequences span chunks


def test_chunked_attention_on_padded_rows_counts_chunks_from_the_first_real_token():
    q, k, v = _qkv(2, 7, seed=8)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0]])
    out, _ = varlen_attention_forward(_Llama4Layer("chunked_attention", chunk=3), q, k, v, mask.bool())
    for row, (s, e) in enumerate([(2, 7), (0, 6)]):
        want = torch.cat(
            [
                _naive(
                    q[row, :, c : min(c + 3, e)],
                    k[row, :, c : min(c + 3, e)],
                    v[row, :, c : min(c + 3, e)],
                    8**-0.5,
                )
                for c in range(s, e, 3)
            ]
        )
        torch.testing.assert_close(out[row, s:e], want, rtol=0, atol=1e-5)


def test_llama4_query_temperature_is_taken_at_the_place_in_each_sequence():
    """A NoPE layer scaled each query by its place in the row (transformers' arange); varlen moves the scale
    to the place in its sequence: the result is each sequence alone, scaled as it scales alone."""
    layer = _Llama4Layer("full_attention", use_rope=False, floor_scale=4)
    q, k, v = _qkv(1, sum(LENS), seed=9)

    def scales(positions):
        return torch.log1p(torch.floor((positions.float() + 1) / 4)) * 0.1 + 1

    row_scaled = q * scales(torch.arange(sum(LENS)))[None, None, :, None]  # what the layer hands on
    own = q * torch.cat([scales(torch.arange(n)) for n in LENS])[None, None, :, None]
    out, _ = varlen_attention_forward(layer, row_scaled, k, v, None, scaling=0.4, cu_seq_lens_q=CU)
    torch.testing.assert_close(out[0], _expected_packed(own, k, v, 0.4), rtol=0, atol=1e-5)
    assert (_expected_packed(row_scaled, k, v, 0.4) - out[0]).abs().max() > 1e-2  # the row's scales differ
    # below floor_scale tokens every scale is 1: the query passes as it is
    short = _Llama4Layer("full_attention", use_rope=False, floor_scale=sum(LENS) + 1)
    out, _ = varlen_attention_forward(short, q, k, v, None, scaling=0.4, cu_seq_lens_q=CU)
    torch.testing.assert_close(out[0], _expected_packed(q, k, v, 0.4), rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------
# Indexed sparse attention (DeepSeek-V3.2 / GLM-5): the indexer's top-k chosen within each sequence
# ----------------------------------------------------------------------------------------------------------


def _indexer_choices(model, seqs: list[list[int]]) -> list[list[set[int]]]:
    """Per layer and query of the packed row: the keys the indexer chose that attention may use (of the
    query's own sequence, at or before it), as positions within that sequence."""
    batch = pack([Example(s) for s in seqs])
    starts = batch.cu_seqlens.tolist()
    chosen: list[torch.Tensor] = []
    hooks = [
        m.register_forward_hook(lambda _, __, out: chosen.append(out[0]))
        for m in model.modules()
        if type(m).__name__.endswith("Indexer")
    ]
    try:
        with torch.no_grad():
            forward_packed(model, batch)
    finally:
        for h in hooks:
            h.remove()
    layers = []
    for picked in chosen:
        queries = []
        for s, e in itertools.pairwise(starts):
            for q in range(s, e):
                queries.append({k - s for k in picked[q].tolist() if s <= k <= q})
        layers.append(queries)
    return layers


def test_indexed_attention_chooses_keys_within_each_sequence(probe_seqs):
    """The indexer (top-8 keys per query, sequences of 3 to 90 tokens) chooses in the packed row exactly
    what it chooses for each sequence alone; and told the row's plain causal mask instead of the packed
    one (the planted leak: its top-k taken over earlier sequences too), the probe refuses the model.
    (Exact on varlen, sdpa and eager: tests/proof/test_zoo.py.)"""
    from transformers.masking_utils import AttentionMaskInterface, causal_mask_function

    model = load_model_from_zoo("deepseek_v32")
    assert model.config.index_topk == 8 < max(len(s) for s in probe_seqs)
    packed = _indexer_choices(model, probe_seqs)
    each = [_indexer_choices(model, [s]) for s in probe_seqs]  # per sequence, per layer, per query
    alone = [[query for seq in each for query in seq[layer]] for layer in range(len(packed))]
    assert packed == alone and any(len(c) == 8 for c in packed[0])  # the top-k binds: choices were made

    def whole_row(*args, **kwargs):
        return varlen.sdpa_mask(*args, **{**kwargs, "mask_function": causal_mask_function})

    with mock.patch.dict(AttentionMaskInterface._global_mapping, {VARLEN_NAME: whole_row}):
        assert _indexer_choices(model, probe_seqs) != packed
        with pytest.raises(AttentionError, match="leaks between packed sequences"):
            probe_attention(model, "varlen")


def load_model_from_zoo(name: str):
    from padless.proof.check import zoo_model

    model = zoo_model(name, [list(range(3, 40))])
    model.set_attn_implementation(VARLEN_NAME)
    model.padless_attention = "varlen"
    return model
