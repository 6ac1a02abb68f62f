"""CPU stand-ins for the CUDA kernels of stateful layers, written from their documented contracts.

On CUDA, padless runs the layers that carry a state from token to token (gated delta-nets, short causal
convolutions, Mamba-2 mixers) through the kernels the field uses, each told where the packed sequences
start. These stand-ins take the same arguments, make the same input checks and compute the same result
with plain tensor operations (token by token, in fp32, so autograd gives the backward), which lets that
CUDA branch run forward and backward on a CPU. Sources of the contracts:

- ``causal_conv1d_fn`` (Dao-AILab/causal-conv1d, ``causal_conv1d_interface.py`` and
  ``csrc/causal_conv1d.cpp`` / ``causal_conv1d_fwd.cu``): ``x`` ``(batch, dim, seqlen)``, ``weight``
  ``(dim, width)`` with width 2 to 4, activation ``None`` / ``silu`` / ``swish``; ``seq_idx``
  ``(batch, seqlen)`` int32, contiguous, only in the channel-last layout (``x.stride(1) == 1``, dim and the
  other strides multiples of 8) and never with initial or final states. A tap reads a token only where
  its ``seq_idx`` equals the output token's; a token with ``seq_idx < 0`` outputs 0. Accumulates in fp32.
- ``chunk_gated_delta_rule`` (fla-org/flash-linear-attention, ``fla/ops/gated_delta_rule/chunk.py``):
  ``q``, ``k`` ``[B, T, H, K]``, ``v`` ``[B, T, HV, V]`` (HV a multiple of H: value head ``i`` reads key
  head ``i // (HV / H)``), ``g`` (log decay) and ``beta`` ``[B, T, HV]``; with ``cu_seqlens`` (``[N + 1]``)
  the batch is 1 and each of the N sequences starts from its own ``initial_state`` ``[N, HV, K, V]``
  (zeros if none). Per step: ``S = S * exp(g)``, ``S += k (beta (v - k S))^T``, ``o = scale q S``; the
  final state is fp32.
- ``mamba_chunk_scan_combined`` (state-spaces/mamba, ``mamba_ssm/ops/triton/ssd_combined.py``): ``x``
  ``(batch, seqlen, nheads, headdim)``, ``dt`` ``(batch, seqlen, nheads)``, ``A`` ``(nheads,)``, ``B``,
  ``C`` ``(batch, seqlen, ngroups, dstate)``; ``dt`` plus ``dt_bias``, through softplus where at most 20
  (``dt_softplus``), clamped to ``dt_limit``; per step ``h = exp(dt A) h + dt x B^T``, ``y = h C + D x``,
  times ``silu(z)``; the state restarts at zero wherever ``seq_idx`` changes. ``cu_seqlens`` serves only
  ``return_varlen_states`` (each sequence's last state).

Options padless never uses raise ``NotImplementedError`` rather than being silently ignored.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import sys
import types
from collections.abc import Iterator
from unittest import mock

import torch
import torch.nn.functional as F

from padless.testing.kernels import KernelContractError, _require

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def reference_causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    final_states_out: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """``causal_conv1d.causal_conv1d_fn`` on any device."""
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError("activation must be None, silu, or swish")
    if initial_states is not None or return_final_states or final_states_out is not None:
        raise NotImplementedError("the stand-in implements no initial or final states")
    _require(x.dtype in FLOATS and weight.dtype in FLOATS, f"unsupported dtypes {x.dtype}, {weight.dtype}")
    _require(x.dim() == 3, f"x must be (batch, dim, seqlen), got shape {tuple(x.shape)}")
    batch, dim, seqlen = x.shape
    width = weight.shape[-1]
    _require(weight.shape == (dim, width), f"weight must have shape ({dim}, width)")
    _require(2 <= width <= 4, "causal_conv1d only supports width between 2 and 4")
    _require(x.stride(2) == 1 or x.stride(1) == 1, "x must be contiguous in its channels or its tokens")
    channel_last = x.stride(1) == 1 and x.stride(2) > 1
    if channel_last:
        _require(dim % 8 == 0, "causal_conv1d only supports channel dimension divisible by 8 for now")
        _require(
            x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0,
            "causal_conv1d with channel last layout requires strides (x.stride(0) and x.stride(2)) to be "
            "multiples of 8",
        )
    if bias is not None:
        _require(bias.dtype == weight.dtype and bias.shape == (dim,), "bias must be (dim,) in weight's dtype")
    if seq_idx is not None:
        _require(channel_last, "seq_idx is only supported for channel last layout")
        _require(seq_idx.dtype == torch.int32, f"seq_idx must be int32, got {seq_idx.dtype}")
        _require(seq_idx.is_contiguous(), "seq_idx must be contiguous")
        _require(seq_idx.shape == (batch, seqlen), f"seq_idx must have shape ({batch}, {seqlen})")
    xs = F.pad(x.float(), (width - 1, 0))
    out = (bias.float()[:, None] if bias is not None else x.new_zeros(dim, 1, dtype=torch.float32)).expand(
        batch, dim, seqlen
    )
    if seq_idx is not None:
        ids = F.pad(seq_idx, (width - 1, 0), value=-1)
    for w in range(width):  # tap w reads token t - (width - 1) + w
        tap = weight.float()[:, w, None] * xs[:, :, w : w + seqlen]
        if seq_idx is not None:
            tap = tap * (ids[:, None, w : w + seqlen] == seq_idx[:, None])
        out = out + tap
    if seq_idx is not None:
        out = out.masked_fill((seq_idx < 0)[:, None], 0.0)
    if activation is not None:
        out = F.silu(out)
    return out.to(x.dtype)


_GDN_UNSUPPORTED = ("use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first")


def reference_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` on any device."""
    unsupported = sorted(key for key in _GDN_UNSUPPORTED if kwargs.pop(key, False))
    kwargs.pop("cu_seqlens_cpu", None)  # a host copy of cu_seqlens: only saves the kernel a transfer
    unsupported += [key for key in ("cp_context", "chunk_indices") if kwargs.pop(key, None) is not None]
    if unsupported:
        raise NotImplementedError(f"the stand-in implements none of {', '.join(unsupported)}")
    if "head_first" in kwargs:
        raise DeprecationWarning("head_first has been removed. Inputs must be in `[B, T, H, ...]` format.")
    chunk_size = kwargs.pop("chunk_size", 64)
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got {chunk_size}.")
    if kwargs:
        raise TypeError(f"unexpected arguments {sorted(kwargs)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q and k must have the same number of heads, but got q.shape[2]={q.shape[2]} and "
            f"k.shape[2]={k.shape[2]}"
        )
    heads, v_heads = q.shape[2], v.shape[2]
    if v_heads % heads != 0:
        raise ValueError(
            f"For GVA, num_v_heads (HV={v_heads}) must be evenly divisible by num_heads (H={heads})"
        )
    batch, length = q.shape[:2]
    _require(g.shape == beta.shape == (batch, length, v_heads), "g and beta must be [B, T, HV]")
    if cu_seqlens is not None:
        if batch != 1:
            raise ValueError(
                f"The batch size is expected to be 1 rather than {batch} when using `cu_seqlens`.Please "
                "flatten variable-length inputs before processing."
            )
        _require(not cu_seqlens.is_floating_point(), f"cu_seqlens must hold integers, got {cu_seqlens.dtype}")
        bounds = cu_seqlens.tolist()
        _require(bounds[0] == 0 and bounds[-1] == length, f"cu_seqlens must run from 0 to {length}")
        spans = [(0, s, e) for s, e in itertools.pairwise(bounds)]
    else:
        spans = [(b, 0, length) for b in range(batch)]
    if initial_state is not None and initial_state.shape[0] != len(spans):
        raise ValueError(
            f"The number of initial states is expected to be equal to the number of input sequences, i.e., "
            f"{len(spans)} rather than {initial_state.shape[0]}."
        )
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    rep = v_heads // heads
    qf, kf = (t.float().repeat_interleave(rep, 2) for t in (q, k))
    if use_qk_l2norm_in_kernel:  # as fla's l2norm: x / sqrt(sum x^2 + eps)
        qf, kf = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (qf, kf))
    vf, gf, bf = v.float(), g.float(), beta.float()
    outputs, finals = [], []
    for n, (row, s, e) in enumerate(spans):
        state = (
            initial_state[n].float()
            if initial_state is not None
            else qf.new_zeros(v_heads, k.shape[-1], v.shape[-1])
        )
        for t in range(s, e):
            state = state * gf[row, t].exp()[:, None, None]
            remembered = torch.einsum("hk,hkv->hv", kf[row, t], state)
            delta = (vf[row, t] - remembered) * bf[row, t][:, None]
            state = state + kf[row, t][:, :, None] * delta[:, None, :]
            outputs.append(torch.einsum("hk,hkv->hv", qf[row, t] * scale, state))
        finals.append(state)
    o = torch.stack(outputs).view(batch, length, v_heads, v.shape[-1]).to(v.dtype)
    return o, torch.stack(finals) if output_final_state else None


def reference_mamba_chunk_scan_combined(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    return_final_states: bool = False,
    return_varlen_states: bool = False,
    state_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined`` on any device (``chunk_size`` and
    ``state_dtype`` change only how the kernel splits and stores its work)."""
    if initial_states is not None and seq_idx is not None:
        raise NotImplementedError("the stand-in implements no initial_states together with seq_idx")
    batch, seqlen, nheads, headdim = x.shape
    _, _, ngroups, dstate = B.shape
    _require(nheads % ngroups == 0, "nheads must be a multiple of ngroups")
    _require(B.shape == (batch, seqlen, ngroups, dstate), "B must be (batch, seqlen, ngroups, dstate)")
    _require(dt.shape == (batch, seqlen, nheads), "dt must be (batch, seqlen, nheads)")
    _require(A.shape == (nheads,), "A must be (nheads,)")
    _require(C.shape == B.shape, "C must have B's shape")
    _require(z is None or z.shape == x.shape, "z must have x's shape")
    _require(
        D is None or D.shape in ((nheads, headdim), (nheads,)), "D must be (nheads, headdim) or (nheads,)"
    )
    _require(seq_idx is None or seq_idx.shape == (batch, seqlen), "seq_idx must be (batch, seqlen)")
    _require(
        initial_states is None or initial_states.shape == (batch, nheads, headdim, dstate),
        "initial_states must be (batch, nheads, headdim, dstate)",
    )
    if return_varlen_states:
        _require(cu_seqlens is not None, "cu_seqlens must be provided if return_varlen_states is True")
        _require(batch == 1, "passing cu_seqlens to get the varlen states needs batch dimension 1")
    step = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    if dt_softplus:
        step = torch.where(step <= 20.0, F.softplus(step), step)
    step = step.clamp(dt_limit[0], dt_limit[1])
    decay = (step * A.float()).exp()  # [b, l, h]
    group = torch.arange(nheads, device=x.device) // (nheads // ngroups)
    bh, ch = B.float()[:, :, group], C.float()[:, :, group]  # [b, l, h, n]
    xf = x.float()
    state = xf.new_zeros(batch, nheads, headdim, dstate) if initial_states is None else initial_states.float()
    outputs, ends = [], {}
    for t in range(seqlen):
        if seq_idx is not None and t > 0:
            same = (seq_idx[:, t] == seq_idx[:, t - 1]).float()[:, None, None, None]
            state = state * same  # a new sequence starts from zero
        state = (
            state * decay[:, t, :, None, None]
            + (step[:, t, :, None, None] * xf[:, t, :, :, None]) * bh[:, t, :, None, :]
        )
        outputs.append(torch.einsum("bhpn,bhn->bhp", state, ch[:, t]))
        ends[t] = state
    y = torch.stack(outputs, 1)  # [b, l, h, p]
    if D is not None:
        y = y + xf * (D.float() if D.dim() == 2 else D.float()[:, None])
    if z is not None:
        y = y * F.silu(z.float())
    out = y.to(x.dtype)
    extra: list[torch.Tensor] = []
    if return_final_states:
        extra.append(ends[seqlen - 1])
    if return_varlen_states:
        extra.append(torch.cat([ends[e - 1] for e in cu_seqlens[1:].tolist()]))
    return (out, *extra) if extra else out


@contextlib.contextmanager
def state_kernels_on_cpu() -> Iterator[dict[str, types.ModuleType]]:
    """Make the CUDA kernels' packages importable, each holding its stand-in, inside the block:
    ``causal_conv1d.causal_conv1d_fn``, ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` and
    ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined``, and let padless's kernel branch
    (:mod:`padless.forward.hybrid_kernels`) run on any device. Yields the installed modules."""
    modules: dict[str, types.ModuleType] = {}

    def module(name: str, **attrs: object) -> None:
        made = types.ModuleType(name)
        for key, value in attrs.items():
            setattr(made, key, value)
        modules[name] = made

    module("causal_conv1d", causal_conv1d_fn=reference_causal_conv1d_fn)
    module("fla")
    module("fla.ops")
    module("fla.ops.gated_delta_rule", chunk_gated_delta_rule=reference_chunk_gated_delta_rule)
    module("mamba_ssm")
    module("mamba_ssm.ops")
    module("mamba_ssm.ops.triton")
    module("mamba_ssm.ops.triton.ssd_combined", mamba_chunk_scan_combined=reference_mamba_chunk_scan_combined)
    for name, made in modules.items():  # packages hold their children, as an import would set them
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, made)
    import padless.forward.hybrid_kernels as hybrid_kernels

    with (
        mock.patch.dict(sys.modules, modules),
        mock.patch.object(hybrid_kernels, "kernel_problem", lambda device, packages: None),
    ):
        yield modules


__all__ = [
    "KernelContractError",
    "reference_causal_conv1d_fn",
    "reference_chunk_gated_delta_rule",
    "reference_mamba_chunk_scan_combined",
    "state_kernels_on_cpu",
]
