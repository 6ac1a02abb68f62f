"""Gated delta-nets on CUDA through the kernels the field uses, each told where the packed sequences start.

A gated delta-net layer (Qwen3-Next, Qwen3.5) mixes tokens twice: a short causal convolution over its
q/k/v projections and the delta rule's recurrent state. transformers' forward calls both through two
module-level functions of its modeling file (``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``),
which resolve to causal-conv1d and flash-linear-attention when installed, but it hands the convolution no
``seq_idx``, so packed sequences still leak through it. On CUDA with both packages, padless runs the
layer's own forward on the whole packed row with those two functions answered by
``causal_conv1d_fn(x, ..., seq_idx=...)`` (channel-last ``x``, one int32 index per token, as the kernel
documents) and ``chunk_gated_delta_rule(..., cu_seqlens=...)``: every sequence starts from zero state.

The two functions are replaced once per modeling module by adapters that take the kernel path only
inside :func:`run_gated_delta_net` (a context variable, so a thread generating meanwhile, as RL's
sampler does, runs transformers' own functions). Where the kernels cannot run (no CUDA, a package
missing, a convolution outside the kernel's contract), the layer runs :func:`padless.hybrid.run_exact`;
on CUDA the log says why, once.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from contextvars import ContextVar
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

log = logging.getLogger(__name__)

CONV, RULE = "causal_conv1d_fn", "torch_chunk_gated_delta_rule"  # the names transformers' forward calls
PACKAGES = {"causal_conv1d": "causal-conv1d", "fla": "flash-linear-attention"}

# (cu_seqlens as int64, seq_idx [1, T] int32) of the packed row whose layer runs on the kernels now.
_ROW: ContextVar[tuple[torch.Tensor, torch.Tensor] | None] = ContextVar(
    "padless_state_kernel_row", default=None
)
# cu_seqlens tensor -> its (int64 copy, seq_idx), made once per batch.
_ROWS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_logged: set[str] = set()


def kernel_problem(device: torch.device) -> str | None:
    """Why the kernels cannot run on ``device`` (``None``: they can)."""
    if device.type != "cuda":
        return "the kernels need a CUDA device"
    missing = [pip for name, pip in PACKAGES.items() if importlib.util.find_spec(name) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (pip install {' '.join(missing)})"
    return None


def contract_problem(module: torch.nn.Module) -> str | None:
    """What of this layer ``causal_conv1d_fn`` with ``seq_idx`` does not take (``None``: nothing): the
    channel-last layout it requires for ``seq_idx`` needs channels in multiples of 8, widths 2 to 4."""
    conv = getattr(module, "conv1d", None)
    if not isinstance(conv, torch.nn.Conv1d):
        return f"{type(module).__name__} has no conv1d"
    width = conv.kernel_size[0]
    if conv.in_channels % 8 or not 2 <= width <= 4:
        return f"{conv.in_channels} channels, width {width} (the kernel takes 8k channels, width 2-4)"
    modeling = sys.modules.get(type(module).__module__)
    if (
        modeling is None
        or not callable(getattr(modeling, CONV, None))
        or not callable(getattr(modeling, RULE, None))
    ):
        return f"{type(module).__module__} calls no {CONV} / {RULE}"
    return None


def _row(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    row = _ROWS.get(cu_seqlens)
    if row is None:
        lengths = cu_seqlens.diff()
        seq_idx = torch.repeat_interleave(
            torch.arange(len(lengths), dtype=torch.int32, device=cu_seqlens.device), lengths
        )[None]
        row = _ROWS[cu_seqlens] = (cu_seqlens.long(), seq_idx)
    return row


def _conv(original: Any) -> Any:
    def conv(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             activation: str | None = None, **kwargs: Any) -> torch.Tensor:  # fmt: skip
        row = _ROW.get()
        if row is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        from causal_conv1d import causal_conv1d_fn

        channel_last = hidden_states.transpose(1, 2).contiguous().transpose(1, 2)
        return causal_conv1d_fn(channel_last, weight, bias, seq_idx=row[1], activation=activation)

    conv.padless_original = original
    return conv


def _rule(original: Any) -> Any:
    def rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        row = _ROW.get()
        if row is None:
            return original(query, key, value, g=g, beta=beta, **kwargs)
        if kwargs.get("initial_state") is not None or kwargs.get("output_final_state"):
            raise RuntimeError("padless runs gated delta-nets on the kernels without a cache only")
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        return chunk_gated_delta_rule(
            query,
            key,
            value,
            g=g,
            beta=beta,
            use_qk_l2norm_in_kernel=kwargs.get("use_qk_l2norm_in_kernel", False),
            cu_seqlens=row[0],
        )

    rule.padless_original = original
    return rule


def _adapt(modeling: Any) -> None:
    """Answer the modeling module's two functions with the adapters (once)."""
    if not hasattr(getattr(modeling, CONV), "padless_original"):
        setattr(modeling, CONV, _conv(getattr(modeling, CONV)))
    if not hasattr(getattr(modeling, RULE), "padless_original"):
        setattr(modeling, RULE, _rule(getattr(modeling, RULE)))


def run_gated_delta_net(
    module: torch.nn.Module, forward: Any, hidden: torch.Tensor, bounds: Any, kwargs: dict[str, Any]
) -> torch.Tensor:
    """A :data:`padless.hybrid.RUNNERS` runner: a packed row on the kernels with its boundaries, where
    they can run; else :func:`padless.hybrid.run_exact` (on CUDA, said once in the log)."""
    from padless.hybrid import run_exact

    packed = bounds.cu_seqlens is not None and bounds.batch == 1 and not bounds.whole_rows
    problem = kernel_problem(hidden.device) or contract_problem(module) if packed else "not a packed row"
    if problem is not None:
        if packed and hidden.device.type == "cuda" and problem not in _logged:
            _logged.add(problem)
            log.warning(
                f"gated delta-net {type(module).__name__}: {problem}; it runs the exact per-sequence path"
            )
        return run_exact(module, forward, hidden, bounds, kwargs)
    _adapt(sys.modules[type(module).__module__])
    token = _ROW.set(_row(bounds.cu_seqlens))
    try:
        return forward(hidden, **kwargs)
    finally:
        _ROW.reset(token)
