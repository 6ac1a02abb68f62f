"""Stateful layers kept apart per sequence: every sequence of a packed row starts at zero state.

Hybrid models mix tokens not only in attention but in layers that carry a state from token to token:
gated delta-nets (Qwen3-Next, Qwen3.5, OLMo-Hybrid), short causal convolutions (LFM2 / LFM3), Mamba-2
mixers (Bamba, Falcon-H1, Nemotron-H, GraniteMoeHybrid) and Mamba-1 mixers (Jamba, Mamba). In a packed
row that state runs from one sequence into the next, and transformers' PyTorch path refuses the
boundaries (``cu_seqlens`` / ``seq_idx``) its CUDA kernels would take.

:func:`install` finds those layers by what they are (a depthwise ``Conv1d`` over time, a state decay
``A_log``), not by name, and wraps each so that a call on a packed (or padded) row runs through the
runner of its kind (:data:`RUNNERS`), which gets the packed inputs and the sequence boundaries. The
default runner, :func:`run_exact`, runs the layer's own forward on the sequences regrouped into
right-padded rows of similar length (:class:`padless.forward.varlen.SequenceGroups`): a causal layer's outputs
on a sequence's tokens do not depend on padding after them, so each token's output is the one of its
sequence alone. A runner that calls a kernel with the boundaries it documents can replace it per kind.

With a cache (``generate``) a layer runs as transformers wrote it: cached decoding is the model's own,
checked equal to one-by-one decoding in the tests. Layer kinds no runner covers are refused
where a model is loaded and proven (:func:`packing_problem`), with the reason.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from padless.errors import AttentionError
from padless.forward.attention import ATTENTION_LAYER_TYPES, text_config
from padless.forward.hybrid_kernels import run_on_kernels
from padless.forward.varlen import _GROUPS, SequenceGroups, Span, _Gather, _spans

# Keyword arguments that describe where sequences lie; a runner passes them on only where its kernel
# takes them. transformers' PyTorch fallbacks refuse ``cu_seqlens`` / ``seq_idx``.
BOUNDARY_KWARGS = frozenset(
    {
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "position_ids",
        "seq_idx",
        "cu_seqlens",
    }
)


@dataclass(frozen=True)
class Boundaries:
    """Where the sequences of a ``[B, T]`` call lie: ``spans`` (row, start, end), and the packed row's own
    ``cu_seqlens`` when the call has one (what varlen kernels take as they are)."""

    spans: list[Span]
    batch: int
    length: int
    cu_seqlens: torch.Tensor | None

    @property
    def whole_rows(self) -> bool:
        """Each row is one sequence with no padding: the layer's own forward is already exact."""
        return len(self.spans) == self.batch and all(s == 0 and e == self.length for _, s, e in self.spans)


# forward(hidden_states, **kwargs) of the wrapped layer as transformers wrote it.
Forward = Callable[..., torch.Tensor]
# (layer, its own forward, hidden states [B, T, H], boundaries, other kwargs) -> outputs [B, T, H]
Runner = Callable[[torch.nn.Module, Forward, torch.Tensor, Boundaries, dict[str, Any]], torch.Tensor]


def run_exact(
    module: torch.nn.Module,
    forward: Forward,
    hidden: torch.Tensor,
    bounds: Boundaries,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """The layer's own forward on every sequence alone, in few calls: sequences grouped by padded length
    into right-padded rows (padding after a sequence cannot reach it through a causal state), outputs
    gathered back, zeros where a row is padding. Backward passes through the same gathers."""
    if bounds.whole_rows:
        return forward(hidden, **kwargs)
    batch, length, width = hidden.shape
    # the groups varlen attention plans for the same packed row (whole sequences), planned once a batch
    groups = _GROUPS.get(bounds.cu_seqlens) if bounds.cu_seqlens is not None else None
    if groups is None:
        groups = SequenceGroups.plan(bounds.spans, batch, length, hidden.device)
        if bounds.cu_seqlens is not None:
            _GROUPS[bounds.cu_seqlens] = groups
    flat = _Gather.apply(hidden.reshape(batch * length, width), groups.slots, groups.back, not groups.covered)
    outs, offset = [], 0
    for n, padded in groups.shapes:
        out = forward(flat[offset : offset + n * padded].view(n, padded, width), **kwargs)
        outs.append(out.reshape(n * padded, out.shape[-1]))
        offset += n * padded
    if not groups.covered:
        outs.append(hidden.new_zeros(1, outs[0].shape[-1]))
    out = _Gather.apply(torch.cat(outs), groups.back, groups.owner, groups.padded)
    return out.view(batch, length, -1)


def run_exact_pair(
    module: torch.nn.Module,
    forward: Forward,
    hidden: torch.Tensor,
    bounds: Boundaries,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """:func:`run_exact` for a layer whose forward returns ``(output, state)`` (MiniMax's lightning
    attention and its ``K^T V`` state): the output per sequence, and no state, which on a packed row
    would be the last sequence's (only a cache reads it, and cached calls run as written)."""
    return run_exact(module, lambda h, **kw: forward(h, **kw)[0], hidden, bounds, kwargs), None


# Layer kind -> how a packed call of it runs. One entry per kind padless keeps apart exactly.
RUNNERS: dict[str, Runner] = {
    # on CUDA kernels told the boundaries (padless.forward.hybrid_kernels), else run_exact
    **{
        kind: functools.partial(run_on_kernels, kind, run_exact)
        for kind in ("gated_delta_net", "short_conv", "mamba2")
    },
    "mamba": run_exact,
    "lightning": run_exact_pair,
    "delta_net": run_exact,
}


def _decayed_linear_attention(module: torch.nn.Module) -> bool:
    """A linear attention whose ``K^T V`` state decays at a per-head slope, computed in blocks with a
    within-block decay matrix (MiniMax's lightning attention): buffers ``slope_rate`` and
    ``diagonal_decay``."""
    return {"slope_rate", "diagonal_decay"} <= dict(module.named_buffers(recurse=False)).keys()


def _depthwise_conv(module: torch.nn.Module) -> bool:
    """A child ``Conv1d`` with one filter per channel: a short causal convolution over time."""
    return any(
        isinstance(c, torch.nn.Conv1d) and c.groups == c.in_channels == c.out_channels > 1
        for c in module.children()
    )


def layer_kind(module: torch.nn.Module) -> str | None:
    """The stateful kind of ``module`` (``None``: it carries no state across tokens that padless knows):
    a depthwise time convolution with a learned state decay ``A_log`` is a state-space or delta-net
    mixer; Mamba-1 selects per token through ``x_proj`` / ``dt_proj``, Mamba-2 has a skip ``D`` and one
    input projection, a delta-net writes keys and values into its state (with the decay in a gate of its
    own: Kimi's delta attention, run per sequence by :func:`run_exact`); a depthwise convolution with
    input and output projections and no decay is a short convolution (LFM2); a decayed linear attention
    (:func:`_decayed_linear_attention`) is a lightning attention (MiniMax)."""
    if _decayed_linear_attention(module):
        return "lightning"
    if not _depthwise_conv(module):
        return None
    own = dict(module.named_parameters(recurse=False))
    children = dict(module.named_children())
    if "A_log" in own:
        if {"x_proj", "dt_proj"} <= set(children):
            return "mamba"
        if "D" in own and "in_proj" in children:
            return "mamba2"
        return "gated_delta_net"
    if any("A_log" in dict(c.named_parameters(recurse=False)) for c in children.values()):
        return "delta_net"  # the decay in a gate of its own (Kimi's delta attention)
    if {"in_proj", "out_proj"} <= set(children) and not any(
        "A_log" in dict(c.named_parameters(recurse=False)) for c in module.modules()
    ):
        return "short_conv"
    return None


def carries_state(module: torch.nn.Module) -> bool:
    """Whether ``module`` mixes tokens through a state or a time convolution (covered by a kind or not):
    what must be kept apart per sequence, or refused."""
    own = dict(module.named_parameters(recurse=False))
    return _depthwise_conv(module) or "A_log" in own or _decayed_linear_attention(module)


def _layer_of(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """The decoder layer (an element of a ``ModuleList``) that holds the submodule ``name``, and the module
    that holds that ``ModuleList`` (the decoder, which runs the layers)."""
    parts, module, layer, decoder, parent = name.split("."), model, None, None, model
    for part in parts:
        child = getattr(module, part)
        if isinstance(module, torch.nn.ModuleList):
            layer, decoder = child, parent
        parent, module = module, child
    return layer, decoder


# the boundary kwargs a decoder layer's pre-hook records (position ids alone tell where sequences start)
RECORDED = ("cu_seq_lens_q", "position_ids")


class _DecoderCall:
    """Pre-hook of a decoder: the boundary kwargs of its call, for decoder layers that are handed none
    (Mamba's and Falcon-Mamba's blocks get hidden states and a mask only, and their decoder drops the
    rest). A bound method, so a deep copy of the model hooks its own copy, shared by its own wrappers."""

    def __init__(self) -> None:
        self.context: dict[str, Any] = {}

    def remember(self, _: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        self.context = {k: kwargs[k] for k in RECORDED if k in kwargs}


class _PerSequence:
    """A stateful layer's forward, replaced: cached calls run as written; others through the runner of
    its kind with the boundaries of the call (its own kwargs, else those its decoder layer received)."""

    def __init__(self, module: torch.nn.Module, kind: str) -> None:
        self.forward = module.forward
        self.kind = kind
        self.hooked = False  # its decoder layer records the boundaries of each call (see remember)
        self.decoder: _DecoderCall | None = None  # ... else its decoder's call does
        self.context: dict[str, Any] | None = {}  # ... of the current call; None once used

    def identity(self) -> tuple[Any, ...]:
        """What decides how this wrapper runs (its runner is looked up by kind at each call), for
        :func:`padless.proof.probe.prove`, which reuses a proof only where the code that runs is the same."""
        return type(self), self.kind, self.hooked, self.forward.__func__

    def _where(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The boundary kwargs of this call: its own, else those its decoder layer received, used once.

        A second use means the layer's forward ran again without its hooks: gradient checkpointing
        recomputing it in backward (transformers checkpoints ``forward``, not ``__call__``), when the
        recorded boundaries may be another batch's. That stops rather than guess.
        """
        own = {k: v for k, v in kwargs.items() if k in BOUNDARY_KWARGS}
        if "cu_seq_lens_q" in own or "position_ids" in own or not self.hooked:
            return own
        if self.context is None:
            raise AttentionError(
                f"{type(self.forward.__self__).__name__} gets no sequence boundaries from its decoder layer "
                "and ran again without it (gradient checkpointing recomputes layers in backward), so padless "
                "cannot tell where its packed sequences start; set model.gradient_checkpointing: false"
            )
        where, self.context = {**self.context, **own}, None
        return where

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        hidden = kwargs.pop("hidden_states") if "hidden_states" in kwargs else args[0]
        rest = args[1:] if args and hidden is args[0] else args
        if rest:
            raise AttentionError(
                f"{type(self.forward.__self__).__name__} got {len(rest)} positional arguments after its "
                "hidden states; padless's per-sequence wrapper takes them by name only"
            )
        cache = kwargs.get("cache", kwargs.get("cache_params"))
        if cache is not None:
            return self.forward(hidden, **kwargs)
        where = self._where(kwargs)
        position_ids = where.get("position_ids")
        if position_ids is not None and position_ids.dim() == 3:  # M-RoPE rows: the text row leads
            where["position_ids"] = position_ids[0]
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() == 2 and bool(mask.all()):
            mask = None  # no padding: the sequences are where the other kwargs say
        batch, length = hidden.shape[:2]
        spans = _spans(batch, length, mask, where)
        rest_kwargs = {k: v for k, v in kwargs.items() if k not in BOUNDARY_KWARGS and k != "attention_mask"}
        if "attention_mask" in kwargs:  # sequences run apart, padding only after them: no mask (a forward
            rest_kwargs["attention_mask"] = None  # may take it without a default: MiniMax's lightning)
        bounds = Boundaries(spans, batch, length, where.get("cu_seq_lens_q"))
        return RUNNERS[self.kind](self.forward.__self__, self.forward, hidden, bounds, rest_kwargs)

    def remember(self, _: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """Pre-hook of the decoder layer: the boundary kwargs of its call. A bound method, so a deep copy
        of the model (``copy.deepcopy``) hooks its own copy of this wrapper."""
        self.context = {k: kwargs[k] for k in RECORDED if k in kwargs}
        if not self.context and self.decoder is not None:
            self.context = dict(self.decoder.context)


def install(model: torch.nn.Module) -> list[str]:
    """Wrap every stateful layer of ``model`` whose kind has a runner (idempotent); returns their names.

    Each wrapped layer's decoder layer remembers the boundary kwargs of its call (a pre-hook), for
    layers whose decoder layer does not hand them on; where the decoder layer is handed none either,
    those its decoder's call got (a pre-hook of the decoder).
    """
    installed, decoders = [], {}
    for name, module in model.named_modules():
        kind = layer_kind(module)
        if kind is None or kind not in RUNNERS:
            continue
        installed.append(name)
        if isinstance(module.__dict__.get("forward"), _PerSequence):
            continue
        wrapper = _PerSequence(module, kind)
        module.forward = wrapper
        layer, decoder = _layer_of(model, name)
        if layer is not None:
            if id(decoder) not in decoders:
                decoders[id(decoder)] = _DecoderCall()
                decoder.register_forward_pre_hook(decoders[id(decoder)].remember, with_kwargs=True)
            wrapper.decoder = decoders[id(decoder)]
            layer.register_forward_pre_hook(wrapper.remember, with_kwargs=True)
            wrapper.hooked = True
    return installed


def _installed(module: torch.nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), _PerSequence)


def installed_layers(model: torch.nn.Module) -> list[str]:
    """Names of the stateful layers of ``model`` that run per sequence."""
    return [n for n, m in model.named_modules() if _installed(m)]


def sharded_problem(model: torch.nn.Module, strategy: str, world: int) -> str | None:
    """Why ``strategy`` cannot train ``model`` on ``world`` ranks, if it cannot: the exact path calls each
    stateful layer once per group of sequence lengths, a count that differs from rank to rank, and
    ZeRO-3 gathers a layer's parameters at every call with a collective all ranks must join (gloo stops
    with "collective mismatch"; NCCL would hang)."""
    stateful = installed_layers(model)
    if strategy != "zero3" or world < 2 or not stateful:
        return None
    return (
        f"ZeRO-3 on {world} processes with {type(model).__name__}: its layers that carry a state from token "
        f"to token ({stateful[0]}, ...) run once per group of sequence lengths, a number that differs "
        "between ranks, and ZeRO-3 gathers their parameters with a collective every rank must join; use "
        "FSDP2, DDP or ZeRO-2 (examples/accelerate/)"
    )


def unhandled(model: torch.nn.Module) -> list[str]:
    """Names of the modules of ``model`` that carry a state across tokens and are not kept apart per
    sequence (not installed, or of a kind no runner covers), outside every installed layer."""
    done = installed_layers(model)
    return [
        name
        for name, module in model.named_modules()
        if carries_state(module)
        and not _installed(module)
        and not any(name.startswith(f"{d}.") for d in done)
    ]


# Layer kinds of ``layer_types`` that mix no tokens (Nemotron-H's MLP and MoE blocks).
TOKENWISE_LAYER_TYPES = frozenset({"mlp", "moe"})


def handled_layer_types(model: torch.nn.Module, layer_types: list[str]) -> set[str]:
    """The kinds of ``layer_types`` whose every layer mixes no tokens or holds an installed stateful
    layer (found in the decoder's ``ModuleList`` of one entry per ``layer_types`` entry)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model  # not a vision tower's blocks
    layers = next(
        (m for m in decoder.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == len(layer_types)),
        None,
    )
    if layers is None:
        return set()
    covered: dict[str, bool] = {}
    for kind, layer in zip(layer_types, layers, strict=True):
        ok = kind in TOKENWISE_LAYER_TYPES or any(_installed(m) for m in layer.modules())
        covered[kind] = covered.get(kind, True) and ok
    return {kind for kind, ok in covered.items() if ok}


# Layer kinds padless cannot yet keep apart per sequence, and why; a kind not listed is taken to carry a
# state. An exact packed path for one of them (issue 18) removes it from the refusals here.
STATEFUL = "carry a state from token to token across packed sequence boundaries"
LAYER_PROBLEMS: dict[str, str] = {
    "compressed_sparse_attention": "attend to compressed blocks of the whole row",
    "heavily_compressed_attention": "attend to compressed blocks of the whole row",
}


def packing_problem(model: torch.nn.Module) -> str | None:
    """Why packed sequences cannot be kept apart in ``model`` (``None``: they can), with the reason.

    Linear-attention and state-space layers (Qwen3-Next, Qwen3.5, LFM2, Mamba hybrids) carry a state
    from token to token that position ids cannot reset; :func:`install` makes each
    sequence start at zero state in the kinds it knows. Any other stateful layer, and compressed
    attention (:data:`LAYER_PROBLEMS`, spanning the whole row), is refused.
    """
    config = text_config(model)
    name = getattr(config, "model_type", type(model).__name__)
    types = list(getattr(config, "layer_types", None) or ())
    handled = handled_layer_types(model, types) if types else set()
    other = sorted(
        {t for t in types if t not in ATTENTION_LAYER_TYPES and (t in LAYER_PROBLEMS or t not in handled)}
    )
    if other:
        why = sorted({LAYER_PROBLEMS.get(t, STATEFUL) for t in other})
        return (
            f"{name} has {', '.join(other)} layers, which {'; and '.join(why)} (padless keeps packed "
            "sequences apart in gated delta-net, short convolution, Mamba and lightning attention layers "
            "only, see padless.forward.hybrid); padless runs every forward packed, so it does not support "
            "this architecture"
        )
    stray = unhandled(model)
    if stray:
        return (
            f"{name}: {', '.join(stray[:3])}{' ...' if len(stray) > 3 else ''} {STATEFUL} and are not kept "
            "apart per sequence (padless.forward.hybrid.install wraps the gated delta-net, short "
            "convolution, Mamba and lightning attention layers it recognises); padless runs every forward "
            "packed, so it does not support this architecture"
        )
    return None


def require_packing(model: torch.nn.Module) -> None:
    """Refuse ``model`` if packed sequences cannot be kept apart in it (:func:`packing_problem`).

    Its layers are what they are from loading on: this runs where a model is loaded, proven
    (:func:`padless.proof.probe.probe_attention`) or put in an engine, never before each forward."""
    problem = packing_problem(model)
    if problem:
        raise AttentionError(problem)
