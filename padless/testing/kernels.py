"""CPU stand-ins for the fused varlen kernels, written from their documented contracts.

padless's fused branch calls PyTorch's ``torch.nn.attention.varlen.varlen_attn`` or flash-attn's
``flash_attn_varlen_func``, which run on CUDA only. These stand-ins take the same arguments, make the
same input checks and compute the same result with plain tensor operations (so autograd gives the
backward), which lets the whole fused branch — packing padded rows, head-size padding, window and
causal mapping, GQA, soft-capping — run forward and backward on a CPU. Sources of the contract:

- ``varlen_attn``: its docstring (torch 2.13, ``torch/nn/attention/varlen.py``) and the checks of the
  flash kernel it calls (``mha_varlen_fwd`` in PyTorch's ``aten/.../flash_attn/flash_api.cpp``):
  fp16/bf16, int32 contiguous ``cu_seq`` on the inputs' device, contiguous last dimension, head size a
  multiple of 8 and at most 256, one head size for q, k and v, ``enable_gqa`` for fewer kv heads;
  causal exactly when ``window_size == (-1, 0)``; no soft-cap, no dropout.
- ``flash_attn_varlen_func``: its docstring and ``flash_api.cpp`` (flash-attn 2.8): the same checks,
  except that the Python wrapper makes inputs contiguous and pads the head size to a multiple of 8
  itself; ``causal`` forces the right window to 0; ``softcap > 0`` caps scores and refuses dropout.

Both align causal masks and windows to the bottom right: query ``i`` of a sequence with ``Lq`` queries
and ``Lk`` keys sees keys ``[i + Lk - Lq - left, i + Lk - Lq + right]`` (``-1``: unbounded), and a query
that sees no key outputs zeros. Options padless never uses (ALiBi, paged KV, returned LSE or
probabilities) raise ``NotImplementedError`` rather than being silently ignored.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import types
from collections.abc import Iterator
from unittest import mock

import torch
import torch.nn.functional as F

HALF = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


class KernelContractError(RuntimeError):
    """An input the real kernel would reject (its own checks) or compute garbage from (out of contract)."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise KernelContractError(message)


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    dtypes: tuple[torch.dtype, ...],
    contiguous_last_dim: bool,
    head_multiple_of_8: bool,
) -> None:
    _require(q.dtype in dtypes, f"FlashAttention only support fp16 and bf16 data type, got {q.dtype}")
    _require(k.dtype == q.dtype, "query and key must have the same dtype")
    _require(v.dtype == q.dtype, "query and value must have the same dtype")
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        _require(cu.dtype == torch.int32, f"{name} must have dtype int32, got {cu.dtype}")
        _require(cu.device == q.device, f"{name} must be on the inputs' device {q.device}, got {cu.device}")
        _require(cu.dim() == 1 and cu.is_contiguous(), f"{name} must be a contiguous 1-D tensor")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _require(t.dim() == 3, f"{name} must be (total, heads, head_dim), got shape {tuple(t.shape)}")
        _require(t.device == q.device, f"{name} must be on {q.device}, got {t.device}")
        if contiguous_last_dim:
            _require(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    _require(
        dim <= MAX_HEAD_DIM, f"FlashAttention forward only supports head dimension at most 256, got {dim}"
    )
    if head_multiple_of_8:
        _require(dim % 8 == 0, f"head_size must be a multiple of 8, got {dim}")
    _require(heads % kv_heads == 0, "Number of heads in key/value must divide number of heads in query")
    _require(k.shape[1:] == (kv_heads, dim), f"k must have shape (total_k, {kv_heads}, {dim})")
    _require(
        v.shape == k.shape, f"v must have k's shape {tuple(k.shape)} (one head size), got {tuple(v.shape)}"
    )
    _require(
        cu_q.numel() == cu_k.numel() and cu_q.numel() >= 2, "cu_seqlens_q and cu_seqlens_k: batch + 1 each"
    )
    for name, cu, total, longest in (("q", cu_q, q.shape[0], max_q), ("k", cu_k, k.shape[0], max_k)):
        lens = cu.diff()
        _require(int(cu[0]) == 0 and bool((lens >= 0).all()), f"cu_seqlens_{name} must rise from 0")
        _require(int(cu[-1]) <= total, f"cu_seqlens_{name} ends at {int(cu[-1])}, past the {total} tokens")
        _require(
            int(lens.max()) <= longest, f"max_seqlen_{name} {longest} < longest sequence {int(lens.max())}"
        )


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    scale: float,
    window: tuple[int, int],
    softcap: float,
    dropout: float,
) -> torch.Tensor:
    """Each sequence on its own, in fp32, with the bottom-right aligned window; zeros where no key is seen."""
    rep = q.shape[1] // k.shape[1]
    out = []
    for (qs, qe), (ks, ke) in zip(
        zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True),
        zip(cu_k[:-1].tolist(), cu_k[1:].tolist(), strict=True),
        strict=True,
    ):
        lq, lk = qe - qs, ke - ks
        qi = q[qs:qe].float().transpose(0, 1)  # [H, Lq, D]
        ki = k[ks:ke].float().transpose(0, 1).repeat_interleave(rep, 0)
        vi = v[ks:ke].float().transpose(0, 1).repeat_interleave(rep, 0)
        scores = qi @ ki.transpose(-1, -2) * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        i = torch.arange(lq, device=q.device)[:, None] + (lk - lq)  # the diagonal, bottom-right aligned
        j = torch.arange(lk, device=q.device)[None]
        seen = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        if window[0] >= 0:
            seen &= j >= i - window[0]
        if window[1] >= 0:
            seen &= j <= i + window[1]
        probs = scores.masked_fill(~seen, -math.inf).softmax(-1).nan_to_num(0.0)  # no key seen: zeros
        if dropout:
            probs = F.dropout(probs, p=dropout)
        out.append((probs @ vi).transpose(0, 1))
    return torch.cat(out).to(q.dtype)


def reference_varlen_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    return_aux: object | None = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    num_splits: int | None = None,
    dtypes: tuple[torch.dtype, ...] = HALF,
) -> torch.Tensor:
    """``torch.nn.attention.varlen.varlen_attn`` on any device. ``dtypes`` widens the fp16/bf16 check
    (tests pass fp32 to compare with exact fp32 paths); ``num_splits`` only changes summation order."""
    if return_aux is not None or seqused_k is not None or block_table is not None:
        raise NotImplementedError("the stand-in implements no return_aux, seqused_k or block_table")
    if cu_seq_k is None:
        raise NotImplementedError("the stand-in needs cu_seq_k (it has no paged KV)")
    if len(window_size) != 2:
        raise ValueError(f"window_size must have length 2, got {len(window_size)}")
    heads, kv_heads = query.size(1), key.size(1)
    if not enable_gqa and heads != kv_heads:
        raise ValueError(
            f"Expect query and key/value to have the same number of heads but got Hq={heads} and "
            f"Hkv={kv_heads}. Try setting enable_gqa=True for GQA."
        )
    _check_inputs(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, dtypes, True, True)
    is_causal = tuple(window_size) == (-1, 0)  # exactly as varlen_attn derives it
    left, right = window_size
    if is_causal:
        right = 0
    left = -1 if left >= max_k else left
    right = -1 if right >= max_k else right
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return _attend(query, key, value, cu_seq_q, cu_seq_k, scale, (left, right), 0.0, 0.0)


def reference_flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    dtypes: tuple[torch.dtype, ...] = HALF,
) -> torch.Tensor:
    """flash-attn's ``flash_attn_varlen_func`` on any device (``dtypes``: as in :func:`reference_varlen_attn`;
    ``deterministic`` only concerns the real backward's summation order)."""
    if alibi_slopes is not None or return_attn_probs or block_table is not None:
        raise NotImplementedError("the stand-in implements no alibi_slopes, return_attn_probs or block_table")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))  # as the wrapper does
    head_dim = q.shape[-1]
    pad = -head_dim % 8  # the wrapper pads q, k and v by what q's head size lacks to a multiple of 8
    _check_inputs(
        *(F.pad(t, (0, pad)) for t in (q, k, v)),
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dtypes,
        True,
        True,
    )
    if softcap > 0:
        _require(dropout_p == 0.0, "Softcapping does not support dropout for now")
    left, right = window_size
    if max_seqlen_q == 1:
        causal = False  # as flash_api.cpp: causal is the same as not causal for one query
    if causal:
        right = 0
    left = -1 if left >= max_seqlen_k else left
    right = -1 if right >= max_seqlen_k else right
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    return _attend(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, (left, right), softcap, dropout_p)


@contextlib.contextmanager
def fused_kernels_on_cpu(dtypes: tuple[torch.dtype, ...] = HALF) -> Iterator[None]:
    """Run padless's fused varlen branch through the stand-ins on this machine, whatever its device.

    Installs the stand-ins where padless imports the kernels from (``torch.nn.attention.varlen`` and a
    ``flash_attn`` module), reports both as installed and lets a pinned ``varlen_kernel`` (``torch`` or
    ``flash_attn``) run on CPU in ``dtypes``. Pin the kernel on the model
    (:func:`padless.forward.attention.pin_kernel`).
    """
    import torch.nn.attention.varlen as torch_varlen

    import padless.forward.attention as attention

    flash_attn = types.ModuleType("flash_attn")
    flash_attn.flash_attn_varlen_func = functools.partial(reference_flash_attn_varlen_func, dtypes=dtypes)
    original_problem = attention.varlen_kernel_problem

    def problem_on_any_device(kernel: str, device: torch.device) -> str | None:
        return original_problem(kernel, torch.device("cuda")) if kernel != "sdpa" else None

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(sys.modules, {"flash_attn": flash_attn}))
        stack.enter_context(
            mock.patch.object(
                torch_varlen, "varlen_attn", functools.partial(reference_varlen_attn, dtypes=dtypes)
            )
        )
        stack.enter_context(mock.patch.object(attention, "flash_attn_installed", lambda: True))
        stack.enter_context(mock.patch.object(attention, "torch_varlen_available", lambda: True))
        stack.enter_context(mock.patch.object(attention, "varlen_kernel_problem", problem_on_any_device))
        stack.enter_context(mock.patch.object(attention, "FUSED_DTYPES", dtypes))
        yield
