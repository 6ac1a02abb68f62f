"""The CPU stand-ins for the stateful layers' CUDA kernels: told the boundaries of a packed row, each
equals every sequence run alone, and alone each equals an independent formulation (transformers' own
torch paths, Mamba-2's quadratic form); the input checks of the real kernels' contracts hold."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from padless.testing.state_kernels import (
    KernelContractError,
    reference_causal_conv1d_fn,
    reference_chunk_gated_delta_rule,
    reference_mamba_chunk_scan_combined,
    state_kernels_on_cpu,
)

LENS = (5, 1, 9, 3)
TOTAL = sum(LENS)
TOL = {"rtol": 0, "atol": 1e-5}
SEQ_IDX = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(LENS)])[None]
CU = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)


def _pieces(t: torch.Tensor, dim: int) -> list[torch.Tensor]:
    return list(t.split(list(LENS), dim))


def _channel_last(x: torch.Tensor) -> torch.Tensor:
    """``(batch, dim, seqlen)`` stored token-major, as the kernel needs for ``seq_idx``."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def test_causal_conv1d_with_seq_idx_is_each_sequence_alone():
    from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn as transformers_conv

    gen = torch.Generator().manual_seed(0)
    x = _channel_last(torch.randn(1, 16, TOTAL, generator=gen))
    weight, bias = torch.randn(16, 4, generator=gen), torch.randn(16, generator=gen)
    packed = reference_causal_conv1d_fn(x, weight, bias, seq_idx=SEQ_IDX, activation="silu")
    alone = [reference_causal_conv1d_fn(p, weight, bias, activation="silu") for p in _pieces(x, 2)]
    torch.testing.assert_close(packed, torch.cat(alone, 2), **TOL)
    for own, piece in zip(alone, _pieces(x, 2), strict=True):  # transformers' torch path, alone
        torch.testing.assert_close(own, transformers_conv(piece, weight, bias, activation="silu"), **TOL)
    leaked = reference_causal_conv1d_fn(x, weight, bias, activation="silu")
    assert (leaked - packed).abs().max() > 1e-2  # without seq_idx the taps cross the boundaries
    padding = SEQ_IDX.clone()
    padding[0, -3:] = -1  # tokens of no sequence output zeros
    out = reference_causal_conv1d_fn(x, weight, bias, seq_idx=padding)
    assert (out[0, :, -3:] == 0).all()


def test_causal_conv1d_contract():
    x, weight = _channel_last(torch.randn(1, 16, TOTAL)), torch.randn(16, 4)
    with pytest.raises(KernelContractError, match="seq_idx is only supported for channel last layout"):
        reference_causal_conv1d_fn(x.contiguous(), weight, seq_idx=SEQ_IDX)
    with pytest.raises(KernelContractError, match="int32"):
        reference_causal_conv1d_fn(x, weight, seq_idx=SEQ_IDX.long())
    with pytest.raises(KernelContractError, match="width between 2 and 4"):
        reference_causal_conv1d_fn(x, torch.randn(16, 5), seq_idx=SEQ_IDX)
    with pytest.raises(KernelContractError, match="divisible by 8"):
        reference_causal_conv1d_fn(
            _channel_last(torch.randn(1, 12, TOTAL)), torch.randn(12, 4), seq_idx=SEQ_IDX
        )
    with pytest.raises(NotImplementedError):
        reference_causal_conv1d_fn(x, weight, seq_idx=SEQ_IDX, return_final_states=True)


def _gdn_inputs(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 1, TOTAL, 2, 8, generator=gen)
    v = torch.randn(1, TOTAL, 4, 8, generator=gen)  # 4 value heads over 2 key heads
    g = F.logsigmoid(torch.randn(1, TOTAL, 4, generator=gen))
    beta = torch.rand(1, TOTAL, 4, generator=gen)
    return q, k, v, g, beta


def test_chunk_gated_delta_rule_with_cu_seqlens_is_each_sequence_alone():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    q, k, v, g, beta = _gdn_inputs()
    packed, states = reference_chunk_gated_delta_rule(
        q, k, v, g, beta, cu_seqlens=CU, use_qk_l2norm_in_kernel=True, output_final_state=True
    )
    assert states.shape == (len(LENS), 4, 8, 8) and states.dtype == torch.float32
    alone = []
    for n, parts in enumerate(zip(*(_pieces(t, 1) for t in (q, k, v, g, beta)), strict=True)):
        own, state = reference_chunk_gated_delta_rule(
            *parts, use_qk_l2norm_in_kernel=True, output_final_state=True
        )
        torch.testing.assert_close(state[0], states[n], **TOL)
        # transformers' chunked torch path (repeats q / k per value head group as fla's GVA reads them)
        theirs, _ = torch_chunk_gated_delta_rule(*parts, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(own, theirs, **TOL)
        alone.append(own)
    torch.testing.assert_close(packed, torch.cat(alone, 1), **TOL)
    leaked, _ = reference_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert (leaked - packed).abs().max() > 1e-2  # without cu_seqlens the state runs on


def test_chunk_gated_delta_rule_contract():
    q, k, v, g, beta = _gdn_inputs()
    with pytest.raises(ValueError, match="batch size is expected to be 1"):
        reference_chunk_gated_delta_rule(
            *(t.expand(2, *t.shape[1:]) for t in (q, k, v, g, beta)), cu_seqlens=CU
        )
    with pytest.raises(ValueError, match="number of initial states"):
        reference_chunk_gated_delta_rule(
            q, k, v, g, beta, cu_seqlens=CU, initial_state=torch.zeros(1, 4, 8, 8)
        )
    with pytest.raises(ValueError, match="same number of heads"):
        reference_chunk_gated_delta_rule(q, k[:, :, :1], v, g, beta)
    with pytest.raises(NotImplementedError, match="use_gate_in_kernel"):
        reference_chunk_gated_delta_rule(q, k, v, g, beta, use_gate_in_kernel=True)


def _mamba_inputs(seed: int = 2):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, TOTAL, 4, 6, generator=gen)  # 4 heads of 6
    dt = torch.randn(1, TOTAL, 4, generator=gen)
    a = -torch.rand(4, generator=gen) * 2
    b, c = torch.randn(2, 1, TOTAL, 2, 5, generator=gen)  # 2 groups, state 5
    return {
        "x": x,
        "dt": dt,
        "A": a,
        "B": b,
        "C": c,
        "D": torch.randn(4, generator=gen),
        "z": torch.randn(1, TOTAL, 4, 6, generator=gen),
        "dt_bias": torch.randn(4, generator=gen),
    }


def _ssd_quadratic(x, dt, A, B, C, D, z, dt_bias):
    """Mamba-2's quadratic (attention-like) form of one sequence: y = (L * C B^T) (dt x) + D x, times
    silu(z), with L[t, s] = exp(sum of dt A over s < r <= t)."""
    step = F.softplus(dt + dt_bias)[0]  # [L, h]
    heads = x.shape[2]
    group = torch.arange(heads) // (heads // B.shape[2])
    bh, ch = B[0][:, group], C[0][:, group]  # [L, h, n]
    cum = (step * A).cumsum(0)  # [L, h]
    decay = (cum[:, None] - cum[None]).exp()  # [t, s, h]
    mask = torch.ones(len(cum), len(cum)).tril().bool()[:, :, None]
    scores = torch.einsum("thn,shn->tsh", ch, bh) * decay.masked_fill(~mask, 0)
    y = torch.einsum("tsh,sh,shp->thp", scores, step, x[0]) + x[0] * D[:, None]
    return (y * F.silu(z[0]))[None]


def test_mamba_chunk_scan_combined_with_seq_idx_is_each_sequence_alone():
    inputs = _mamba_inputs()
    per_token = ("x", "dt", "B", "C", "z")
    packed, states = reference_mamba_chunk_scan_combined(
        **inputs, chunk_size=8, seq_idx=SEQ_IDX, cu_seqlens=CU, dt_softplus=True, return_varlen_states=True
    )
    alone = []
    for n, parts in enumerate(zip(*(_pieces(inputs[key], 1) for key in per_token), strict=True)):
        own_inputs = {**inputs, **dict(zip(per_token, parts, strict=True))}
        own, state = reference_mamba_chunk_scan_combined(
            **own_inputs, chunk_size=8, dt_softplus=True, return_final_states=True
        )
        torch.testing.assert_close(state, states[n : n + 1], **TOL)
        torch.testing.assert_close(own, _ssd_quadratic(**own_inputs), **TOL)
        alone.append(own)
    torch.testing.assert_close(packed, torch.cat(alone, 1), **TOL)
    leaked = reference_mamba_chunk_scan_combined(**inputs, chunk_size=8, dt_softplus=True)
    assert (leaked - packed).abs().max() > 1e-2  # without seq_idx the state runs on


def test_mamba_chunk_scan_combined_contract():
    inputs = _mamba_inputs()
    with pytest.raises(KernelContractError, match="seq_idx must be"):
        reference_mamba_chunk_scan_combined(**inputs, chunk_size=8, seq_idx=SEQ_IDX[:, :-1])
    with pytest.raises(KernelContractError, match="cu_seqlens must be provided"):
        reference_mamba_chunk_scan_combined(**inputs, chunk_size=8, return_varlen_states=True)
    with pytest.raises(NotImplementedError):
        reference_mamba_chunk_scan_combined(
            **inputs, chunk_size=8, seq_idx=SEQ_IDX, initial_states=torch.zeros(1, 4, 6, 5)
        )


def test_state_kernels_are_importable_where_padless_imports_them_inside_the_block():
    with state_kernels_on_cpu():
        assert importlib.import_module("causal_conv1d").causal_conv1d_fn is reference_causal_conv1d_fn
        gdn = importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule
        assert gdn is reference_chunk_gated_delta_rule
        ssd = importlib.import_module("mamba_ssm.ops.triton.ssd_combined").mamba_chunk_scan_combined
        assert ssd is reference_mamba_chunk_scan_combined
    with pytest.raises(ImportError):
        importlib.import_module("fla.ops.gated_delta_rule")
