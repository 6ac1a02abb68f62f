"""Stateful layers on CUDA through the kernels the field uses, each told where the packed sequences start.

Three layer kinds mix tokens through functions their transformers modeling file calls by module-level
name, which resolve to the CUDA kernels when their packages are installed:

- a gated delta-net (Qwen3-Next, Qwen3.5): a short causal convolution over its q/k/v projections
  (``causal_conv1d_fn``) and the delta rule's recurrent state (``torch_chunk_gated_delta_rule``,
  flash-linear-attention's ``chunk_gated_delta_rule``);
- a short convolution (LFM2 family's ``ShortConv``): ``causal_conv1d_fn`` alone;
- a Mamba-2 mixer (Bamba, Nemotron-H, Falcon-H1, GraniteMoeHybrid): ``causal_conv1d_fn`` over x, B and C,
  then the chunked state-space scan ``mamba2_chunk_scan`` (mamba-ssm's ``mamba_chunk_scan_combined``).

transformers hands these functions no boundaries, so packed sequences leak through them. On CUDA with the
packages installed, padless runs the layer's own forward on the whole packed row with those functions
answered by the kernels told the boundaries as each documents them: ``causal_conv1d_fn(x, ...,
seq_idx=...)`` (``x`` channel-last, one int32 index per token, the only layout that takes ``seq_idx``),
``chunk_gated_delta_rule(..., cu_seqlens=...)`` and ``mamba_chunk_scan_combined(..., seq_idx=...)`` (its
``cu_seqlens`` only returns each sequence's last state, which padless does not need). A Mamba-2 mixer in
training mode first tries ``mamba_split_conv1d_scan_combined`` (convolution, scan, norm and projection
fused); inside this branch that call answers ``None``, transformers' own signal to run the two kernels
above instead, so every token-mixing step sees the boundaries.

The functions are replaced once per modeling module by adapters that take the kernel path only inside
a runner of this module (a context variable, so a thread generating meanwhile, as RL's sampler does,
runs transformers' own functions). Where the kernels cannot run (no CUDA, a package missing, a
convolution outside the kernel's contract), the layer runs :func:`padless.forward.hybrid.run_exact`; but for
the want of a CUDA device (a CPU's default path) the log says why, once per kind and reason.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

log = logging.getLogger(__name__)

# the names transformers' forwards call
CONV, RULE = "causal_conv1d_fn", "torch_chunk_gated_delta_rule"
SCAN, FUSED = "mamba2_chunk_scan", "mamba2_split_conv1d_scan_combined"

# (cu_seqlens as int64, seq_idx [1, T] int32) of the packed row whose layer runs on the kernels now.
_ROW: ContextVar[tuple[torch.Tensor, torch.Tensor] | None] = ContextVar(
    "padless_state_kernel_row", default=None
)
# cu_seqlens tensor -> its (int64 copy, seq_idx), made once per batch.
_ROWS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_logged: set[tuple[str, str]] = set()


NO_CUDA = "the kernels need a CUDA device"  # the CPU's default path: exact, nothing to say


def kernel_problem(device: torch.device, packages: dict[str, str]) -> str | None:
    """Why the kernels of ``packages`` (import name -> pip name) cannot run on ``device`` (``None``: they
    can)."""
    if device.type != "cuda":
        return NO_CUDA
    missing = [pip for name, pip in packages.items() if importlib.util.find_spec(name) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (pip install {' '.join(missing)})"
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

    return rule


# what of transformers' call of the Mamba-2 scan the kernel gets (the rest is the mixer's own kwargs)
_SCAN_ARGS = ("D", "z", "dt_bias", "dt_softplus", "dt_limit")


def _scan(original: Any) -> Any:
    def scan(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, chunk_size: int, **kwargs: Any) -> torch.Tensor:  # fmt: skip
        row = _ROW.get()
        if row is None:
            return original(hidden_states, dt, A, B, C, chunk_size=chunk_size, **kwargs)
        if kwargs.get("initial_states") is not None or kwargs.get("return_final_states"):
            raise RuntimeError("padless runs Mamba-2 mixers on the kernels without a cache only")
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

        given = {k: kwargs[k] for k in _SCAN_ARGS if k in kwargs}
        return mamba_chunk_scan_combined(hidden_states, dt, A, B, C, chunk_size, seq_idx=row[1], **given)

    return scan


def _unfused(original: Any) -> Any:
    def fused(*args: Any, **kwargs: Any) -> torch.Tensor | None:
        return None if _ROW.get() is not None else original(*args, **kwargs)

    return fused


@dataclass(frozen=True)
class KernelPath:
    """One layer kind's kernel branch: the packages its kernels come from (import name -> pip name) and
    the functions of its modeling module answered by adapters (name -> adapter of the original)."""

    name: str
    packages: dict[str, str]
    adapters: dict[str, Callable[[Any], Any]]


CAUSAL_CONV = {"causal_conv1d": "causal-conv1d"}
PATHS: dict[str, KernelPath] = {
    "gated_delta_net": KernelPath(
        "gated delta-net", {**CAUSAL_CONV, "fla": "flash-linear-attention"}, {CONV: _conv, RULE: _rule}
    ),
    "short_conv": KernelPath("short convolution", CAUSAL_CONV, {CONV: _conv}),
    "mamba2": KernelPath(
        "Mamba-2 mixer",
        {**CAUSAL_CONV, "mamba_ssm": "mamba-ssm"},
        {CONV: _conv, SCAN: _scan, FUSED: _unfused},
    ),
}


def contract_problem(module: torch.nn.Module, path: KernelPath) -> str | None:
    """What of this layer the kernels do not take (``None``: nothing): ``causal_conv1d_fn`` takes
    ``seq_idx`` only channel-last, which needs channels in multiples of 8, widths 2 to 4; and the
    layer's modeling module must call the functions the branch answers."""
    conv = next(
        (c for c in module.children() if isinstance(c, torch.nn.Conv1d) and c.groups == c.in_channels), None
    )
    if conv is None:
        return f"{type(module).__name__} has no depthwise Conv1d"
    width = conv.kernel_size[0]
    if conv.in_channels % 8 or not 2 <= width <= 4:
        return f"{conv.in_channels} channels, width {width} (the kernel takes 8k channels, width 2-4)"
    modeling = sys.modules.get(type(module).__module__)
    missing = [name for name in path.adapters if not callable(getattr(modeling, name, None))]
    if missing:
        return f"{type(module).__module__} calls no {' / '.join(missing)}"
    return None


def _adapt(modeling: Any, path: KernelPath) -> None:
    """Answer the modeling module's functions with the path's adapters (once each)."""
    for name, adapter in path.adapters.items():
        original = getattr(modeling, name)
        if not hasattr(original, "padless_original"):
            adapted = adapter(original)
            adapted.padless_original = original
            setattr(modeling, name, adapted)


def run_on_kernels(
    kind: str,
    exact: Callable[..., torch.Tensor],
    module: torch.nn.Module,
    forward: Any,
    hidden: torch.Tensor,
    bounds: Any,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """A :data:`padless.forward.hybrid.RUNNERS` runner (with ``kind`` and ``exact`` bound): a packed row on
    the kernels with its boundaries, where they can run; else ``exact``
    (:func:`padless.forward.hybrid.run_exact`), said once in the log unless only because there is no CUDA
    device (a CPU's default)."""
    path = PATHS[kind]
    packed = bounds.cu_seqlens is not None and bounds.batch == 1 and not bounds.whole_rows
    problem = (
        kernel_problem(hidden.device, path.packages) or contract_problem(module, path)
        if packed
        else "not a packed row"
    )
    if problem is not None:
        if packed and problem != NO_CUDA and (kind, problem) not in _logged:
            _logged.add((kind, problem))
            log.warning(
                f"{path.name} {type(module).__name__}: {problem}; it runs the exact per-sequence path"
            )
        return exact(module, forward, hidden, bounds, kwargs)
    _adapt(sys.modules[type(module).__module__], path)
    token = _ROW.set(_row(bounds.cu_seqlens))
    try:
        return forward(hidden, **kwargs)
    finally:
        _ROW.reset(token)
