"""Proof, at load time, that a model trains on the numbers its own forward computes.

On a packed row of random sequences, padless's per-token log-probs (the requested attention backend,
padless's LM head on its whole, chunked and fused paths, a temperature applied as training applies it)
are compared with ``log_softmax`` of the model's *own* ``forward().logits`` on each sequence alone, on
transformers' eager attention. Whatever the model does that padless does not reproduce, whether
attention leaking between sequences, a dropped attention argument, or a logits transform padless has no
name for, shows as a difference over the round-off bound, and loading stops with it.

The bound (:func:`bound`): two kernels that attend over the same tokens sum in different orders, so their
results differ by round-off, and round-off is relative: a value of size ``M`` held in a dtype with machine
epsilon ``eps`` is only known to about ``eps * M``. A log-prob ``z_y - logsumexp(z)`` inherits the error of
the logits ``z`` (twice at most: once through ``z_y``, once through the log-sum-exp), and the logits
inherit it from every layer below. So the bound on a per-token difference is

    bound = ROUNDING_FACTOR * eps(dtype) * max(M, 1)

with ``M`` the largest |logit| (or |log-prob|, or |hidden state|: whatever is compared) of the
reference. ``ROUNDING_FACTOR`` covers the two log-prob terms and the accumulation through the layers:
across the model zoo (``padless check --zoo``, logits scaled to |logit| 30, log-probs down to -45) the
largest difference between any two backends and layouts was 3.9 ``eps * M`` in fp32 and 3.0 in bf16
(CPU), and 9.5e-6 = 2.9 ``eps * M`` was measured on real models at |logit| 28; 16 leaves a margin of 4.
In fp32 that is still far below what one sequence attending to another moves (1e-2 and up). In bf16 it
is not: at |logit| 30 round-off alone moves log-probs by up to a nat, so only fp32 checks can see small
leaks. ``max(M, 1)``: a difference is never known more precisely than ``eps`` itself. ``padless check``
and the invariance tests hold their comparisons to the same bound.

The proof reused within a process (:func:`prove`): a process that loads the same model several times (a
policy and its reference from one checkpoint, a test suite) would otherwise prove it each time: about a
second of forwards per load on CPU. The probe's verdict is a function of the model (its configs, every
parameter and buffer bit for bit, its modules, their instance-level forwards and hooks), of the backend
and kernel pin, and of the code that runs: padless, the modeling and attention code transformers
dispatches to, and torch's functions. :func:`prove` keeps each passed proof with a fingerprint of all of
that (strong references to every function and class in it, compared by identity, so no id is ever reused
by another object) and reuses it only on an identical fingerprint; a monkeypatched kernel, a changed
weight or config, another dtype, device or thread count is proven again (the train / eval mode is not in
it: the probe runs in eval mode). Nothing is written to or read from disk, and refusals are never kept.
Only CPU models are fingerprinted: hashing the weights reads each byte once, against the thousands of
operations per parameter the probe runs on CPU; on an accelerator the probe is cheap and the weights
would have to be copied to the host.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import sys
import types
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from padless.errors import AttentionError
from padless.forward.attention import (
    VARLEN_NAME,
    assert_attention,
    attention_layers,
    kernel_of,
    pinned,
    runtime_context,
    text_config,
)
from padless.forward.engine import backbone, lm_head, logps_from_hidden, score_head
from padless.forward.hybrid import _PerSequence, installed_layers, require_packing
from padless.forward.packing import IGNORE_INDEX, Example, pack
from padless.forward.routers import RouterLoss
from padless.forward.tree import share_prefixes, tree_inputs
from padless.forward.varlen import KERNEL_CALLS
from padless.forward.vision import uses_mrope

log = logging.getLogger(__name__)

ROUNDING_FACTOR = 16.0
FORMULA = f"bound = {ROUNDING_FACTOR:g} * eps(dtype) * max(M, 1), M = largest |logit| or |log-prob| compared"


def bound(dtype: torch.dtype, magnitude: float) -> float:
    """Largest |difference| allowed between two computations, in ``dtype``, of values up to ``magnitude``."""
    return ROUNDING_FACTOR * torch.finfo(dtype).eps * max(float(magnitude), 1.0)


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


# The sequences the probe packs: the lengths `padless check` compares (padless.proof.check.DEFAULT_LENGTHS),
# the longest grown past the model's sliding window or attention chunk when that is short enough to afford.
PROBE_LENGTHS = (4, 19, 77, 160)
PROBE_MAX_LENGTH = 1024
PROBE_TEMPERATURE = 0.7  # a temperature other than 1 on one path: RL divides the logits by its own
# Config keys whose value is a span of tokens that attention (or a layer's state) treats differently.
SPAN_KEYS = (
    "sliding_window",
    "attention_chunk_size",
    "chunk_size",
    "conv_kernel",
    "local_window_size",
    "block_size",  # lightning attention (MiniMax) carries its state from block to block
)


# While the probe runs, spans that restart per sequence but are longer than the probe's sequences (Llama 4's
# 8192-token attention chunks and temperature floor) are cut to these, so that the probe crosses them:
# where a chunk or a scale restarts does not depend on its size. The probe's result says what it cut.
PROBE_CHUNK = 16
PROBE_FLOOR_SCALE = 64
# weights whose round-off can hide a leak under the probe's bound: proven again in float32 (prove_packing)
SIXTEEN_BIT = (torch.bfloat16, torch.float16)


@contextlib.contextmanager
def spans_within_probe(model: torch.nn.Module) -> Iterator[dict[str, tuple[int, int]]]:
    """Cut ``attention_chunk_size`` to :data:`PROBE_CHUNK` and the ``floor_scale`` of temperature-tuned
    NoPE layers to :data:`PROBE_FLOOR_SCALE` inside the block (transformers reads the first from the
    config at each forward, the layers copied the second at init), then restore them exactly. Yields
    what was cut: ``{key: (model's value, probe's value)}``."""
    config = text_config(model)
    cut: dict[str, tuple[int, int]] = {}
    saved: list[tuple[Any, str, Any]] = []
    chunk = getattr(config, "attention_chunk_size", None)
    chunked = "chunked_attention" in (getattr(config, "layer_types", None) or ())
    if chunked and isinstance(chunk, int) and chunk > PROBE_CHUNK:
        saved.append((config, "attention_chunk_size", chunk))
        cut["attention_chunk_size"] = (chunk, PROBE_CHUNK)
    tuned = [m for m in model.modules() if getattr(m, "attn_temperature_tuning", False)]
    floor = getattr(config, "floor_scale", None)
    if tuned and isinstance(floor, int) and floor > PROBE_FLOOR_SCALE:
        saved += [(m, "floor_scale", m.floor_scale) for m in tuned] + [(config, "floor_scale", floor)]
        cut["floor_scale"] = (floor, PROBE_FLOOR_SCALE)
    try:
        for owner, key, _ in saved:
            setattr(owner, key, cut[key][1])
        yield cut
    finally:
        for owner, key, value in saved:
            setattr(owner, key, value)


class ReferenceForwardError(AttentionError):
    """transformers' own forward of the model failed, so there is nothing to prove padless against."""


def probe_lengths(config: Any) -> tuple[int, ...]:
    """:data:`PROBE_LENGTHS`, the longest past every window or chunk of ``config`` up to
    :data:`PROBE_MAX_LENGTH`, and never past the model's positions."""
    spans = [v for k in SPAN_KEYS if isinstance(v := getattr(config, k, None), int) and v > 0]
    longest = min(max([PROBE_LENGTHS[-1], *(s + 3 for s in spans)]), PROBE_MAX_LENGTH)
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 0:
        longest = min(longest, positions)
    return (*(min(n, longest) for n in PROBE_LENGTHS[:-1]), longest)


def _packed_kwargs(seqs: list[torch.Tensor], device: torch.device) -> dict[str, Any]:
    """The forward kwargs of ``seqs`` packed in one row, with their boundaries."""
    lens = [len(s) for s in seqs]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return {
        "input_ids": torch.cat(seqs)[None],
        "position_ids": torch.cat([torch.arange(n, device=device) for n in lens])[None],
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max(lens),
        "max_length_k": max(lens),
    }


def _configs(model: torch.nn.Module) -> list[Any]:
    """Every config object the model and its modules read their attention kernel from."""
    found: dict[int, Any] = {}
    stack = [model.config, *(getattr(m, "config", None) for m in model.modules())]
    while stack:
        config = stack.pop()
        if config is None or not hasattr(config, "_attn_implementation_internal") or id(config) in found:
            continue
        found[id(config)] = config
        stack += [getattr(config, key, None) for key in getattr(config, "sub_configs", {})]
    return list(found.values())


@contextlib.contextmanager
def _eager(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` on transformers' eager attention inside the block; afterwards every config (and
    sub-config) dispatches exactly where it did before."""
    saved = [(config, config._attn_implementation_internal) for config in _configs(model)]
    try:
        for config, _ in saved:
            config._attn_implementation_internal = "eager"
        yield
    finally:
        for config, implementation in saved:
            config._attn_implementation_internal = implementation


def model_name(model: torch.nn.Module) -> str:
    """``Qwen2ForCausalLM (qwen2)``: how errors name the architecture."""
    model_type = getattr(model.config, "model_type", None)
    return type(model).__name__ + (f" ({model_type})" if model_type else "")


@dataclass
class ProbeReference:
    """The probe's random sequences (:func:`probe_lengths`) and each run alone through the model's own
    forward on eager attention: its logits ``[L, V]`` (fp32) and the hidden states its LM head received
    ``[L, H]``. Independent of the backend proved: `padless check` computes it once per model.

    ``tree``: the same for :func:`tree_sequences` (sequences sharing nested prefixes, ``prompts`` leading
    tokens of each untrained), when the tree layout is proven too."""

    seqs: list[torch.Tensor]
    logits: list[torch.Tensor]  # a scalar-head model's: its head's own per-token outputs ``[L, 1]``
    head_inputs: list[torch.Tensor]
    # a causal LM's own ``forward(labels=...)``: (loss, router aux_loss or None) per sequence; empty where
    # its forward returns no loss, or fails given labels (then ``unasked`` says how)
    losses: list[tuple[float, float | None]] = field(default_factory=list)
    unasked: str | None = None
    prompts: list[int] | None = None
    tree: ProbeReference | None = None


def tree_sequences(seqs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """Sequences that share prefixes at two depths, made of the probe's own: the longest one's first half
    ``P`` and its next quarter ``Q``; then ``P Q`` + the second sequence, ``P Q`` + the first and ``P`` +
    half of the third. Returns them and their prompt lengths (``P Q``, ``P Q``, ``P``): packed, they make
    a tree with a node ``P``, a node ``Q`` below it and three leaves."""
    longest = seqs[-1]
    half, three_quarters = len(longest) // 2, 3 * len(longest) // 4
    shared, deeper = longest[:half], longest[:three_quarters]
    third = seqs[2][: max(1, len(seqs[2]) // 2)]
    tree = [torch.cat([deeper, seqs[1]]), torch.cat([deeper, seqs[0]]), torch.cat([shared, third])]
    return tree, [three_quarters, three_quarters, half]


def output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The scalar head of a reward / value model, ``None`` for a causal LM (whose head is its output
    embeddings): what the probe compares per token."""
    return score_head(model) if model.get_output_embeddings() is None else None


def probe_reference(model: torch.nn.Module, purpose: str, tree: bool = False) -> ProbeReference:
    """``model(input_ids)`` on each probe sequence alone, eager attention, no cache: transformers' own
    computation; with ``tree``, on each of :func:`tree_sequences` too. A failure in it is transformers',
    and is said to be (``purpose``: what it is the reference of, for the message)."""
    config = text_config(model)
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    with spans_within_probe(model):  # lengths past the spans as the probe cuts them
        seqs = [
            torch.randint(0, config.vocab_size, (n,), generator=gen).to(device) for n in probe_lengths(config)
        ]
        reference = _probe_reference(model, purpose, seqs)
        if tree:
            branches, prompts = tree_sequences(seqs)
            reference.tree = _probe_reference(model, purpose, branches)
            reference.tree.prompts = prompts
    return reference


def _probe_reference(model: torch.nn.Module, purpose: str, seqs: list[torch.Tensor]) -> ProbeReference:
    inputs: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    scalar = output_head(model)
    head = scalar if scalar is not None else lm_head(model)
    # a causal LM's own objective, router load-balancing term included where it has one
    objective: dict[str, Any] = {}
    if scalar is None:
        objective["labels"] = True
        if RouterLoss.of(model) is not None:
            objective["output_router_logits"] = True
    losses: list[tuple[float, float | None]] = []
    unasked = None  # why the model's own loss could not be asked for

    def record(_: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        inputs.append(args[0][0].float())
        outputs.append(out[0].float())

    hook = head.register_forward_hook(record)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), _eager(model):
            try:
                logits = [_own(model, s, objective, losses) for s in seqs]
            except Exception as e:  # its forward fails given labels / for its router loss: ask without
                if not objective:
                    raise
                unasked = f"forward({', '.join(f'{k}=...' for k in objective)}) failed: {_one_line(e)}"
                inputs.clear(), outputs.clear(), losses.clear()
                logits = [_own(model, s, {}, losses) for s in seqs]
        if scalar is not None:  # its forward pools one score per sequence: compare the head's per token
            logits, losses = outputs, []
    except Exception as e:
        raise ReferenceForwardError(
            f"{model_name(model)}: transformers' own forward failed on eager attention, the reference of "
            f"{purpose}: {type(e).__name__}: {' '.join(str(e).split())[:300]}. Nothing can be proved "
            "for this model, so padless does not train it; if it runs elsewhere, report it with "
            "`padless doctor` output."
        ) from e
    finally:
        hook.remove()
        model.train(was_training)
    return ProbeReference(seqs, logits, inputs, losses, unasked)


def _one_line(error: Exception) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"


def _own(
    model: torch.nn.Module,
    seq: torch.Tensor,
    objective: dict[str, Any],
    losses: list[tuple[float, float | None]],
) -> torch.Tensor:
    """The model's own logits ``[L, V]`` on ``seq`` alone; with ``objective``, its loss for labels (and its
    router loss) appended to ``losses``."""
    kwargs = {
        **({"labels": seq[None]} if "labels" in objective else {}),
        **{k: True for k in objective if k != "labels"},
    }
    out = model(input_ids=seq[None], use_cache=False, **kwargs)
    if getattr(out, "loss", None) is not None:
        aux = getattr(out, "aux_loss", None)
        losses.append((out.loss.item(), None if aux is None else float(aux)))
    return out.logits[0].float()


def _next_token_logps(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    return (logits[:-1] / temperature).log_softmax(-1).gather(-1, ids[1:, None])[:, 0]


def head_paths(total: int, device: torch.device) -> dict[str, dict[str, Any]]:
    """The ways training turns hidden states into log-probs, as keyword arguments of
    :func:`padless.forward.engine.logps_from_hidden`: logits whole, in chunks, with the loss's weights (fused
    for a plain linear head, through autograd for others, as training runs them), and at a temperature."""
    third = max(1, -(-total // 3))
    return {
        "whole": {"chunk_tokens": total},
        "chunked": {"chunk_tokens": third},
        "fused": {"logp_weights": torch.ones(total, device=device), "chunk_tokens": third},
        f"temperature {PROBE_TEMPERATURE}": {"temperature": PROBE_TEMPERATURE, "chunk_tokens": total},
    }


def probe_attention(
    model: torch.nn.Module,
    backend: str,
    tolerance: float | None = None,
    reference: ProbeReference | None = None,
    tree: bool = False,
) -> dict[str, Any]:
    """Prove that ``model`` on ``backend`` trains on the log-probs its own forward computes; raise if not.

    Runs the probe's sequences packed on ``backend`` (counting calls of the registered attention
    functions: the kernel asked for must be the one running), through padless's LM head on every path
    of :func:`head_paths`, and compares per-token log-probs with ``log_softmax`` of the model's own
    ``forward().logits`` on each sequence alone (:func:`probe_reference`, computed here unless given),
    after refusing an architecture whose layers cannot be kept apart per sequence at all
    (:func:`padless.forward.hybrid.require_packing`: the model's structure, checked here and not at each
    forward). The hidden states the model's own head received are compared too, to say whether attention or
    the head differs. Bounds scale with the size of what is compared (:func:`bound`);
    ``tolerance`` overrides them. With ``tree``, the tree layout too (:func:`probe_tree`).
    """
    require_packing(model)
    assert_attention(model, backend)
    if reference is None or (tree and reference.tree is None):
        reference = probe_reference(model, f"the load-time probe of the {backend!r} backend", tree)
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    layers = attention_layers(model)
    seqs = reference.seqs
    packed_kwargs = _packed_kwargs(seqs, device)
    if uses_mrope(model.config):  # packed M-RoPE ids: the text row on 3 rope rows (all equal for text)
        packed_kwargs["position_ids"] = packed_kwargs["position_ids"].expand(4, 1, -1)
    labels = torch.cat([torch.cat([s[1:], s.new_full((1,), IGNORE_INDEX)]) for s in seqs])
    predicted = labels != IGNORE_INDEX
    decoder = model.get_decoder()
    decoder = backbone(model) if decoder is model else decoder  # Llama4ForCausalLM's decoder is .model
    router = RouterLoss.of(model) if reference.losses else None
    if router is not None:
        packed_kwargs["output_router_logits"] = True
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), runtime_context(backend, device), spans_within_probe(model) as cut:
            kernels_before = Counter(KERNEL_CALLS)
            with count_attention_calls() as counts:
                hidden, router_logits = _packed_hidden(model, decoder, packed_kwargs, backend)
            kernels = sorted((KERNEL_CALLS - kernels_before).keys())
            scalar = output_head(model)
            paths = head_paths(len(labels), device) if scalar is None else {"score": {}}
            ours = _heads(model, scalar, hidden, labels, predicted, paths)
    finally:
        model.train(was_training)
    expected = (
        {VARLEN_NAME if backend == "varlen" else backend: layers} if backend != "eager" and layers else {}
    )
    if dict(counts) != expected:
        got = ", ".join(f"{k}: {v}" for k, v in counts.items()) or "no registered function"
        raise AttentionError(
            f"requested attention {backend!r} but a packed forward called {got} "
            f"(expected {expected or 'the eager default'} over {layers} attention layers). transformers "
            "chose another kernel; check attn_implementation and that the kernel's package is installed."
        )
    alone_hidden = torch.cat(reference.head_inputs)
    delta_hidden = (hidden.float() - alone_hidden).abs().max().item()
    limit_hidden = tolerance if tolerance is not None else bound(dtype, alone_hidden.abs().max().item())
    deltas, magnitude = {}, 0.0
    for name, kw in paths.items():
        t = kw.get("temperature", 1.0)
        if scalar is None:
            own = torch.cat([_next_token_logps(x, s, t) for x, s in zip(reference.logits, seqs, strict=True)])
        else:
            own = torch.cat(reference.logits)[:, 0]
        largest_logit = max(x[:-1].abs().max().item() for x in reference.logits) / t
        magnitude = max(magnitude, own.abs().max().item(), largest_logit)
        deltas[name] = (ours[name] - own).abs().max().item()
    limit = tolerance if tolerance is not None else bound(dtype, magnitude)
    worst = max(deltas, key=lambda name: deltas[name])
    if not deltas[worst] <= limit:
        raise AttentionError(
            _mismatch(model, backend, worst, deltas[worst], limit, delta_hidden, limit_hidden)
        )
    loss = _compare_losses(model, reference, ours.get("whole"), router, router_logits, limit)
    kernel = ",".join(k.removeprefix("varlen:") for k in kernels) if backend == "varlen" else backend
    return {
        "backend": backend,
        "kernel": kernel,
        "calls": sum(counts.values()),
        "lengths": [len(s) for s in seqs],
        "max_delta_logps": deltas[worst],
        "bound": limit,
        "max_delta_hidden": delta_hidden,
        **loss,
        **({"spans_cut": cut} if cut else {}),
        **({"tree": probe_tree(model, backend, reference, tolerance)} if tree else {}),
    }


def probe_tree(
    model: torch.nn.Module, backend: str, reference: ProbeReference, tolerance: float | None = None
) -> dict[str, Any]:
    """Prove the tree layout (:mod:`padless.forward.tree`) on ``backend``; raise if it differs.

    The tree sequences of ``reference`` (nested shared prefixes) and the probe's own sequences are packed in
    one row and laid out as a tree; the hidden states of every token, unfolded to each sequence, and the
    log-probs of every trained token are compared with each sequence run alone through the model's own
    forward (eager). A kernel that lets a branch see a sibling, or a prefix see a branch, moves both."""
    tree = reference.tree
    assert tree is not None and tree.prompts is not None, "probe_reference(..., tree=True) first"
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    examples = [
        Example(s.tolist(), [False] * p + [True] * (len(s) - p))
        for s, p in zip(tree.seqs, tree.prompts, strict=True)
    ]
    batch = pack([*examples, *(Example(s.tolist()) for s in reference.seqs)], device=device)
    row = share_prefixes(batch)
    if row is None:
        raise AttentionError("the probe's tree sequences share no prefix: padless.forward.tree found no tree")
    decoder = model.get_decoder()
    decoder = backbone(model) if decoder is model else decoder
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), runtime_context(backend, device), spans_within_probe(model):
            inputs = tree_inputs(row, backend, dtype)
            hidden = _packed_hidden(model, decoder, inputs, backend)[0].index_select(0, row.unfold)
            scalar = output_head(model)
            if scalar is None:
                labels = batch.labels[0]
                ours = logps_from_hidden(model, hidden, labels).logps[labels != IGNORE_INDEX]
            else:
                ours = scalar(hidden)[:, 0].float()
    finally:
        model.train(was_training)
    alone_hidden = torch.cat([*tree.head_inputs, *reference.head_inputs])
    delta_hidden = (hidden.float() - alone_hidden).abs().max().item()
    logits = [*tree.logits, *reference.logits]
    if scalar is None:
        firsts = [*tree.prompts, *[1] * len(reference.seqs)]  # the first trained token of each sequence
        own = torch.cat(
            [
                _next_token_logps(x, s, 1.0)[first - 1 :]
                for x, s, first in zip(logits, [*tree.seqs, *reference.seqs], firsts, strict=True)
            ]
        )
        magnitude = max(own.abs().max().item(), max(x[:-1].abs().max().item() for x in logits))
    else:
        own = torch.cat(logits)[:, 0]
        magnitude = own.abs().max().item()
    delta = (ours - own).abs().max().item()
    limit = tolerance if tolerance is not None else bound(dtype, magnitude)
    limit_hidden = tolerance if tolerance is not None else bound(dtype, alone_hidden.abs().max().item())
    if not (delta <= limit and delta_hidden <= limit_hidden):
        raise AttentionError(
            f"{model_name(model)}: tree packing on {backend!r} is not exact: per-token log-probs of branches "
            f"sharing a prefix differ from each sequence alone (eager) by {delta:.3g} (bound {limit:.3g}), "
            f"the hidden states by {delta_hidden:.3g} (bound {limit_hidden:.3g}): a branch sees a sibling or "
            "its prefix wrongly. Set train.tree_packing: off, and report it with `padless doctor` output."
        )
    return {
        "tokens": row.num_tokens,
        "flat_tokens": batch.num_tokens,
        "max_delta_logps": delta,
        "bound": limit,
        "max_delta_hidden": delta_hidden,
    }


def _compare_losses(
    model: torch.nn.Module,
    reference: ProbeReference,
    logps: torch.Tensor | None,
    router: RouterLoss | None,
    router_logits: tuple[torch.Tensor, ...] | None,
    limit: float,
) -> dict[str, Any]:
    """padless's loss on each probe sequence (the mean NLL of its log-probs ``logps``, plus the config's
    coefficient times the load-balancing loss of its routers' logits) against the model's own
    ``forward(labels=...).loss`` alone; refuses a difference over ``limit``, the log-probs' bound (a mean
    of per-token values within it). Nothing to compare where the model's forward returns no loss."""
    if not reference.losses:
        return {"own_loss": f"not compared: {reference.unasked}"} if reference.unasked else {}
    lengths = [len(s) for s in reference.seqs]
    ours, aux_ours = [], []
    for i, nll in enumerate(logps.split([n - 1 for n in lengths])):
        aux = None
        if router is not None and router_logits is not None:
            start = sum(lengths[:i])
            aux = router(tuple(layer[start : start + lengths[i]] for layer in router_logits)).item()
        aux_ours.append(aux)
        ours.append(-nll.mean().item() + (router.configured * aux if aux is not None else 0.0))
    delta = max(abs(a - own) for a, (own, _) in zip(ours, reference.losses, strict=True))
    delta_aux = max(
        (abs(a - own) for a, (_, own) in zip(aux_ours, reference.losses, strict=True) if own is not None),
        default=0.0,
    )
    if router is not None and (router_logits is None or any(own is None for _, own in reference.losses)):
        delta_aux = float("inf")  # no router logits, or no router loss, though its modeling code defines one
    if not (delta <= limit and delta_aux <= limit):
        term = f" + {router.configured:g} x the router load-balancing loss" if router is not None else ""
        raise AttentionError(
            f"{model_name(model)}: its own loss for labels is not padless's (a term padless does not "
            "reproduce, or labels read another way): "
            f"forward(labels=...).loss on each sequence alone differs from padless's (mean NLL{term}) by "
            f"{delta:.3g}{f' (the router loss alone by {delta_aux:.3g})' if router is not None else ''} > "
            f"bound {limit:.3g}, while its per-token log-probs agree; padless refuses to train an objective "
            "other than the model's. Report it with `padless doctor` output."
        )
    return {"max_delta_loss": delta, **({"router_aux_loss_coef": router.configured} if router else {})}


def _heads(
    model: torch.nn.Module,
    scalar: torch.nn.Module | None,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    predicted: torch.Tensor,
    paths: dict[str, dict[str, Any]],
) -> dict[str, torch.Tensor]:
    """padless's per-token outputs on every head path; a head that cannot take the decoder's hidden states
    at all (a transform between them that padless has no name for) is a refusal, said so."""
    try:
        return {
            name: logps_from_hidden(model, hidden, labels, **kw).logps[predicted]
            if scalar is None
            else scalar(hidden)[:, 0].float()
            for name, kw in paths.items()
        }
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as e:
        raise AttentionError(
            f"{model_name(model)}: padless's LM head cannot take the hidden states the model's decoder "
            f"returns ({type(e).__name__}: {' '.join(str(e).split())[:120]}): the model transforms them "
            "on the way to its head in a way padless has no name for, so padless does not train it"
        ) from e


def _packed_hidden(
    model: torch.nn.Module, decoder: torch.nn.Module, packed_kwargs: dict[str, Any], backend: str
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """The decoder's last hidden states ``[T, H]`` on the packed row, and its router logits where asked
    for; a failure is a refusal, said so."""
    try:
        out = decoder(**packed_kwargs, use_cache=False)
        return out.last_hidden_state[0], getattr(out, "router_logits", None)
    except AttentionError:
        raise
    except Exception as e:
        raise AttentionError(
            f"{model_name(model)}: padless's packed forward on {backend!r} failed ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:200]}); padless runs every forward packed through the model's "
            "decoder, so it does not support this architecture"
        ) from e


def _what_leaks(model: torch.nn.Module, backend: str) -> str:
    """What can mix packed sequences in ``model``: attention (leaking, or dropping an argument such as a
    window or a sink) where it has attention layers, and the layers that carry a state across tokens
    (:mod:`padless.forward.hybrid`) where it has them."""
    stateful = installed_layers(model)
    named = ", ".join(stateful[:2]) + (", ..." if len(stateful) > 2 else "")
    state = f"a layer that carries a state across tokens ({named})"
    attention = f"attention {backend!r} leaks between packed sequences or drops an attention argument"
    if stateful and not attention_layers(model):
        return f"{state} leaks between packed sequences (the model has no attention layer)"
    return f"{attention}, or {state} leaks" if stateful else attention


def _mismatch(
    model: torch.nn.Module,
    backend: str,
    path: str,
    delta: float,
    limit: float,
    hidden: float,
    hidden_limit: float,
) -> str:
    """Why the probe failed: attention (the hidden states the head reads differ too) or the head."""
    measured = (
        f"per-token log-probs ({path} head path) differ from the model's own forward on each sequence "
        f"alone (eager) by {delta:.3g} > bound {limit:.3g}"
    )
    if not hidden <= hidden_limit:
        return (
            f"{model_name(model)}: {_what_leaks(model, backend)}: packed, "
            f"{measured}, and the hidden states its LM head reads by {hidden:.3g} > {hidden_limit:.3g}; "
            "report this with `padless doctor` output."
        )
    return (
        f"{model_name(model)} computes logits that padless's LM head does not reproduce: {measured}, while "
        f"the hidden states its LM head reads agree ({hidden:.2g}): its forward transforms the logits in a "
        "way padless has no name for, and padless refuses to train on numbers other than the model's. "
        "Report it with `padless doctor` output."
    )


@contextlib.contextmanager
def _float32(model: torch.nn.Module) -> Iterator[None]:
    """The model's 16-bit parameters and buffers in float32 for a while, then exactly back: a 16-bit
    value round-trips through float32 bit for bit, so the weights trained are the weights proven."""
    cast = [t for t in (*model.parameters(), *model.buffers()) if t.dtype in SIXTEEN_BIT]
    dtypes = [t.dtype for t in cast]
    done = 0
    try:
        for t in cast:  # out of memory half-way: what was cast goes back all the same
            t.data = t.data.float()
            done += 1
        yield
    finally:
        for t, dtype in zip(cast[:done], dtypes, strict=False):
            t.data = t.data.to(dtype)


def prove_packing(
    model: torch.nn.Module, backend: str, reference: ProbeReference | None = None, tree: bool = False
) -> dict[str, Any]:
    """:func:`probe_attention`; for a 16-bit model, also the same probe on the same weights in float32.

    A 16-bit probe's bound is the round-off of logits of that size (about a nat at |logit| 30), so it is
    blind both ways: a leak under the bound passes (a gated delta-net whose kernel was told no boundaries
    leaked 0.03 nats and passed in bf16), and round-off over it fails although nothing leaks (a mixture
    of experts whose routing flips). The layout the probe proves is the same in both dtypes, and float32
    tells it from round-off, with the kernel float32 takes (``auto``: a pinned 16-bit-only kernel is
    proven by the 16-bit probe). Float32 decides: it passing lets the run go on, the log carrying both
    measurements; it failing refuses the model, whatever 16 bits said. Where float32 cannot run (memory),
    a 16-bit pass stands and the log says the proof had 16-bit sensitivity. ``reference`` (16-bit)
    serves the 16-bit probe. ``tree``: the tree layout is proven too (:func:`probe_tree`).
    """
    if next(model.parameters()).dtype not in SIXTEEN_BIT:
        return probe_attention(model, backend, reference=reference, tree=tree)
    low: dict[str, Any] | None = None
    low_error: AttentionError | None = None
    try:
        low = probe_attention(model, backend, reference=reference, tree=tree)
    except ReferenceForwardError:
        raise
    except AttentionError as e:
        low_error = e
    try:
        with _float32(model), pinned(model, "auto"):
            fine = probe_attention(model, backend, tree=tree)
    except AttentionError as e:
        if low_error is not None:
            raise AttentionError(f"{low_error} (the same probe in float32 fails too: {e})") from low_error
        raise AttentionError(
            f"{e} (in float32 on the same weights; the 16-bit probe passed only because its bound, "
            f"{low['bound']:.3g}, is above the leak)"
        ) from e
    except RuntimeError as e:  # torch.OutOfMemoryError is a RuntimeError
        if low_error is not None:
            raise AttentionError(f"{low_error} (the same probe in float32 could not run: {e})") from low_error
        log.warning(f"the float32 probe could not run ({e}); packing is proven at 16-bit sensitivity only")
        return {**low, "float32_probe": f"not run: {e}"}
    if low_error is not None:
        return {**fine, "float32_reprobe": str(low_error)}
    return {**low, "float32_probe": f"{fine['max_delta_logps']:.1e} <= {fine['bound']:.1e}"}


# The proof reused within a process (see the module): the proofs passed, each with its fingerprint.
KEPT = 8  # proofs kept (least recently used dropped): a process holds a few distinct models at most
_PROVEN: OrderedDict[int, tuple[tuple[Any, ...], dict[str, Any]]] = OrderedDict()
_IMMUTABLE = (str, bytes, int, float, complex, bool, type(None), range, torch.dtype, torch.device)

# Loaded modules whose functions a probe runs besides the model's own modeling code and padless: masks,
# attention integrations, output capturing and the base classes.
CODE_PREFIXES = (
    "padless",
    "transformers.modeling_",
    "transformers.masking_utils",
    "transformers.integrations.",
    "transformers.utils.generic",
    "transformers.utils.output_capturing",
    "transformers.pytorch_utils",
    "torch.nn.functional",
)


def prove(model: torch.nn.Module, backend: str, tree: bool = False) -> dict[str, Any]:
    """:func:`prove_packing` (with the tree layout when ``tree``), or its result for an identical model,
    backend, layouts and code proven earlier in this process (then with ``reused: True``)."""
    key = fingerprint(model, backend, tree)
    if key is not None:
        for slot, (known, result) in _PROVEN.items():
            if _same(known, key):
                _PROVEN.move_to_end(slot)
                return {**result, "reused": True}
    result = prove_packing(model, backend, tree=tree)
    if key is not None:
        _PROVEN[id(key)] = (key, dict(result))
        while len(_PROVEN) > KEPT:
            _PROVEN.popitem(last=False)
    return result


def fingerprint(model: torch.nn.Module, backend: str, tree: bool = False) -> tuple[Any, ...] | None:
    """Everything the probe's verdict depends on (``None``: not fingerprinted, see the module)."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    if any(t.device.type != "cpu" for _, t in tensors):
        return None
    return (
        backend,
        tree,
        kernel_of(model),
        torch.get_num_threads(),
        _weights(tensors),
        _model_code(model),
        _code(model),
    )


def _weights(tensors: list[tuple[str, torch.Tensor]]) -> str:
    """A hash of every parameter and buffer: name, dtype, shape and bytes."""
    digest = hashlib.blake2b(digest_size=32)
    for name, t in tensors:
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _model_code(model: torch.nn.Module) -> tuple[Any, ...]:
    """The model's modules (name, class), the forwards and hooks set on instances, and every config each
    module reads (its full JSON and the attention kernel it dispatches to)."""
    configs = {
        id(c): (c.to_json_string(use_diff=False), c._attn_implementation_internal) for c in _configs(model)
    }
    entries: list[Any] = []
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        entries += [name, type(module), configs.get(id(config), config)]
        entries.append(_callable(module.__dict__.get("forward")))
        for hooks in (
            module._forward_pre_hooks,
            module._forward_hooks,
            module._backward_hooks,
            module._backward_pre_hooks,
        ):
            entries += [_callable(h) for h in hooks.values()]
    return tuple(entries)


def _callable(fn: Any) -> Any:
    """What decides how ``fn`` runs: a bound method's function and class, a per-sequence wrapper's
    :meth:`padless.forward.hybrid._PerSequence.identity`, anything else itself."""
    if isinstance(fn, types.MethodType):
        return fn.__func__, type(fn.__self__)
    if isinstance(fn, _PerSequence):
        return fn.identity()
    return fn


def _code(model: torch.nn.Module) -> tuple[Any, ...]:
    """Every function, class and setting in the namespaces of the code a probe runs (see
    :data:`CODE_PREFIXES`, and the modules of the model's classes), with the entries of registries of
    functions and the members of classes; transformers' attention and mask registries; torch's functions
    and ``Tensor``'s methods; torch's global module hooks."""
    classes = {c for m in model.modules() for c in type(m).__mro__ if c is not object}
    names = {c.__module__ for c in classes}
    modules = [
        m
        for n, m in list(sys.modules.items())
        if m is not None and (n in names or n.startswith(CODE_PREFIXES))
    ]
    from torch.nn.modules import module as torch_module
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    entries: list[Any] = []
    for module in sorted(modules, key=lambda m: m.__name__):
        entries.append(module.__name__)
        entries += _namespace(vars(module), module.__name__)
    for cls in sorted(classes, key=lambda c: (c.__module__, c.__qualname__)):
        entries += [cls, *_namespace(dict(vars(cls)), None)]
    for mapping in (ALL_ATTENTION_FUNCTIONS._global_mapping, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping):
        entries += [item for kv in sorted(mapping.items()) for item in kv]
    entries += _namespace(vars(torch), None) + _namespace(dict(vars(torch.Tensor)), None)
    for hooks in (torch_module._global_forward_pre_hooks, torch_module._global_forward_hooks):
        entries += [_callable(h) for h in hooks.values()]
    return tuple(entries)


def _namespace(space: dict[str, Any], owner: str | None) -> list[Any]:
    """``space``'s callables and settings in order, with the callables of its registries (dicts) and, for
    a module ``owner``, the members of the classes it defines."""
    entries: list[Any] = []
    for name, value in space.items():
        if isinstance(value, types.ModuleType):
            continue
        entries += [name, value]
        if isinstance(value, dict):
            entries += [item for k, v in value.items() if callable(v) for item in (k, v)]
        elif owner is not None and isinstance(value, type) and value.__module__ == owner:
            entries += _namespace(dict(vars(value)), None)
    return entries


def _same(known: tuple[Any, ...], key: tuple[Any, ...]) -> bool:
    """Whether two fingerprints are the same: immutable values equal, everything else the same object."""
    if len(known) != len(key):
        return False
    for a, b in zip(known, key, strict=True):
        if a is b:
            continue
        if isinstance(a, tuple) and isinstance(b, tuple):
            if not _same(a, b):
                return False
        elif not (isinstance(a, _IMMUTABLE) and type(a) is type(b) and a == b):
            return False
    return True
