"""The ``varlen`` attention backend: attention within each sequence of a packed row.

Registered with transformers' ``AttentionInterface`` under :data:`padless.forward.attention.VARLEN_NAME`: it
reads the sequence boundaries (``cu_seq_lens_q/k``) that the packed forward passes through the model's forward
and runs attention within each sequence, honouring every argument transformers passes (causal or not,
sliding windows, soft-caps, sinks, scale, MLA head sizes) or refusing. Which kernel runs
(:func:`padless.forward.attention.varlen_kernel`) is chosen by the name pinned on the layer that calls
(:func:`padless.forward.attention.pin_kernel`), and a layer whose rows are split over a sequence-parallel
group attends through the group it carries (:mod:`padless.forward.sequence_parallel`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import accumulate, pairwise
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from padless.errors import AttentionError
from padless.forward import attention
from padless.forward.attention import SPLIT_ATTRIBUTE, VARLEN_NAME

FUSED_MAX_HEAD_DIM = 256  # both fused kernels' documented limit

log = logging.getLogger(__name__)

# kernel name -> number of attention-layer calls; read by the load-time probe and by `padless check`.
KERNEL_CALLS: Counter[str] = Counter()

Span = tuple[int, int, int]  # (row, start, end) of one sequence inside a [B, T] layout


# cu_seqlens tensor -> its boundaries as Python ints. Read once per batch (model_inputs reads it before the
# forward) and then by every layer from here: no layer converts a tensor to host values, which on CUDA
# would wait for the GPU once per layer.
_HOST_BOUNDS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def sequence_bounds(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    """``cu_seqlens`` as Python ints, converted once per tensor object and remembered while it lives."""
    bounds = _HOST_BOUNDS.get(cu_seqlens)
    if bounds is None:
        bounds = _HOST_BOUNDS[cu_seqlens] = tuple(cu_seqlens.tolist())
    return bounds


def _spans(
    batch: int, length: int, attention_mask: torch.Tensor | None, kwargs: dict[str, Any]
) -> list[Span]:
    """Where each sequence lies: from cu_seq_lens (packed), a 2D padding mask, or restarts of position_ids.

    Packed rows (every training and scoring pass) read their bounds through :func:`sequence_bounds`;
    padded rows and bare position ids (comparison runs) are read from the tensors in every layer.
    """
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        if batch != 1:
            raise AttentionError(f"cu_seq_lens describe one packed row, got a batch of {batch} rows")
        bounds = sequence_bounds(cu)
        cu_k = kwargs.get("cu_seq_lens_k")
        if cu_k is not None and cu_k is not cu and sequence_bounds(cu_k) != bounds:
            raise AttentionError(
                "cu_seq_lens_k differs from cu_seq_lens_q without tree_keys: varlen runs self-attention "
                "over whole sequences or the segments of a tree row (no cross-attention, no KV cache)"
            )
        return [(0, s, e) for s, e in pairwise(bounds)]
    spans = []
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise AttentionError(
                f"varlen takes a 2D padding mask, got a {attention_mask.dim()}D mask: this model builds its "
                "own attention mask, which varlen would not follow; use attn_implementation=sdpa or eager"
            )
        for row in range(batch):
            real = torch.nonzero(attention_mask[row]).flatten().tolist()
            if real and real[-1] - real[0] + 1 != len(real):
                raise AttentionError(
                    f"row {row} of the attention mask has holes; varlen takes left- or right-padded rows only"
                )
            if real:
                spans.append((row, real[0], real[-1] + 1))
        return spans
    position_ids = kwargs.get("position_ids")
    for row in range(batch):
        if position_ids is None:
            spans.append((row, 0, length))
            continue
        pos = position_ids[min(row, position_ids.shape[0] - 1)]
        starts = [0, *(torch.nonzero(pos.diff() != 1).flatten() + 1).tolist(), length]
        spans += [(row, s, e) for s, e in pairwise(starts)]
    return spans


@dataclass(frozen=True)
class AttentionArgs:
    """What one attention call asks for besides q, k, v and where the sequences lie."""

    scale: float
    causal: bool
    window: int | None  # transformers' sliding_window: query i sees key j when 0 <= i - j < window
    softcap: float | None  # scores -> softcap * tanh(scores / softcap), before the mask
    sinks: torch.Tensor | None  # [H]: one learned logit per head in the softmax's denominator, value zero
    dropout: float


# Read by varlen to find the sequences.
_BOUNDARY_KWARGS = frozenset(
    {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids", "tree_keys"}
)
# The keys an indexer chose for each query ``[B, T, k]`` (sparse attention), honoured by _indexed_attention.
_INDEX_KWARGS = frozenset({"indices"})
# Flags of the model's forward that transformers hands on to every attention call; none of them changes
# what attention computes.
_INERT_KWARGS = frozenset(
    {
        "use_cache",
        "output_hidden_states",
        "output_router_logits",
        "return_dict",
        "num_items_in_batch",
        "image_sizes",  # InternVL's forward hands its language model the image sizes, unused there
        "logits_to_keep",  # which positions the head scores; LLaVA-OneVision / GOT-OCR2 hand it down here
    }
)


def architecture(module: torch.nn.Module) -> str:
    """``Gemma2Attention (gemma2)``: how errors name the layer that asked."""
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    return type(module).__name__ + (f" ({model_type})" if model_type else "")


def _attention_args(
    module: torch.nn.Module,
    query: torch.Tensor,
    dropout: float,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
    s_aux: torch.Tensor | None,
    is_causal: bool | None,
    kwargs: dict[str, Any],
) -> AttentionArgs:
    """Every argument transformers passed, honoured or refused: an argument varlen does not know stops."""
    # an argument given as None asks for nothing (BERT-style decoders hand on encoder_hidden_states=None)
    given = {k for k, v in kwargs.items() if v is not None}
    unknown = sorted(given - _BOUNDARY_KWARGS - _INERT_KWARGS - _INDEX_KWARGS - {"output_attentions"})
    if unknown:
        raise AttentionError(
            f"{architecture(module)} passes {', '.join(unknown)} to its attention function, which padless's "
            "varlen backend does not implement; it stops rather than ignore it. Use attn_implementation="
            "eager for this model, or report it with `padless doctor` output."
        )
    if kwargs.get("output_attentions"):
        raise AttentionError(
            "varlen computes no attention weights (output_attentions=True); use attn_implementation=eager"
        )
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if sliding_window is not None and not causal:
        raise AttentionError(
            f"{architecture(module)} asks for bidirectional sliding-window attention; transformers' own "
            "kernels disagree on its width (masks: |i - j| <= window, flash: < window), so varlen refuses "
            "rather than pick one. Use attn_implementation=eager."
        )
    if s_aux is not None and s_aux.shape != (query.shape[1],):
        raise AttentionError(
            f"{architecture(module)} passes attention sinks of shape {tuple(s_aux.shape)}; varlen takes one "
            f"sink per query head ({query.shape[1]},)"
        )
    return AttentionArgs(
        scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
        causal=causal,
        window=sliding_window,
        softcap=softcap or None,
        sinks=s_aux,
        dropout=dropout,
    )


@functools.lru_cache(maxsize=8)
def _takes(kernel: Any, parameter: str) -> bool:
    """Whether ``kernel`` (a function of some installed version) has ``parameter``."""
    return parameter in inspect.signature(kernel).parameters


def _allowed(length: int, args: AttentionArgs, device: torch.device) -> torch.Tensor | None:
    """``[L, L]`` bool: which keys each query of one sequence sees (``None``: all of them)."""
    if not args.causal:
        return None
    i = torch.arange(length, device=device)
    allowed = i[:, None] >= i[None]
    if args.window is not None:
        allowed &= i[:, None] - i[None] < args.window
    return allowed


def _math_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    args: AttentionArgs,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sequences of one length written out: q ``[N, H, L, Dqk]``, k ``[N, Hkv, L, Dqk]``, v
    ``[N, Hkv, L, Dv]`` -> ``[N, H, L, Dv]``; ``allowed`` (broadcast to ``[N, H, Lq, Lk]``, boolean or
    additive) replaces the mask of ``args`` (tree segments, whose keys outnumber their queries).

    For what SDPA cannot express (soft-capping, sinks). Scores and softmax in fp32, as transformers'
    eager kernels do; memory ``N * H * L^2`` for these sequences only.
    """
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * args.scale
    if args.softcap is not None:
        scores = torch.tanh(scores / args.softcap) * args.softcap
    if allowed is None:
        allowed = _allowed(q.shape[2], args, q.device)
    if allowed is not None and allowed.dtype == torch.bool:
        scores = scores.masked_fill(~allowed, -math.inf)
    elif allowed is not None:  # additive (0 or -inf)
        scores = scores + allowed
    if args.sinks is not None:
        sink = args.sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    if args.dropout:
        probs = F.dropout(probs, p=args.dropout)
    return probs.to(v.dtype) @ v


def _sequence_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    args: AttentionArgs,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention over whole sequences of one (padded) length, ``[N, H, L, D]`` in and out (4D: SDPA's
    fused CPU and CUDA kernels take only 4D inputs; 3D ones run its unfused math kernel). ``allowed``:
    an explicit mask in place of the one ``args`` describe (see :func:`_math_attention`)."""
    if args.softcap is not None or args.sinks is not None:
        return _math_attention(q, k, v, args, allowed)
    if allowed is None and args.window is not None:
        allowed = _allowed(q.shape[2], args, q.device)
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=allowed,
        is_causal=args.causal and allowed is None,
        dropout_p=args.dropout,
        scale=args.scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )


def _exact_per_sequence(q, k, v, spans: list[Span], args: AttentionArgs) -> torch.Tensor:
    """Exact attention, one call per sequence: cost sum of L_i^2, never a [T, T] mask. For bidirectional
    layers, which would see the padding :class:`SequenceGroups` adds.

    Each row is split into its sequences and padding (views whose backward is one concatenation, where
    indexing would build a zero gradient of the whole tensor per sequence), and the outputs are
    concatenated back, zeros where a row is padding.
    """
    _, heads, length, _ = q.shape
    dim = v.shape[-1]
    rows = []
    for row, (qr, kr, vr) in enumerate(zip(q.split(1), k.split(1), v.split(1), strict=True)):
        sizes, is_sequence, end = [], [], 0
        for _, s, e in (span for span in spans if span[0] == row):
            if s > end:
                sizes.append(s - end)
                is_sequence.append(False)
            sizes.append(e - s)
            is_sequence.append(True)
            end = e
        if end < length:
            sizes.append(length - end)
            is_sequence.append(False)
        pieces = zip(qr.split(sizes, 2), kr.split(sizes, 2), vr.split(sizes, 2), is_sequence, strict=True)
        rows.append(
            torch.cat(
                [
                    _sequence_attention(qs, ks, vs, args) if real else q.new_zeros(1, heads, qs.shape[2], dim)
                    for qs, ks, vs, real in pieces
                ],
                dim=2,
            )
        )
    return torch.cat(rows).transpose(1, 2)


def padded_length(length: int) -> int:
    """The length a sequence is padded to for the grouped SDPA calls: a multiple of 8 up to 128 tokens,
    then of 1/16 of the next power of two (16 up to 256, 32 up to 512, ...): at most 7 tokens longer
    up to 64 tokens, at most 1/8 longer past them."""
    step = max(8, 1 << max(0, (length - 1).bit_length() - 4))
    return -(-length // step) * step


@dataclass(frozen=True)
class SequenceGroups:
    """The sequences of a batch in few SDPA calls, one per :func:`padded_length`: each sequence padded on
    the right to a length that depends on its own length only. Under a causal mask no query sees the
    padding after it, so every real output is its own sequence's, and SDPA computes every batch entry
    alike: a sequence's numbers do not depend on the other sequences of its batch, bit for bit (what
    RL's first-update ratios of exactly 1 rest on). The padding's outputs are dropped and pass back no
    gradient.

    ``slots`` ``[S]``: the position in the ``[B * T]`` layout each slot reads, group after group (a
    padding slot repeats its sequence's last token); ``back`` ``[B * T]``: the slot holding each
    position's output, ``S`` (a zero slot past the end) where a padded row has no sequence; ``owner``
    (``[S]``, plus the zero slot): the position whose token a slot holds, ``B * T`` for none.
    """

    slots: torch.Tensor
    owner: torch.Tensor
    back: torch.Tensor
    shapes: tuple[tuple[int, int], ...]  # (sequences, padded length) of each group, in slot order
    covered: bool  # every position holds a sequence's token
    padded: bool  # some slot is padding

    @classmethod
    def plan(cls, spans: list[Span], batch: int, length: int, device: torch.device) -> SequenceGroups:
        groups: dict[int, list[Span]] = {}
        for span in spans:
            groups.setdefault(padded_length(span[2] - span[1]), []).append(span)
        slots: list[int] = []
        owner: list[int] = []
        back = [-1] * (batch * length)
        shapes = []
        for size, members in sorted(groups.items(), reverse=True):
            for row, s, e in members:
                at = row * length
                back[at + s : at + e] = range(len(slots), len(slots) + e - s)
                slots += [*range(at + s, at + e), *[at + e - 1] * (size - (e - s))]
                owner += [*range(at + s, at + e), *[batch * length] * (size - (e - s))]
            shapes.append((len(members), size))
        covered = min(back) >= 0
        if not covered:  # the zero slot: no position's token
            back = [b if b >= 0 else len(slots) for b in back]
            owner.append(batch * length)
        padded = len(slots) > sum(e - s for _, s, e in spans)
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        return cls(as_tensor(slots), as_tensor(owner), as_tensor(back), tuple(shapes), covered, padded)


# cu_seqlens tensor -> the groups of its packed row, planned once per batch like its bounds.
_GROUPS: WeakIdKeyDictionary = WeakIdKeyDictionary()
# cu_seqlens tensor -> chunk size -> the groups of the chunks of its sequences (chunked attention).
_CHUNK_GROUPS: WeakIdKeyDictionary = WeakIdKeyDictionary()
# cu_seqlens tensor -> chunk size -> the cu_seqlens of the chunks of its sequences, for the fused kernels.
_CHUNK_BOUNDS: WeakIdKeyDictionary = WeakIdKeyDictionary()


class _Gather(torch.autograd.Function):
    """``x.index_select(0, index)`` whose backward is a gather too: input row ``r`` gets the gradient of
    output row ``inverse[r]`` (none where ``inverse[r] == len(output)``). Exact when no other output row
    that reads ``r`` has a gradient, which holds for :class:`SequenceGroups`' padding; the scatter-add
    that ``index_select``'s own backward runs (with a zero fill per call) took most of the grouped
    attention's time on CPU."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, none_row: bool):
        ctx.save_for_backward(inverse)
        ctx.none_row = none_row
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        if ctx.none_row:
            grad = torch.cat([grad, grad.new_zeros(1, *grad.shape[1:])])
        return grad.index_select(0, inverse), None, None, None


def _grouped_causal(q, k, v, groups: SequenceGroups, args: AttentionArgs) -> torch.Tensor:
    """Exact causal attention of every sequence in ``len(groups.shapes)`` SDPA calls (see
    :class:`SequenceGroups`): tokens gathered into the groups' padded rows and their outputs back."""
    batch, heads, length, _ = q.shape

    def gathered(t: torch.Tensor) -> torch.Tensor:  # [B, H, T, D] -> [S, H, D]
        flat = t.transpose(1, 2).reshape(batch * length, t.shape[1], t.shape[3])
        return _Gather.apply(flat, groups.slots, groups.back, not groups.covered)

    qs, ks, vs = gathered(q), gathered(k), gathered(v)
    outs, offset = [], 0
    for n, padded in groups.shapes:
        part = slice(offset, offset + n * padded)
        out = _sequence_attention(
            *(t[part].view(n, padded, *t.shape[1:]).transpose(1, 2) for t in (qs, ks, vs)), args
        )
        outs.append(out.transpose(1, 2).reshape(n * padded, heads, -1))
        offset += n * padded
    if not groups.covered:
        outs.append(q.new_zeros(1, heads, v.shape[-1]))
    out = _Gather.apply(torch.cat(outs), groups.back, groups.owner, groups.padded)
    return out.view(batch, length, heads, -1)


def fused_kernel_lacks(kernel: str, args: AttentionArgs, head_dim: int) -> str | None:
    """What of ``args`` the fused ``kernel`` cannot compute (``None``: it computes all of it).

    flash-attn's ``flash_attn_varlen_func`` takes causal masks, windows, soft-capping, dropout and GQA;
    PyTorch's ``varlen_attn`` takes causal masks, windows and GQA. Neither takes sinks; both take head
    sizes up to 256 (padless pads q, k and v to one size, a multiple of 8, and crops the output).
    """
    if args.sinks is not None:
        return "attention sinks (s_aux)"
    if kernel == "torch" and args.softcap is not None:
        return "attention soft-capping (softcap)"
    if kernel == "torch" and args.dropout:
        return "attention dropout"
    if head_dim > FUSED_MAX_HEAD_DIM:
        return f"head size {head_dim} (at most {FUSED_MAX_HEAD_DIM})"
    return None


def _flat_heads(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``[B, H, T, d]`` -> ``[B*T, H, dim]``, the head size padded to ``dim``, last dim contiguous."""
    padded = F.pad(t, (0, dim - t.shape[-1])) if t.shape[-1] != dim else t
    return padded.transpose(1, 2).reshape(t.shape[0] * t.shape[2], t.shape[1], dim)


def _fused_call(
    kernel: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    args: AttentionArgs,
) -> torch.Tensor:
    """One call of the fused ``kernel``: q ``[Tq, H, D]``, k and v ``[Tk, Hkv, D]`` (one head size, a
    multiple of 8), segments bounded by ``cu_q`` / ``cu_k``; causal masks and windows align at the bottom
    right of each segment, as both kernels document. Returns ``[Tq, H, D]``."""
    window = (-1, 0) if args.window is None else (args.window - 1, 0)  # (left, right), -1: unbounded
    if not args.causal:
        window = (-1, -1)
    if kernel == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max_q,
            max_k,
            dropout_p=args.dropout,
            softmax_scale=args.scale,
            causal=args.causal,
            window_size=window,
            softcap=args.softcap or 0.0,
        )
    from torch.nn.attention.varlen import varlen_attn

    gqa = {}
    if q.shape[1] != k.shape[1]:
        if _takes(varlen_attn, "enable_gqa"):
            gqa = {"enable_gqa": True}
        else:  # PyTorch < 2.13: each kv head repeated for the query heads that read it, as GQA does
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=args.scale, window_size=window, **gqa)


def _fused_varlen(
    kernel: str, q, k, v, spans: list[Span], args: AttentionArgs, packed_cu: torch.Tensor | None
) -> torch.Tensor:
    """One fused varlen call over all sequences; padded rows are gathered into a packed row and back.

    A packed row's own ``cu_seqlens`` (``packed_cu``) goes to the kernel as it is: no per-layer copy.
    """
    batch, heads, length, _ = q.shape
    out_dim = v.shape[-1]
    dim = -(-max(q.shape[-1], out_dim) // 8) * 8  # one head size for q, k and v, a multiple of 8
    lens = [e - s for _, s, e in spans]
    if packed_cu is not None and packed_cu.dtype == torch.int32 and packed_cu.device == q.device:
        cu = packed_cu
    else:
        cu = torch.tensor([0, *accumulate(lens)], dtype=torch.int32, device=q.device)
    max_len = max(lens)
    flat = [_flat_heads(t, dim) for t in (q, k, v)]  # [B*T, H, D]
    index = None
    if not (batch == 1 and spans[0][1] == 0 and spans[-1][2] == length):
        index = torch.cat(
            [torch.arange(r * length + s, r * length + e, device=q.device) for r, s, e in spans]
        )
        flat = [t[index] for t in flat]
    out = _fused_call(kernel, *flat, cu, cu, max_len, max_len, args)
    out = out[..., :out_dim]
    if index is not None:
        full = out.new_zeros(batch * length, heads, out_dim)
        full[index] = out
        out = full
    return out.reshape(batch, length, heads, out_dim)


def _kernel(module: torch.nn.Module, query: torch.Tensor, value: torch.Tensor, args: AttentionArgs) -> str:
    """The kernel this call runs (:func:`padless.forward.attention.varlen_kernel` of the choice the layer
    carries, or exact attention where the fused kernel lacks an argument and the choice is ``auto``),
    counted in :data:`KERNEL_CALLS`."""
    choice = attention.kernel_of(module)
    kernel = attention.varlen_kernel(query.device, query.dtype, choice)
    if kernel != "sdpa":
        lacking = fused_kernel_lacks(kernel, args, max(query.shape[-1], value.shape[-1]))
        if lacking:
            if choice != "auto":
                raise AttentionError(
                    f"varlen kernel {kernel!r} has no {lacking}, which {architecture(module)} needs; use "
                    "varlen_kernel=auto (such layers then run exact per-sequence attention) or sdpa"
                )
            _log_once(
                f"varlen: {kernel} has no {lacking} ({architecture(module)}): those layers run exact "
                "per-sequence attention instead"
            )
            kernel = "sdpa"
    KERNEL_CALLS[f"varlen:{kernel}"] += 1
    return kernel


# ----------------------------------------------------------------------------------------------------------
# Tree rows (padless.forward.tree): each segment's queries against its ancestors' keys and its own
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeGroups:
    """The segments of a tree row in few SDPA calls, one per (padded query length, padded key length)
    (:func:`padded_length` of each): a segment's queries padded on the right, its keys (its ancestors',
    then its own) likewise, and a mask per segment that aligns causality at the bottom right (query
    ``i`` of a segment with ``a`` ancestor keys sees keys ``j <= a + i``), so no real query sees padding.
    A group of segments without ancestors (roots, shared prefixes) is plain causal attention, as in
    :class:`SequenceGroups`.

    ``queries`` / ``keys`` ``[S]``: the row position each slot reads, group after group; ``back`` ``[R]``:
    the query slot holding each row position's output; ``owner`` ``[S]``: the row position a query slot
    holds, ``R`` for padding; ``offsets``: ``a`` of each segment, per group
    (``None`` for a group of segments without ancestors).
    """

    queries: torch.Tensor
    keys: torch.Tensor
    back: torch.Tensor
    owner: torch.Tensor
    padded: bool  # some query slot is padding
    shapes: tuple[tuple[int, int, int], ...]  # (segments, padded queries, padded keys) of each group
    offsets: tuple[torch.Tensor | None, ...]
    # (window, dtype) -> each group's additive mask (None: plain causal), built once per batch, not per layer
    _masks: dict[tuple[int | None, torch.dtype], tuple[torch.Tensor | None, ...]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @classmethod
    def plan(
        cls, bounds_q: tuple[int, ...], bounds_k: tuple[int, ...], keys: list[int], device
    ) -> TreeGroups:
        groups: dict[tuple[int, int, bool], list[int]] = {}
        for s, ((q0, q1), (k0, k1)) in enumerate(zip(pairwise(bounds_q), pairwise(bounds_k), strict=True)):
            root = k1 - k0 == q1 - q0
            groups.setdefault((padded_length(q1 - q0), padded_length(k1 - k0), root), []).append(s)
        queries: list[int] = []
        owner: list[int] = []
        key_slots: list[int] = []
        rows = bounds_q[-1]
        back = [0] * rows
        shapes, offsets = [], []
        for (size_q, size_k, root), members in sorted(groups.items(), reverse=True):
            for s in members:
                q0, q1, k0, k1 = bounds_q[s], bounds_q[s + 1], bounds_k[s], bounds_k[s + 1]
                back[q0:q1] = range(len(queries), len(queries) + q1 - q0)
                queries += [*range(q0, q1), *[q1 - 1] * (size_q - (q1 - q0))]
                owner += [*range(q0, q1), *[rows] * (size_q - (q1 - q0))]
                key_slots += [*keys[k0:k1], *[keys[k1 - 1]] * (size_k - (k1 - k0))]
            shapes.append((len(members), size_q, size_k))
            gaps = [(bounds_k[s + 1] - bounds_k[s]) - (bounds_q[s + 1] - bounds_q[s]) for s in members]
            offsets.append(None if root else torch.tensor(gaps, device=device))
        padded = len(queries) > rows  # then _Gather's backward reads padding's (zero) gradient at row R
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        return cls(
            as_tensor(queries),
            as_tensor(key_slots),
            as_tensor(back),
            as_tensor(owner),
            padded,
            tuple(shapes),
            tuple(offsets),
        )

    @staticmethod
    def allowed(offsets: torch.Tensor, size_q: int, size_k: int, window: int | None) -> torch.Tensor:
        """``[n, 1, Lq, Lk]``: causal at the bottom right of each segment (and within ``window``)."""
        i = torch.arange(size_q, device=offsets.device)[None, :, None] + offsets[:, None, None]
        j = torch.arange(size_k, device=offsets.device)[None, None]
        allowed = j <= i
        if window is not None:
            allowed &= i - j < window
        return allowed[:, None]

    def masks(self, window: int | None, dtype: torch.dtype) -> tuple[torch.Tensor | None, ...]:
        """Each group's mask (:meth:`allowed`) as an additive ``dtype`` mask (0 or -inf), ``None`` for a group
        of roots; made once per batch and window and read by every layer (SDPA would otherwise turn a
        boolean mask into this one in each call, forward and backward)."""
        key = (window, dtype)
        if key not in self._masks:
            self._masks[key] = tuple(
                None
                if offsets is None
                else torch.zeros((), dtype=dtype, device=offsets.device).masked_fill(
                    ~self.allowed(offsets, size_q, size_k, window), -math.inf
                )
                for (_, size_q, size_k), offsets in zip(self.shapes, self.offsets, strict=True)
            )
        return self._masks[key]


# cu_seq_lens_q tensor of a tree row -> its groups (or parts), planned once per batch like a packed row's.
_TREES: WeakIdKeyDictionary = WeakIdKeyDictionary()
_TREE_PARTS: WeakIdKeyDictionary = WeakIdKeyDictionary()

# PyTorch's fused CPU attention with each query's log-sum-exp, and its backward (private aten ops)
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


@dataclass(frozen=True)
class TreeParts:
    """A tree row's attention as parts that need no mask, merged through their log-sum-exp (on CPU).

    Each segment attends causally to itself (its own part), and fully to every key of its ancestors
    (``shared``: ``(q0, q1, k0, k1)``, queries ``q0:q1`` against keys ``k0:k1``; the segments that see
    the same contiguous run of ancestor keys side by side in the row, as a prefix's branches are, make one
    part). Own parts run as :class:`SequenceGroups` runs sequences: in few calls of segments padded on
    the right to a length that depends on their own (``slots`` ``[S]``: the row position each slot reads,
    a padding slot its segment's last one; ``zeroed``: the same with padding slots at ``R``, a zero row;
    ``back`` ``[R]``: the slot of each row position; ``groups``: ``(segments, padded length)``). No key
    is computed for a query that does not see it, nothing of a prefix is copied per branch, and causal
    parts skip their upper blocks, which a segment's mask in :class:`TreeGroups` cannot.
    """

    slots: torch.Tensor
    zeroed: torch.Tensor
    back: torch.Tensor
    groups: tuple[tuple[int, int], ...]
    shared: tuple[tuple[int, int, int, int], ...]

    @classmethod
    def plan(cls, bounds_q: tuple[int, ...], bounds_k: tuple[int, ...], keys: list[int], device) -> TreeParts:
        runs: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for (q0, q1), (k0, k1) in zip(pairwise(bounds_q), pairwise(bounds_k), strict=True):
            ancestors = keys[k0 : k1 - (q1 - q0)]  # then its own keys, the row's q0:q1
            if not ancestors:
                continue
            breaks = [i for i in range(1, len(ancestors)) if ancestors[i] != ancestors[i - 1] + 1]
            for a, b in pairwise([0, *breaks, len(ancestors)]):
                queries = runs.setdefault((ancestors[a], ancestors[b - 1] + 1), [])
                if queries and queries[-1][1] == q0:  # a sibling's queries just before: one part
                    queries[-1] = (queries[-1][0], q1)
                else:
                    queries.append((q0, q1))
        by_length: dict[int, list[tuple[int, int]]] = {}
        for q0, q1 in pairwise(bounds_q):
            by_length.setdefault(padded_length(q1 - q0), []).append((q0, q1))
        rows = bounds_q[-1]
        slots, zeroed, back, groups = [], [], [0] * rows, []
        for size, members in sorted(by_length.items(), reverse=True):
            for q0, q1 in members:
                back[q0:q1] = range(len(slots), len(slots) + q1 - q0)
                slots += [*range(q0, q1), *[q1 - 1] * (size - (q1 - q0))]
                zeroed += [*range(q0, q1), *[rows] * (size - (q1 - q0))]
            groups.append((len(members), size))
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        shared = tuple((q0, q1, k0, k1) for (k0, k1), spans in runs.items() for q0, q1 in spans)
        return cls(as_tensor(slots), as_tensor(zeroed), as_tensor(back), tuple(groups), shared)

    def own(
        self, *rows: torch.Tensor, zeroed: torch.Tensor | None = None
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        """Each group's slots of ``rows`` (``[R, H, ...]``) as ``[n, H, L, ...]``, ``zeroed`` (``[R, H, D]``)
        with its padding slots zero."""
        sizes = [n * size for n, size in self.groups]
        gathered = [t.index_select(0, self.slots).split(sizes) for t in rows]
        if zeroed is not None:
            padded = torch.cat([zeroed, zeroed.new_zeros(1, *zeroed.shape[1:])])
            gathered.append(padded.index_select(0, self.zeroed).split(sizes))
        for (n, size), *pieces in zip(self.groups, *gathered, strict=True):
            yield tuple(t.view(n, size, *t.shape[1:]).transpose(1, 2) for t in pieces)

    def to_rows(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """Each group's ``[n, H, L, ...]`` results back to the row, ``[R, H, ...]``."""
        slots = [t.transpose(1, 2).reshape(-1, *t.shape[1:2], *t.shape[3:]) for t in pieces]
        return torch.cat(slots).index_select(0, self.back)


def _tree_parts_run(args: AttentionArgs, q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :class:`TreeParts` computes this call: CPU tensors of a dtype its fused kernel takes,
    plain causal attention (no window, soft-cap, sinks or dropout) and value heads of the query's size."""
    plain = args.window is None and args.softcap is None and args.sinks is None and not args.dropout
    return (
        _CPU_FLASH is not None
        and _CPU_FLASH_BACKWARD is not None
        and plain
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and q.shape[-1] == v.shape[-1]
    )


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """``[L, H, ...]`` rows of a part -> ``[1, H, L, ...]`` as the kernels take them."""
    return t.transpose(0, 1)[None]


class _TreePartsAttention(torch.autograd.Function):
    """Attention of a tree row by :class:`TreeParts`: q, k, v ``[R, H, D]`` (k and v with q's heads) ->
    ``[R, H, D]``. Forward: each part's output and log-sum-exp, merged per query in fp32. Backward: each
    part's gradients from the kernel's backward given the *merged* output and log-sum-exp (the
    probabilities of a part's keys are then the whole softmax's), summed where parts share a position."""

    @staticmethod
    def forward(ctx, q, k, v, parts: TreeParts, scale: float):
        own = [_CPU_FLASH(*group, 0.0, True, scale=scale) for group in parts.own(q, k, v)]
        out = parts.to_rows([o for o, _ in own]).float()
        lse = parts.to_rows([lse for _, lse in own])
        for q0, q1, k0, k1 in parts.shared:
            o, part = _CPU_FLASH(
                _heads_first(q[q0:q1]),
                _heads_first(k[k0:k1]),
                _heads_first(v[k0:k1]),
                0.0,
                False,
                scale=scale,
            )
            o, part = o[0].transpose(0, 1), part[0].transpose(0, 1)  # [Lq, H, D], [Lq, H]
            before = lse[q0:q1]
            total = torch.logaddexp(before, part)
            out[q0:q1] = out[q0:q1] * (before - total).exp()[..., None] + o * (part - total).exp()[..., None]
            lse[q0:q1] = total
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.parts, ctx.scale = parts, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        parts, scale = ctx.parts, ctx.scale
        own = [
            _CPU_FLASH_BACKWARD(g, gq, gk, gv, go, gl.contiguous(), 0.0, True, scale=scale)
            for gq, gk, gv, go, gl, g in parts.own(q, k, v, out, lse, zeroed=grad)
        ]
        dq, dk, dv = (parts.to_rows([g[i] for g in own]).float() for i in range(3))
        for q0, q1, k0, k1 in parts.shared:
            pieces = (grad[q0:q1], q[q0:q1], k[k0:k1], v[k0:k1], out[q0:q1])
            gq, gk, gv = _CPU_FLASH_BACKWARD(
                *map(_heads_first, pieces), _heads_first(lse[q0:q1]).contiguous(), 0.0, False, scale=scale
            )
            dq[q0:q1] += gq[0].transpose(0, 1)
            dk[k0:k1] += gk[0].transpose(0, 1)
            dv[k0:k1] += gv[0].transpose(0, 1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _tree_attention(
    module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: AttentionArgs, kwargs
) -> torch.Tensor:
    """Attention of a tree row (:class:`padless.forward.tree.TreeRow`): segment ``s``'s queries (the row
    between ``cu_seq_lens_q[s]`` and ``[s + 1]``) against the row positions ``tree_keys`` lists between
    ``cu_seq_lens_k[s]`` and ``[s + 1]`` (its ancestors', then its own), causal at the bottom right.
    Keys are gathered, so the gradient of a prefix's keys and values is the sum over its branches."""
    problem = None
    if q.shape[0] != 1:
        problem = f"a tree row is one packed row, got a batch of {q.shape[0]} rows"
    elif not args.causal:
        problem = "it attends bidirectionally, so a shared prefix would see its branches"
    elif attention_chunk(module) is not None:
        problem = (
            "its chunked attention counts chunks from each sequence's start, which branches do not share"
        )
    elif getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
        problem = "its NoPE layers scale queries by their place in the row"
    if problem:
        raise AttentionError(
            f"{architecture(module)} cannot run a tree row: {problem}; set train.tree_packing: off"
        )
    cu_q, cu_k, keys = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"], kwargs["tree_keys"]
    kernel = _kernel(module, q, v, args)
    heads, out_dim = q.shape[1], v.shape[-1]
    if kernel != "sdpa":
        dim = -(-max(q.shape[-1], out_dim) // 8) * 8
        flat_q, flat_k, flat_v = (_flat_heads(t, dim) for t in (q, k, v))
        flat_k, flat_v = flat_k.index_select(0, keys), flat_v.index_select(0, keys)
        max_q, max_k = kwargs["max_length_q"], kwargs["max_length_k"]
        out = _fused_call(kernel, flat_q, flat_k, flat_v, cu_q, cu_k, max_q, max_k, args)
        return out[..., :out_dim].reshape(1, q.shape[2], heads, out_dim)
    if _tree_parts_run(args, q, v):
        parts = _TREE_PARTS.get(cu_q)
        if parts is None:
            parts = _TREE_PARTS[cu_q] = TreeParts.plan(
                sequence_bounds(cu_q), sequence_bounds(cu_k), keys.tolist(), q.device
            )
        rep = heads // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        rows = (t[0].transpose(0, 1) for t in (q, k, v))  # [R, H, D]
        return _TreePartsAttention.apply(*rows, parts, args.scale)[None]
    plan = _TREES.get(cu_q)
    if plan is None:
        plan = _TREES[cu_q] = TreeGroups.plan(
            sequence_bounds(cu_q), sequence_bounds(cu_k), keys.tolist(), q.device
        )
    flat_q, flat_k, flat_v = (t[0].transpose(0, 1) for t in (q, k, v))  # [R, H, D]
    # queries and outputs: one slot per row position (padding slots' gradients are zero): gathers both
    # ways; keys and values: a prefix's in every branch's slots, their gradients summed (index_select)
    qs = _Gather.apply(flat_q, plan.queries, plan.back, False)
    ks, vs = flat_k.index_select(0, plan.keys), flat_v.index_select(0, plan.keys)
    # split, not sliced: a slice's backward writes its gradient into zeros the size of the whole tensor,
    # once per group; a split's is one concatenation
    sizes_q = [n * size_q for n, size_q, _ in plan.shapes]
    sizes_k = [n * size_k for n, _, size_k in plan.shapes]
    masks = plan.masks(args.window, q.dtype)
    groups = zip(plan.shapes, qs.split(sizes_q), ks.split(sizes_k), vs.split(sizes_k), masks, strict=True)
    outs = []
    for (n, size_q, size_k), group_q, group_k, group_v, mask in groups:
        group_q = group_q.view(n, size_q, *qs.shape[1:]).transpose(1, 2)
        group_k, group_v = (t.view(n, size_k, *t.shape[1:]).transpose(1, 2) for t in (group_k, group_v))
        out = _sequence_attention(group_q, group_k, group_v, args, mask)
        outs.append(out.transpose(1, 2).reshape(n * size_q, heads, out_dim))
    return _Gather.apply(torch.cat(outs), plan.back, plan.owner, plan.padded)[None]


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``varlen`` backend as transformers calls it: :func:`attend`, through the sequence-parallel group
    the layer carries when its rows are split (``SequenceParallel.attend`` in
    :mod:`padless.forward.sequence_parallel`). Decided from the call and the layer alone, so activations
    recomputed in backward (gradient checkpointing, outside any engine pass) run as the forward did."""
    split = getattr(module, SPLIT_ATTRIBUTE, None)
    if split is None:
        return attend(module, query, key, value, attention_mask, *args, **kwargs)
    return split.attend(attend, module, query, key, value, attention_mask, *args, **kwargs)


def attend(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention within each sequence. q ``[B, H, T, Dqk]``, v ``[B, Hkv, T, Dv]`` -> out ``[B, T, H, Dv]``.

    Sequences come from ``cu_seq_lens_q`` (packed row), else from a 2D padding mask (left or right padded
    rows, as ``generate`` prefill sends), else from restarts of ``position_ids``. Honours causal or
    bidirectional attention (``is_causal``, else ``module.is_causal``), sliding windows, soft-capping,
    sinks, the scale and value head sizes that differ from the query's (MLA); refuses anything else.
    """
    if key.shape[2] != query.shape[2]:
        raise AttentionError(
            "the varlen backend runs whole sequences and takes no KV cache; generate with "
            "padless.rl.generate (which decodes with sdpa) or pass use_cache=False"
        )
    args = _attention_args(module, query, dropout, scaling, sliding_window, softcap, s_aux, is_causal, kwargs)
    if kwargs.get("tree_keys") is not None:
        return _tree_attention(module, query, key, value, args, kwargs), None
    batch, _, length, _ = query.shape
    if kwargs.get("indices") is not None:
        return _indexed_attention(module, query, key, value, attention_mask, args, kwargs), None
    spans = _spans(batch, length, attention_mask, kwargs)
    query = _query_temperature_per_sequence(module, query, spans)
    cu = kwargs.get("cu_seq_lens_q")
    chunk = attention_chunk(module)
    if chunk is not None:  # attention within chunks of each sequence: the chunks are the sequences
        spans = [(row, c, min(c + chunk, e)) for row, s, e in spans for c in range(s, e, chunk)]
    kernel = _kernel(module, query, value, args)
    if not spans:  # every row is padding
        return query.new_zeros(batch, length, query.shape[1], value.shape[-1]), None
    if kernel == "sdpa" and args.causal:
        planned = (_GROUPS if chunk is None else _CHUNK_GROUPS.setdefault(cu, {})) if cu is not None else {}
        slot = cu if chunk is None else chunk
        groups = planned.get(slot)
        if groups is None:
            groups = SequenceGroups.plan(spans, batch, length, query.device)
            if cu is not None:
                planned[slot] = groups
        return _grouped_causal(query, key, value, groups, args), None
    if kernel == "sdpa":
        return _exact_per_sequence(query, key, value, spans, args), None
    packed_cu = cu
    if chunk is not None and cu is not None:  # the kernel's cu_seqlens are the chunks', made once a batch
        chunked = _CHUNK_BOUNDS.setdefault(cu, {})
        if chunk not in chunked:
            starts = [0, *accumulate(e - s for _, s, e in spans)]
            chunked[chunk] = torch.tensor(starts, dtype=torch.int32, device=query.device)
        packed_cu = chunked[chunk]
    return _fused_varlen(kernel, query, key, value, spans, args, packed_cu), None


def _mask_spans(mask: torch.Tensor) -> list[Span]:
    """The sequences of a ``[B, 1, T, T]`` boolean block-causal mask (what transformers builds for a
    packed or padded batch): a real token sees itself, and a sequence starts where a real token does not
    see the one before it."""
    spans = []
    for row, m in enumerate(mask[:, 0]):
        real = m.diagonal().tolist()
        sees_previous = [False, *m.diagonal(-1).tolist()]
        start = None
        for p in range(len(real) + 1):
            boundary = p == len(real) or not real[p] or not sees_previous[p]
            if start is not None and boundary:
                spans.append((row, start, p))
                start = None
            if p < len(real) and real[p] and start is None:
                start = p
    return spans


def _indexed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    args: AttentionArgs,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """Sparse attention whose keys an indexer chose (DeepSeek-V3.2 / GLM-5 ``indexed_attention``):
    ``indices`` ``[B, T, k]`` are each query's chosen key positions in its row; a query attends to the
    chosen keys of its own sequence, causally. The indexer chose them against the per-sequence mask
    :func:`varlen_mask` builds for it, so they are those of each sequence alone. Exact, one SDPA call
    per sequence with its ``[L, L]`` mask (no fused kernel takes indices), written out where SDPA cannot
    express the layer (soft-capping, sinks)."""
    batch, heads, length, _ = query.shape
    if kwargs.get("cu_seq_lens_q") is not None or attention_mask is None:
        spans = _spans(batch, length, None, kwargs)
    elif attention_mask.dim() == 4 and attention_mask.dtype == torch.bool:
        spans = _mask_spans(attention_mask)
    else:
        spans = _spans(batch, length, attention_mask, kwargs)
    KERNEL_CALLS["varlen:sdpa"] += 1
    chosen = torch.zeros(batch, length, length, dtype=torch.bool, device=query.device)
    chosen.scatter_(-1, kwargs["indices"].long().clamp(0, length - 1), True)
    out = query.new_zeros(batch, length, heads, value.shape[-1])
    for row, s, e in spans:
        allowed = chosen[row, s:e, s:e]
        if (within := _allowed(e - s, args, query.device)) is not None:
            allowed = allowed & within
        q, k, v = (t[row : row + 1, :, s:e] for t in (query, key, value))
        if args.softcap is not None or args.sinks is not None:
            seq = _math_attention(q, k, v, args, allowed)
        else:
            seq = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=allowed,
                dropout_p=args.dropout,
                scale=args.scale,
                enable_gqa=heads != k.shape[1],
            )
        out[row, s:e] = seq[0].transpose(0, 1)
    return out


def attention_chunk(module: torch.nn.Module) -> int | None:
    """The chunk size of a chunked-attention layer (Llama 4's ``chunked_attention`` layers: a query sees
    the keys of its own chunk of ``attention_chunk_size`` positions only), ``None`` for any other layer.

    transformers expresses chunks only in the masks it builds, which ``varlen`` builds none of, so the
    layer's kind is read from its config's ``layer_types`` at its ``layer_idx``. Chunks count from each
    sequence's first token (position 0 in a packed row; the first real token of a padded row, where
    transformers counts them from too), so varlen attends within each chunk of each sequence.
    """
    config = getattr(module, "config", None)
    types = getattr(config, "layer_types", None) or ()
    if "chunked_attention" not in types:
        return None
    index = getattr(module, "layer_idx", None)
    if not isinstance(index, int):
        raise AttentionError(
            f"{architecture(module)} belongs to a model with chunked-attention layers but has no layer_idx, "
            "so varlen cannot tell whether it attends in chunks; use attn_implementation=sdpa or eager"
        )
    if types[index] != "chunked_attention":
        return None
    size = getattr(config, "attention_chunk_size", None)
    if not isinstance(size, int) or size <= 0:
        raise AttentionError(
            f"{architecture(module)} is a chunked_attention layer but its config's attention_chunk_size is "
            f"{size!r}; set a positive attention_chunk_size"
        )
    return size


def _query_temperature_per_sequence(
    module: torch.nn.Module, query: torch.Tensor, spans: list[Span]
) -> torch.Tensor:
    """Llama 4's NoPE layers with ``attn_temperature_tuning`` scale each query by
    ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))`` of its position ``p``, which the layer takes
    from ``arange`` over the whole row, not from ``position_ids``: in a packed row the later sequences
    would be scaled by their place in the row. Here each query's scale is moved to its position in its
    own sequence. Up to ``floor_scale - 1`` tokens every scale is exactly 1 and the query passes as it is.
    """
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return query
    length = query.shape[2]
    floor_scale, attn_scale = module.floor_scale, module.attn_scale
    if length < floor_scale:
        return query
    within = torch.arange(length, device=query.device).expand(query.shape[0], -1).clone()
    for row, s, e in spans:
        within[row, s:e] -= s

    def scales(positions: torch.Tensor) -> torch.Tensor:  # as Llama4TextAttention computes them
        return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0

    ratio = scales(within) / scales(torch.arange(length, device=query.device))
    return (query * ratio[:, None, :, None]).to(query.dtype)


_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.warning(message)


def varlen_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """Mask builder for ``varlen``: no 4D mask is built, a padding mask is handed on as it is (2D); except
    for a model with indexed sparse attention, whose indexer scores keys against the mask it is given:
    there transformers' own boolean mask (causal within each packed or padded sequence) is built, so the
    indexer chooses within each sequence."""
    config = kwargs.get("config")
    if set(getattr(config, "layer_types", None) or ()) & attention.INDEXED_LAYER_TYPES:
        return sdpa_mask(*args, attention_mask=attention_mask, **{**kwargs, "allow_is_causal_skip": False})
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask.bool()


def register() -> None:
    """Make ``varlen`` known to transformers (idempotent)."""
    AttentionInterface.register(VARLEN_NAME, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN_NAME, varlen_mask)


register()
