"""The CPU stand-ins for the fused varlen kernels: their results against attention written out in fp64,
and the input checks of the real kernels' contracts."""

from __future__ import annotations

import math

import pytest
import torch

from padless.testing.kernels import (
    KernelContractError,
    reference_flash_attn_varlen_func,
    reference_varlen_attn,
)

FP32 = (torch.float32,)
LENS = (5, 1, 9, 3)


def _packed(heads=4, kv_heads=2, dim=16, v_dim=None, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(LENS)
    q = torch.randn(total, heads, dim, generator=gen).to(dtype)
    k = torch.randn(total, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, v_dim or dim, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


def _naive(q, k, v, cu, scale, left=-1, right=-1, softcap=0.0, cu_k=None):
    """fp64, one sequence at a time, bottom-right aligned window as both kernels document it."""
    cu_k = cu if cu_k is None else cu_k
    rep = q.shape[1] // k.shape[1]
    out = []
    for i in range(len(cu) - 1):
        qs, qe, ks, ke = int(cu[i]), int(cu[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        lq, lk = qe - qs, ke - ks
        qi = q[qs:qe].double().transpose(0, 1)
        ki = k[ks:ke].double().transpose(0, 1).repeat_interleave(rep, 0)
        vi = v[ks:ke].double().transpose(0, 1).repeat_interleave(rep, 0)
        s = qi @ ki.transpose(-1, -2) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        out_i = torch.zeros(qi.shape[0], lq, vi.shape[-1], dtype=torch.float64)
        for a in range(lq):
            diag = a + lk - lq
            keys = [
                b for b in range(lk) if (left < 0 or b >= diag - left) and (right < 0 or b <= diag + right)
            ]
            if keys:
                w = s[:, a, keys].softmax(-1)
                out_i[:, a] = (w[:, None] @ vi[:, keys])[:, 0]
        out.append(out_i.transpose(0, 1))
    return torch.cat(out).float()


@pytest.mark.parametrize(
    ("window", "left", "right"), [((-1, 0), -1, 0), ((3, 0), 3, 0), ((-1, -1), -1, -1), ((2, 1), 2, 1)]
)
def test_varlen_attn_windows_and_gqa(window, left, right):
    q, k, v, cu = _packed()
    out = reference_varlen_attn(
        q, k, v, cu, cu, 9, 9, scale=0.3, window_size=window, enable_gqa=True, dtypes=FP32
    )
    assert out.shape == q.shape
    torch.testing.assert_close(out, _naive(q, k, v, cu, 0.3, left, right), rtol=0, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("softcap", [0.0, 1.5])
def test_flash_attn_causal_window_softcap(causal, softcap):
    q, k, v, cu = _packed(seed=1)
    out = reference_flash_attn_varlen_func(
        q,
        k,
        v,
        cu,
        cu,
        9,
        9,
        softmax_scale=0.4,
        causal=causal,
        window_size=(4, -1),
        softcap=softcap,
        dtypes=FP32,
    )
    want = _naive(q, k, v, cu, 0.4, left=4, right=0 if causal else -1, softcap=softcap)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
    if softcap:  # the cap matters at these scores
        plain = _naive(q, k, v, cu, 0.4, left=4, right=0 if causal else -1)
        assert (want - plain).abs().max() > 1e-2


def test_flash_attn_causal_mask_is_bottom_right_aligned():
    """The docstring's own example: seqlen_q 2, seqlen_k 5 keeps 1 1 1 1 0 / 1 1 1 1 1; seqlen_q 5,
    seqlen_k 2 leaves the first three queries with no key, whose output is zero."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (
        torch.randn(2, 1, 8, generator=gen),
        torch.randn(5, 1, 8, generator=gen),
        torch.randn(5, 1, 8, generator=gen),
    )
    cu_q, cu_k = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)
    out = reference_flash_attn_varlen_func(q, k, v, cu_q, cu_k, 2, 5, causal=True, dtypes=FP32)
    first = (q[0, 0] @ k[:4, 0].T / math.sqrt(8)).softmax(-1) @ v[:4, 0]
    torch.testing.assert_close(out[0, 0], first, rtol=0, atol=1e-6)
    out = reference_flash_attn_varlen_func(k, q, q, cu_k, cu_q, 5, 2, causal=True, dtypes=FP32)
    assert (out[:3] == 0).all() and (out[3:] != 0).any()


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v, cu = _packed(heads=2, kv_heads=2, dim=12)
    want = _naive(q, k, v, cu, 12**-0.5, -1, 0)
    got = reference_flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, causal=True, dtypes=FP32)  # pads 12 to 16
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_gradients_match_written_out_attention():
    q, k, v, cu = _packed(seed=3)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    reference_varlen_attn(
        *inputs, cu, cu, 9, 9, window_size=(-1, 0), enable_gqa=True, dtypes=FP32
    ).square().sum().backward()
    double = [t.detach().double().requires_grad_() for t in (q, k, v)]
    _naive(*double, cu, 16**-0.5, -1, 0).double().square().sum().backward()
    for got, want in zip(inputs, double, strict=True):
        torch.testing.assert_close(got.grad, want.grad.float(), rtol=0, atol=1e-4)


# ----------------------------------------------------------------------------------------------------------
# The contracts' input checks
# ----------------------------------------------------------------------------------------------------------


def test_half_precision_only_by_default():
    q, k, v, cu = _packed()
    with pytest.raises(KernelContractError, match="only support fp16 and bf16"):
        reference_varlen_attn(q, k, v, cu, cu, 9, 9, enable_gqa=True)
    with pytest.raises(KernelContractError, match="only support fp16 and bf16"):
        reference_flash_attn_varlen_func(q, k, v, cu, cu, 9, 9)
    q, k, v, cu = _packed(dtype=torch.bfloat16)
    assert reference_varlen_attn(q, k, v, cu, cu, 9, 9, enable_gqa=True).dtype == torch.bfloat16
    with pytest.raises(KernelContractError, match="query and value must have the same dtype"):
        reference_flash_attn_varlen_func(q, k, v.half(), cu, cu, 9, 9)


@pytest.mark.parametrize("kernel", ["torch", "flash"])
def test_cu_seqlens_must_be_int32_on_the_inputs_device(kernel):
    q, k, v, cu = _packed()

    def call(cu_q):
        if kernel == "torch":
            return reference_varlen_attn(q, k, v, cu_q, cu, 9, 9, enable_gqa=True, dtypes=FP32)
        return reference_flash_attn_varlen_func(q, k, v, cu_q, cu, 9, 9, dtypes=FP32)

    with pytest.raises(KernelContractError, match="must have dtype int32"):
        call(cu.long())
    with pytest.raises(KernelContractError, match="must be on the inputs' device"):
        call(cu.to("meta"))
    with pytest.raises(KernelContractError, match="max_seqlen_q 9 < longest sequence 10"):
        call(torch.tensor([0, 10, 11, 15, 18], dtype=torch.int32))


def test_head_sizes():
    q, k, v, cu = _packed(heads=2, kv_heads=2, dim=12)
    with pytest.raises(KernelContractError, match="multiple of 8"):
        reference_varlen_attn(q, k, v, cu, cu, 9, 9, dtypes=FP32)  # no wrapper pads it
    q, k, v, cu = _packed(heads=2, kv_heads=2, dim=264)
    for call in (reference_varlen_attn, reference_flash_attn_varlen_func):
        with pytest.raises(KernelContractError, match="at most 256"):
            call(q, k, v, cu, cu, 9, 9, dtypes=FP32)
    q, k, v, cu = _packed(heads=2, kv_heads=2, dim=24, v_dim=8)  # MLA: value head size differs
    for call in (reference_varlen_attn, reference_flash_attn_varlen_func):
        with pytest.raises(KernelContractError, match="one head size"):
            call(q, k, v, cu, cu, 9, 9, dtypes=FP32)


def test_layout_and_heads():
    q, k, v, cu = _packed()
    with pytest.raises(ValueError, match="Try setting enable_gqa=True"):
        reference_varlen_attn(q, k, v, cu, cu, 9, 9, dtypes=FP32)
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, last dim not contiguous
    assert strided.stride(-1) != 1
    with pytest.raises(KernelContractError, match="contiguous last dimension"):
        reference_varlen_attn(strided, k, v, cu, cu, 9, 9, enable_gqa=True, dtypes=FP32)
    # flash-attn's wrapper makes inputs contiguous itself.
    torch.testing.assert_close(
        reference_flash_attn_varlen_func(strided, k, v, cu, cu, 9, 9, dtypes=FP32),
        reference_flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, dtypes=FP32),
    )
    q3, k3, v3, cu = _packed(heads=3, kv_heads=2)
    with pytest.raises(KernelContractError, match="must divide"):
        reference_flash_attn_varlen_func(q3, k3, v3, cu, cu, 9, 9, dtypes=FP32)


def test_softcap_refuses_dropout_and_unused_options_are_not_ignored():
    q, k, v, cu = _packed()
    with pytest.raises(KernelContractError, match="Softcapping does not support dropout"):
        reference_flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, dropout_p=0.1, softcap=2.0, dtypes=FP32)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        reference_flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, alibi_slopes=torch.ones(4), dtypes=FP32)
    with pytest.raises(NotImplementedError, match="seqused_k"):
        reference_varlen_attn(q, k, v, cu, cu, 9, 9, enable_gqa=True, seqused_k=cu[1:], dtypes=FP32)
