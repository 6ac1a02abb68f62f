"""Attention backends that run packed batches correctly, and proof that the requested one is running.

``varlen`` is our own backend, registered with transformers' ``AttentionInterface``: it reads the
sequence boundaries (``cu_seq_lens_q/k``) that :func:`padless.model.forward_packed` passes through the
model's forward and runs one causal attention per sequence. transformers' own ``sdpa``, ``eager``,
``flex_attention`` and ``flash_attention_2`` are driven through position_ids that restart per sequence,
with no attention mask and no KV cache (with a cache, transformers skips its per-sequence mask and
packed sequences silently attend to each other).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
from collections import Counter
from collections.abc import Iterator
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from padless.vision import uses_mrope

BACKENDS = ("varlen", "sdpa", "eager", "flex_attention", "flash_attention_2")
VARLEN_NAME = "padless_varlen"  # the name under which transformers sees our backend
VARLEN_KERNELS = ("auto", "sdpa", "torch", "flash_attn")

# kernel name -> number of attention-layer calls; read by the load-time probe and by `padless check`.
KERNEL_CALLS: Counter[str] = Counter()
_varlen_kernel_choice = "auto"


class AttentionError(RuntimeError):
    """The requested attention is not available, or would not compute what was asked."""


def hf_name(backend: str) -> str:
    """The ``attn_implementation`` string transformers needs for a padless backend name."""
    validate_backend_name(backend)
    return VARLEN_NAME if backend == "varlen" else backend


def validate_backend_name(backend: str) -> None:
    if backend not in BACKENDS:
        close = difflib.get_close_matches(str(backend), BACKENDS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise AttentionError(
            f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}.{hint}"
        )


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def torch_varlen_available() -> bool:
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def backend_problem(backend: str, device: torch.device | str, training: bool = False) -> str | None:
    """Why ``backend`` cannot run on ``device`` (``None`` when it can), with the fix."""
    validate_backend_name(backend)
    cuda = torch.device(device).type == "cuda"
    if backend == "flash_attention_2":
        if not cuda:
            return "flash_attention_2 needs a CUDA device; use attn_implementation=varlen on CPU"
        if not flash_attn_installed():
            return "flash_attention_2 needs the flash-attn package: pip install 'padless[flash]'"
    if backend == "flex_attention" and training and not cuda:
        return (
            "flex_attention has no backward pass on CPU (PyTorch: 'FlexAttention does not support backward "
            "on CPU'); train with attn_implementation=varlen or sdpa, or run on CUDA"
        )
    if backend == "varlen" and _varlen_kernel_choice != "auto":
        return varlen_kernel_problem(_varlen_kernel_choice, torch.device(device))
    return None


def require_backend(backend: str, device: torch.device | str, training: bool = False) -> None:
    problem = backend_problem(backend, device, training)
    if problem:
        raise AttentionError(problem)


def available_backends(device: torch.device | str, training: bool = False) -> list[str]:
    return [b for b in BACKENDS if backend_problem(b, device, training) is None]


# ----------------------------------------------------------------------------------------------------------
# The varlen backend
# ----------------------------------------------------------------------------------------------------------


def set_varlen_kernel(kernel: str) -> None:
    """Pin the kernel behind ``varlen`` (``auto`` picks per call from device and dtype)."""
    global _varlen_kernel_choice
    if kernel not in VARLEN_KERNELS:
        raise AttentionError(f"unknown varlen kernel {kernel!r}; choose one of {', '.join(VARLEN_KERNELS)}")
    _varlen_kernel_choice = kernel


def varlen_kernel_problem(kernel: str, device: torch.device) -> str | None:
    if kernel in ("torch", "flash_attn") and device.type != "cuda":
        return f"varlen kernel {kernel!r} needs a CUDA device; use varlen_kernel=sdpa (or auto) on CPU"
    if kernel == "torch" and not torch_varlen_available():
        return "varlen kernel 'torch' needs torch.nn.attention.varlen (PyTorch >= 2.10); upgrade torch"
    if kernel == "flash_attn" and not flash_attn_installed():
        return "varlen kernel 'flash_attn' needs the flash-attn package: pip install 'padless[flash]'"
    return None


def varlen_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """Which kernel ``varlen`` runs for tensors on ``device`` in ``dtype``.

    CUDA half precision uses flash-attn when installed, else PyTorch's ``varlen_attn``; everything else
    (CPU, or fp32 on CUDA, which the flash kernels do not take) runs exact per-sequence SDPA.
    """
    choice = _varlen_kernel_choice
    if choice == "auto":
        if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
            return "flash_attn" if flash_attn_installed() else "torch"
        return "sdpa"
    problem = varlen_kernel_problem(choice, device)
    if problem:
        raise AttentionError(problem)
    if choice != "sdpa" and dtype not in (torch.float16, torch.bfloat16):
        raise AttentionError(f"varlen kernel {choice!r} runs fp16/bf16 only, got {dtype}; use dtype=bfloat16")
    return choice


Span = tuple[int, int, int]  # (row, start, end) of one sequence inside a [B, T] layout


def _spans(
    batch: int, length: int, attention_mask: torch.Tensor | None, kwargs: dict[str, Any]
) -> list[Span]:
    """Where each sequence lies: from cu_seq_lens (packed), a 2D padding mask, or restarts of position_ids."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        if batch != 1:
            raise AttentionError(f"cu_seq_lens describe one packed row, got a batch of {batch} rows")
        bounds = cu.tolist()
        return [(0, s, e) for s, e in pairwise(bounds)]
    spans = []
    if attention_mask is not None:
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


def _sdpa_per_sequence(q, k, v, spans, scaling, dropout, sliding_window, causal=True) -> torch.Tensor:
    """Exact attention, one SDPA call per sequence: cost sum of L_i^2, never a [T, T] mask.

    Outputs are concatenated (zeros where a row is padding) rather than written into a preallocated
    tensor, whose backward would copy the whole tensor once per sequence.
    """
    batch, heads, length, dim = q.shape
    rows: list[list[torch.Tensor]] = [[] for _ in range(batch)]
    ends = [0] * batch
    for row, s, e in spans:
        if s > ends[row]:
            rows[row].append(q.new_zeros(heads, s - ends[row], dim))
        mask = None
        if causal and sliding_window is not None and e - s > sliding_window:
            i = torch.arange(e - s, device=q.device)
            mask = (i[:, None] >= i[None]) & (i[:, None] - i[None] < sliding_window)
        rows[row].append(
            F.scaled_dot_product_attention(
                q[row, :, s:e],
                k[row, :, s:e],
                v[row, :, s:e],
                attn_mask=mask,
                is_causal=causal and mask is None,
                dropout_p=dropout,
                scale=scaling,
                enable_gqa=heads != k.shape[1],
            )
        )
        ends[row] = e
    for row in range(batch):
        if ends[row] < length:
            rows[row].append(q.new_zeros(heads, length - ends[row], dim))
    return torch.stack([torch.cat(pieces, dim=1) for pieces in rows]).transpose(1, 2)


def _fused_varlen(kernel, q, k, v, spans, scaling, dropout, sliding_window, causal=True) -> torch.Tensor:
    """One fused varlen call over all sequences; padded rows are gathered into a packed row and back."""
    batch, heads, length, dim = q.shape
    lens = torch.tensor([e - s for _, s, e in spans], device=q.device)
    cu = torch.zeros(len(spans) + 1, dtype=torch.int32, device=q.device)
    cu[1:] = lens.cumsum(0)
    max_len = int(lens.max())
    flat = [t.transpose(1, 2).reshape(batch * length, t.shape[1], dim) for t in (q, k, v)]  # [B*T, H, D]
    contiguous = batch == 1 and spans[0][1] == 0 and spans[-1][2] == length
    index = None
    if not contiguous:
        index = torch.cat(
            [torch.arange(r * length + s, r * length + e, device=q.device) for r, s, e in spans]
        )
        flat = [t[index] for t in flat]
    window = ((sliding_window - 1, 0) if sliding_window else (-1, 0)) if causal else (-1, -1)
    if kernel == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        out = flash_attn_varlen_func(
            *flat,
            cu,
            cu,
            max_len,
            max_len,
            dropout_p=dropout,
            softmax_scale=scaling,
            causal=causal,
            window_size=window,
        )
    else:
        if dropout:
            raise AttentionError("PyTorch's varlen_attn has no dropout; set attention_dropout to 0")
        from torch.nn.attention.varlen import varlen_attn

        out = varlen_attn(
            *flat, cu, cu, max_len, max_len, scale=scaling, window_size=window, enable_gqa=heads != k.shape[1]
        )
    if index is not None:
        full = out.new_zeros(batch * length, heads, dim)
        full[index] = out
        out = full
    return out.reshape(batch, length, heads, dim)


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention within each sequence. Shapes: q ``[B, H, T, D]``, out ``[B, T, H, D]``.

    Causal unless the caller says ``is_causal=False`` (or the module does), as vision towers do.

    Sequences come from ``cu_seq_lens_q`` (packed row), else from a 2D padding mask (left or right padded
    rows, as ``generate`` prefill sends), else from restarts of ``position_ids``.
    """
    if key.shape[2] != query.shape[2]:
        raise AttentionError(
            "the varlen backend runs whole sequences and takes no KV cache; generate with padless.rollout "
            "(which decodes with sdpa) or pass use_cache=False"
        )
    batch, _, length, _ = query.shape
    spans = _spans(batch, length, attention_mask, kwargs)
    kernel = varlen_kernel(query.device, query.dtype)
    KERNEL_CALLS[f"varlen:{kernel}"] += 1
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    args = (query, key, value, spans, scaling, dropout, sliding_window, causal)
    if kernel == "sdpa":
        return _sdpa_per_sequence(*args), None
    return _fused_varlen(kernel, *args), None


def varlen_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """Mask builder for ``varlen``: no 4D mask is ever built; a padding mask is handed on as it is (2D)."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask.bool()


def runtime_context(backend: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Settings a backend needs around each forward.

    flex_attention on CPU: inductor miscompiles the dynamic-shape recompile that a second packed length
    triggers (C++ compile error in the flex template, torch 2.13), so compile each length statically.
    """
    if backend == "flex_attention" and torch.device(device).type == "cpu":
        from torch._dynamo import config as dynamo_config

        return dynamo_config.patch(automatic_dynamic_shapes=False)
    return contextlib.nullcontext()


def register() -> None:
    """Make ``varlen`` known to transformers (idempotent)."""
    AttentionInterface.register(VARLEN_NAME, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN_NAME, varlen_mask)


register()


# ----------------------------------------------------------------------------------------------------------
# Proof that the requested kernel runs
# ----------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def count_attention_calls() -> Iterator[Counter[str]]:
    """Count calls of every function registered in transformers' AttentionInterface, by name."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    mapping = ALL_ATTENTION_FUNCTIONS._global_mapping
    counts: Counter[str] = Counter()
    originals = dict(mapping)

    def counted(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        mapping[name] = counted(name, fn)
    try:
        yield counts
    finally:
        mapping.clear()
        mapping.update(originals)


def _text_config(model: torch.nn.Module) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def attention_in_use(model: torch.nn.Module) -> str:
    """The padless backend name the model's config dispatches to."""
    impl = _text_config(model)._attn_implementation
    return "varlen" if impl == VARLEN_NAME else str(impl)


def assert_attention(model: torch.nn.Module, backend: str) -> None:
    """Cheap guard before each forward: the config still dispatches to ``backend``.

    transformers writes ``attn_implementation`` into config objects, so a second model built from a
    shared config can silently switch this one's kernel.
    """
    running = attention_in_use(model)
    if running != backend:
        raise AttentionError(
            f"model was loaded with attention {backend!r} but its config now dispatches to {running!r}. "
            "Another model built from the same config object switched it: give every model its own config "
            "(padless.model.load_model does)."
        )


def probe_attention(model: torch.nn.Module, backend: str, tolerance: float | None = None) -> dict[str, Any]:
    """Prove ``backend`` runs and isolates packed sequences; raise :class:`AttentionError` if not.

    Runs two random sequences packed and each alone, counts calls of the registered attention functions,
    and compares per-token hidden states. Returns what it measured.
    """
    assert_attention(model, backend)
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    config = _text_config(model)
    layers = config.num_hidden_layers
    gen = torch.Generator().manual_seed(0)
    lens = (11, 5)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen).to(device) for n in lens]
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])[None]
    if uses_mrope(model.config):  # packed M-RoPE ids: the text row on 3 rope rows (all equal for text)
        positions = positions.expand(4, 1, -1)
    packed_kwargs = {
        "input_ids": torch.cat(seqs)[None],
        "position_ids": positions,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max(lens),
        "max_length_k": max(lens),
    }
    decoder = model.get_decoder()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), runtime_context(backend, device), count_attention_calls() as counts:
            packed = decoder(**packed_kwargs, use_cache=False).last_hidden_state[0].float()
            expected = {VARLEN_NAME if backend == "varlen" else backend: layers} if backend != "eager" else {}
            packed_calls = dict(counts)  # before the reference forwards below add their own calls
            if packed_calls != expected:
                got = ", ".join(f"{k}: {v}" for k, v in counts.items()) or "no registered function"
                raise AttentionError(
                    f"requested attention {backend!r} but a packed forward called {got} "
                    f"(expected {expected or 'the eager default'} over {layers} layers). transformers chose "
                    "another kernel; check attn_implementation and that the kernel's package is installed."
                )
            alone = torch.cat(
                [
                    decoder(
                        input_ids=s[None],
                        position_ids=torch.arange(len(s), device=device)[None],
                        use_cache=False,
                    )
                    .last_hidden_state[0]
                    .float()
                    for s in seqs
                ]
            )
    finally:
        model.train(was_training)
    delta = (packed - alone).abs().max().item()
    if tolerance is None:
        tolerance = 1e-3 if dtype == torch.float32 else 0.25
    if not delta <= tolerance:
        raise AttentionError(
            f"attention {backend!r} leaks between packed sequences: "
            f"max |delta hidden| {delta:.3g} > {tolerance:g}. "
            "Packed sequences attended to each other; report this with `padless doctor` output."
        )
    kernel = varlen_kernel(device, dtype) if backend == "varlen" else backend
    return {
        "backend": backend,
        "kernel": kernel,
        "calls": sum(packed_calls.values()),
        "max_delta_hidden": delta,
    }
