"""The one model engine: every forward of every trainer — training loss, evaluation, old / reference
log-probs, values, reward scores, reference precompute and generation — is a call of
:class:`ModelEngine`, with every head applied inside its ``forward``.

That is what makes sharded training work and keeps compared passes comparable: the engine is the module
accelerate prepares, so DDP / FSDP2 / DeepSpeed hooks fire on every pass (FSDP2's backward hooks are
registered on the outputs of the root module's forward: a head applied outside it never gets its
gradients), and the precision policy that wraps the prepared forward covers every pass alike.

The forward math is here too: the inputs of a packed row (explicit bounds, no mask) or of a padded batch,
the backbone's hidden states, the LM head's chunked / fused log-probs (:class:`LogitsHead`,
:func:`logps_from_hidden`) and the scalar head. :mod:`padless.proof.load` only loads models.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from padless.config.choices import TREE_PACKING
from padless.config.schema import TrainSettings
from padless.forward import hybrid, ranks, routing, sequence_parallel
from padless.forward.attention import (
    assert_attention,
    attention_in_use,
    hf_name,
    pin_kernel,
    runtime_context,
    validate_kernel_name,
)
from padless.forward.distill import Distillation, distill_from_hidden
from padless.forward.packing import IGNORE_INDEX, PackedBatch, PaddedBatch, Side, to_padded, unpad
from padless.forward.ranks import Topology
from padless.forward.routers import SPLIT_ROWS, RouterLoss, RouterRecord, defines_router_loss
from padless.forward.tree import TreeRow, resolve_tree, tree_inputs, tree_row
from padless.forward.varlen import sequence_bounds

# The fp32 logits of one micro-batch may take this much memory before the head runs in chunks
# (train.logits_memory_mb): 1 GiB holds 4,096 positions of a 65k vocabulary, 1,766 of a 152k one.
DEFAULT_LOGITS_MEMORY_MB = 1024


@dataclass(frozen=True)
class EngineSettings:
    """What every pass of one engine runs with; it travels with the engine, never in process state.

    ``varlen_kernel`` (``model.varlen_kernel``) is pinned on the engine's models, whose layers run it in
    every pass and the backward of its loss (:func:`padless.forward.attention.pin_kernel`); ``None`` leaves
    the models' own pin (the one they were loaded and proven with). ``logits_memory_mb``
    (``train.logits_memory_mb``) is what the fp32 logits of one micro-batch may take before the LM head
    runs in chunks. ``topology`` is where this process stands among the run's (made at run start: its
    data-parallel rank and the sequence-parallel group every packed row is split over,
    :mod:`padless.forward.sequence_parallel`); the loop and the recipes read it here.
    ``router_aux_loss_coef`` weights the load-balancing loss of a mixture of experts in training forwards
    (:mod:`padless.forward.routers`)."""

    varlen_kernel: str | None = None
    logits_memory_mb: int = DEFAULT_LOGITS_MEMORY_MB
    topology: Topology = field(default_factory=ranks.start)
    tree_packing: str = "off"  # train.tree_packing: auto / on / off (see resolve_tree)
    router_aux_loss_coef: float | None = None  # model.router_aux_loss_coef; None: each model's config's

    def __post_init__(self) -> None:
        if self.logits_memory_mb <= 0:
            raise ValueError(f"logits memory budget must be positive, got {self.logits_memory_mb} MB")
        if self.varlen_kernel is not None:
            validate_kernel_name(self.varlen_kernel)
        if self.tree_packing not in TREE_PACKING:
            raise ValueError(
                f"unknown tree_packing {self.tree_packing!r}; choose one of {', '.join(TREE_PACKING)}"
            )

    def runs_tree(self, model: torch.nn.Module, backend: str) -> bool:
        """Whether ``model`` on ``backend`` runs tree rows in these engines (:func:`resolve_tree`: ``on``
        where a tree cannot run is refused, with the reason). ``off`` is decided here, so that a flat run
        calls no code of :mod:`padless.forward.tree`."""
        if self.tree_packing == "off":
            return False
        return resolve_tree(model, backend, self.tree_packing == "on", self.topology.degree)


@dataclass(frozen=True)
class BatchLayout:
    """How the engine lays a packed batch out for the model: packed (one row, explicit bounds), or padded
    on ``side`` with ``pad_id`` (the comparison mode: pad compute and a mask). Results come back per token
    in packed order ``[T]`` either way, so recipes never branch on the layout."""

    side: Side | None = None  # None: packed
    pad_id: int = 0

    @classmethod
    def of(cls, train: TrainSettings, pad_id: int) -> BatchLayout:
        """The layout ``train.batching`` / ``train.padding_side`` ask for."""
        return cls(train.padding_side if train.batching == "padded" else None, pad_id)


PACKED = BatchLayout()


@dataclass
class TokenOutputs:
    """Per-token results of a packed forward, each ``[T]`` in fp32; zero where the label is ignored."""

    logps: torch.Tensor
    entropy: torch.Tensor | None = None
    weighted: torch.Tensor | None = None  # sum_t w_t logps_t for logp_weights w (see logps_from_hidden)
    aux: torch.Tensor | None = None  # the router load-balancing loss of the forward (without coefficient)


def loaded_backend(model: torch.nn.Module) -> str:
    """The backend the model was loaded with (or switched to by :func:`use_backend`), else the one its
    config dispatches to."""
    inner = unwrap(model)
    return getattr(inner, "padless_attention", None) or attention_in_use(inner)


def use_backend(model: PreTrainedModel, backend: str) -> None:
    """Switch a loaded model to ``backend`` and record it: every forward checks the model against it."""
    model.set_attn_implementation(hf_name(backend))
    model.padless_attention = backend


def checked_backend(model: torch.nn.Module) -> str:
    """The backend the model was loaded with, after checking its config still dispatches to it."""
    backend = loaded_backend(model)
    assert_attention(unwrap(model), backend)
    return backend


def model_inputs(batch: PackedBatch | PaddedBatch) -> dict[str, Any]:
    """Forward kwargs: a packed row with explicit bounds and no mask, or a padded batch with its mask.

    Image inputs of a vision-language batch (``pixel_values``, ``image_grid_thw``, ...) go along as they are.
    """
    vision = batch.vision or {}
    if isinstance(batch, PackedBatch):
        sequence_bounds(batch.cu_seqlens)  # read to the host here, once: no attention layer waits for it
        return {
            "input_ids": batch.input_ids,
            "position_ids": batch.position_ids,
            **batch.attention_kwargs(),
            **vision,
        }
    return {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "position_ids": batch.position_ids,
        **vision,
    }


def backbone(model: torch.nn.Module) -> torch.nn.Module:
    """The part of an HF model (or a PEFT wrapper's) that returns hidden states: embeddings, layers, norm."""
    inner = unwrap(model)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    base = inner.base_model
    if base is inner and isinstance(getattr(inner, "model", None), torch.nn.Module):
        # Llama4ForCausalLM names its prefix "language_model" (its place inside the vision-language
        # model) but keeps its layers in .model, so base_model is the causal LM itself
        return inner.model
    return base


def _mrope_rows(batch: PackedBatch | TreeRow) -> torch.Tensor:
    """A packed row's ``[4, 1, T]`` ids for an M-RoPE model: the restarting text row the mask is built from,
    then the three rope rows. Given one row, such a model computes its own rope rows and masks the whole
    row causally on sdpa / eager (a leak: 23.8 nats on Qwen2.5-VL); text takes its restarting positions on
    all three, images need theirs from the model's rope index."""
    ids, vision = batch.position_ids, getattr(batch, "vision", None)
    if ids.dim() == 3 and len(ids) == 4:
        return ids
    if ids.dim() == 2 and not vision:
        return ids.expand(4, 1, -1)
    raise ValueError(
        f"a packed row of an M-RoPE model needs position ids [4, 1, T] (text row, then 3 rope rows), got "
        f"{list(ids.shape)}{' with images' if vision else ''}: tokenize the examples with the model's "
        "rope index (padless.forward.vision.RopeIndex)"
    )


def hidden_states(model: torch.nn.Module, batch: PackedBatch | PaddedBatch | TreeRow) -> torch.Tensor:
    """Last hidden states (``[1, T, H]`` packed, ``[1, R, H]`` a tree row, ``[N, L, H]`` padded) with no
    head applied.

    Never a KV cache: with one, transformers drops its per-sequence mask.
    """
    return routed_hidden_states(model, batch)[0]


def routed_hidden_states(
    model: torch.nn.Module, batch: PackedBatch | PaddedBatch, router: RouterLoss | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`hidden_states`, and with ``router`` the load-balancing loss of the routers' logits on the
    real tokens (else ``None``)."""
    backend = checked_backend(model)
    base = backbone(model)
    if isinstance(batch, TreeRow):
        inputs = tree_inputs(batch, backend, base.get_input_embeddings().weight.dtype)
    else:
        inputs = model_inputs(batch)
    if isinstance(batch, (PackedBatch, TreeRow)) and hasattr(base, "get_rope_index"):
        inputs["position_ids"] = _mrope_rows(batch)
    if router is not None:
        inputs["output_router_logits"] = True
    with runtime_context(backend, batch.input_ids.device):
        out = base(**inputs, use_cache=False)
    return out.last_hidden_state, None if router is None else router_aux(router, out, batch)


def router_aux(router: RouterLoss, out: Any, batch: PackedBatch | PaddedBatch) -> torch.Tensor:
    """``router``'s loss over the router logits of a forward's output, real tokens only: all of a packed
    row's, the unmasked rows of a padded batch."""
    logits = tuple(getattr(out, "router_logits", None) or ())
    if not logits:
        raise ValueError(
            "the model's modeling code defines a router load-balancing loss, but its forward returns no "
            "router logits to compute it from; set model.router_aux_loss_coef: 0 to train without it"
        )
    if isinstance(batch, PaddedBatch):
        real = batch.attention_mask.reshape(-1).bool()
        logits = tuple(layer[real] for layer in logits)
    return router(logits)


def lm_head(model: PreTrainedModel) -> torch.nn.Module:
    """The module that turns ``model``'s last hidden states into logits: its output embeddings, unless a
    child of the model holds them inside a transform (BERT's ``cls.predictions``: dense, activation, norm,
    then the output embeddings as ``decoder``); then that child. The load-time probe proves the choice
    against the model's own logits."""
    out = model.get_output_embeddings()
    body = backbone(model)
    for child in model.children():
        inside = {id(m) for m in child.modules()}
        if child is not out and id(out) in inside and id(body) not in inside:
            return child
    return out


# Text-config keys of factors a model multiplies its head's output by (Cohere's logit_scale, MuseGlimmer's
# output_multiplier); the load-time probe refuses a model whose own logits differ from the head's.
MULTIPLIER_KEYS = ("logit_scale", "output_multiplier")


def own_multipliers(model: PreTrainedModel) -> list[str]:
    """The :data:`MULTIPLIER_KEYS` the model's own forward reads: a composite model whose text config
    carries a factor its forward does not apply (Aya Vision's Cohere 2 ``logit_scale``) applies none. Code
    that cannot be read applies none, and the probe compares the result with the model's own logits."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        code = inspect.getsource(type(inner).forward)
    except (OSError, TypeError):
        return []
    return [key for key in MULTIPLIER_KEYS if key in code]


@dataclass(frozen=True)
class LogitsHead:
    """How a causal LM turns hidden states into the logits its log-probs are taken from:
    ``cap(head(h) * multiplier / scaling) / temperature``, as transformers' models compute them (Cohere
    multiplies by ``logit_scale``, MuseGlimmer by ``output_multiplier``, Granite divides by
    ``logits_scaling``, Gemma 2 soft-caps with ``final_logit_softcapping``), in fp32."""

    module: torch.nn.Module
    scaling: float = 1.0
    softcap: float | None = None
    temperature: float = 1.0
    multiplier: float = 1.0
    output: torch.nn.Module | None = (
        None  # the output embeddings, where ``module`` is a transform around them
    )

    @classmethod
    def of(cls, model: PreTrainedModel, temperature: float = 1.0) -> LogitsHead:
        """The head of ``model``: its output embeddings, or the part of the model that holds them and
        turns hidden states into logits around them (BERT's and RoBERTa's prediction transform)."""
        text = model.config.get_text_config()
        multiplier = 1.0
        for key in own_multipliers(model):
            multiplier *= getattr(text, key, None) or 1.0
        head, out = lm_head(model), model.get_output_embeddings()
        return cls(
            head,
            getattr(text, "logits_scaling", None) or 1.0,
            getattr(text, "final_logit_softcapping", None) or None,
            temperature,
            multiplier,
            None if head is out else out,
        )

    @property
    def vocab(self) -> int:
        return (self.output or self.module).weight.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the output embeddings' weight: what hidden states are cast to before the head."""
        return (self.output or self.module).weight.dtype

    def fusable(self) -> bool:
        """Whether the fused weighted path can read the head's weight directly: a plain bias-free
        ``nn.Linear`` (not a LoRA-wrapped head) whose weight is whole here (not ZeRO-3-partitioned, which
        DeepSpeed gathers only inside the module's own forward)."""
        plain = type(self.module) is torch.nn.Linear and self.module.bias is None
        return plain and not hasattr(self.module.weight, "ds_id")

    def finish(self, raw: torch.Tensor) -> torch.Tensor:
        """fp32 logits from the head's raw output."""
        logits = raw.float()
        if self.multiplier != 1.0:
            logits = logits * self.multiplier
        if self.scaling != 1.0:
            logits = logits / self.scaling
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.temperature != 1.0:
            logits = logits / self.temperature
        return logits

    def logits_grad(self, grad: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The gradient wrt the raw head output from the one wrt :meth:`finish`'s logits (in place)."""
        if self.temperature != 1.0:
            grad /= self.temperature
        if self.softcap:
            capped = logits * (self.temperature / self.softcap)  # tanh(raw / scaling / softcap)
            grad *= 1 - capped.square()
        if self.scaling != 1.0:
            grad /= self.scaling
        if self.multiplier != 1.0:
            grad *= self.multiplier
        return grad


def _chunk_starts(total: int, step: int) -> range:
    """Where the chunks of ``total`` rows start; one empty chunk when there are none, so that every path
    still returns (empty) tensors connected to the graph."""
    return range(0, max(total, 1), step)


def _chunk_logps(
    head: LogitsHead, hidden: torch.Tensor, labels: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    logp = head.finish(head.module(hidden)).log_softmax(-1)
    picked = logp.gather(-1, labels[:, None])[:, 0]
    return picked, (-(logp.exp() * logp).sum(-1) if with_entropy else None)


class _WeightedLogps(torch.autograd.Function):
    """``sum_t w_t log p(y_t | h_t)`` for weights known before the forward pass (SFT's NLL: the target mask
    over the step's normaliser), with its gradients wrt the hidden states and the head's weight computed in
    the forward chunk loop, as fused linear-cross-entropy kernels do: each chunk's logits are computed
    once, used and freed, and the backward only scales the saved gradients by the upstream scalar.

    The per-token log-probs (and entropy) it also returns are values only. The saved gradients are fp32:
    ``[n, hidden]`` and ``[vocab, hidden]``, the size of the head's weight in fp32.
    """

    @staticmethod
    def forward(
        ctx, hidden, weight, labels, weights, head: LogitsHead, rows: int, with_entropy: bool, grads: bool
    ):
        # ``grads``: whether autograd is on outside (needs_input_grad ignores torch.no_grad)
        need_hidden, need_weight = (grads and need for need in ctx.needs_input_grad[:2])
        grad_hidden = hidden.new_zeros(hidden.shape, dtype=torch.float32) if need_hidden else None
        grad_weight = weight.new_zeros(weight.shape, dtype=torch.float32) if need_weight else None
        logps, entropies = [], []
        for start in _chunk_starts(hidden.shape[0], rows):
            h, y, w = (t[start : start + rows] for t in (hidden, labels, weights))
            raw = F.linear(h, weight)
            logits = head.finish(raw)
            # As log_softmax does: shifted by the row's max, so log-probs and probabilities are
            # differences of small numbers, not of the |logit|-sized log-sum-exp.
            shifted = logits - logits.amax(-1, keepdim=True)
            probs = shifted.exp()
            total = probs.sum(-1, keepdim=True)
            log_total = total.log()[:, 0]
            logps.append(shifted.gather(-1, y[:, None])[:, 0] - log_total)
            probs /= total
            if with_entropy:
                entropies.append(log_total - (probs * shifted).sum(-1))
            del shifted
            if not (need_hidden or need_weight):
                continue
            # d/dlogits of sum_t w_t log softmax(logits_t)[y_t] = w_t (onehot(y_t) - softmax_t)
            grad = probs.mul_(-w[:, None]).scatter_add_(1, y[:, None], w[:, None])
            grad = head.logits_grad(grad, logits).to(raw.dtype)
            if need_hidden:
                grad_hidden[start : start + rows] = grad @ weight
            if need_weight:
                grad_weight += grad.T @ h
        logps = torch.cat(logps)
        entropy = torch.cat(entropies) if with_entropy else None
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = hidden.dtype, weight.dtype
        ctx.mark_non_differentiable(logps, *([entropy] if with_entropy else []))
        return (logps * weights).sum(), logps, entropy

    @staticmethod
    def backward(ctx, grad_total, *_):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        return (
            None if grad_hidden is None else (grad_hidden * grad_total).to(hidden_dtype),
            None if grad_weight is None else (grad_weight * grad_total).to(weight_dtype),
            None,
            None,
            None,
            None,
            None,
            None,
        )


def forward_packed(
    model: torch.nn.Module,
    batch: PackedBatch | TreeRow,
    *,
    entropy: bool = False,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    logp_weights: torch.Tensor | None = None,
    logits_memory_mb: int = DEFAULT_LOGITS_MEMORY_MB,
    router: RouterLoss | None = None,
) -> TokenOutputs:
    """Per-token log-probs of ``batch.labels`` (and optionally entropy), per position of its row (a tree
    row's positions: :class:`ModelEngine` unfolds them); see :func:`logps_from_hidden`. With ``router``,
    also the router load-balancing loss of the forward (``aux``)."""
    hidden, aux = routed_hidden_states(model, batch, router)
    out = logps_from_hidden(
        unwrap(model),
        hidden[0],
        batch.labels[0],
        entropy=entropy,
        temperature=temperature,
        chunk_tokens=chunk_tokens,
        logp_weights=logp_weights,
        logits_memory_mb=logits_memory_mb,
    )
    out.aux = aux
    return out


def logps_from_hidden(
    model: PreTrainedModel,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    *,
    entropy: bool = False,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    logp_weights: torch.Tensor | None = None,
    logits_memory_mb: int = DEFAULT_LOGITS_MEMORY_MB,
) -> TokenOutputs:
    """The LM head and log-softmax over hidden states ``[T, H]``, on the positions that have a label only.

    The fp32 logits of those positions are computed whole when they fit ``logits_memory_mb`` (see
    :class:`EngineSettings`), else in chunks of rows that do (``chunk_tokens`` forces a chunk size).
    With ``logp_weights`` ``[T]`` (known before the forward: SFT's NLL), the result's ``weighted`` is
    ``sum_t w_t logp_t`` and carries the gradient, computed in the forward chunk loop at no extra head
    pass (:class:`_WeightedLogps`); ``logps`` and ``entropy`` are then values only. Without weights,
    ``logps`` and ``entropy`` carry the gradient; chunks are then recomputed in backward (the price of
    never holding all logits at once when the loss is not known in advance).
    """
    head = LogitsHead.of(model, temperature)
    keep = labels != IGNORE_INDEX
    rows = torch.nonzero(keep)[:, 0]  # one host sync per batch: how many positions carry a label
    if rows.numel() == labels.numel():
        rows = None  # every position has a label: no gather
    h = hidden if rows is None else hidden[rows]
    h = h.to(head.dtype)  # as models whose last norm returns fp32 (Mamba) cast before the head
    y = labels if rows is None else labels[rows]
    step = chunk_tokens or max(1, logits_memory_mb * 2**20 // (4 * head.vocab))
    weighted = None
    if logp_weights is not None and head.fusable():
        w = logp_weights if rows is None else logp_weights[rows]
        grads = torch.is_grad_enabled()
        weighted, logps, ents = _WeightedLogps.apply(
            h, head.module.weight, y, w.float(), head, step, entropy, grads
        )
    else:
        grad = torch.is_grad_enabled() and h.requires_grad
        pieces = [
            checkpoint(_chunk_logps, head, h[s : s + step], y[s : s + step], entropy, use_reentrant=False)
            if grad and step < h.shape[0]
            else _chunk_logps(head, h[s : s + step], y[s : s + step], entropy)
            for s in _chunk_starts(h.shape[0], step)
        ]
        logps = torch.cat([p for p, _ in pieces])
        ents = torch.cat([e for _, e in pieces]) if entropy else None
        if logp_weights is not None:  # a head the fused path cannot read: the same sum through autograd
            weighted = (logps * (logp_weights if rows is None else logp_weights[rows])).sum()

    def scatter(values: torch.Tensor | None) -> torch.Tensor | None:
        if values is None or rows is None:
            return values
        return values.new_zeros(labels.shape).index_copy(0, rows, values)

    return TokenOutputs(logps=scatter(logps), entropy=scatter(ents), weighted=weighted)


def forward_padded(model: torch.nn.Module, batch: PaddedBatch, temperature: float = 1.0) -> torch.Tensor:
    """Per-token log-probs ``[N, L]`` of a padded batch (comparison mode only: full logits, pad compute)."""
    return routed_padded(model, batch, temperature)[0]


def routed_padded(
    model: torch.nn.Module, batch: PaddedBatch, temperature: float = 1.0, router: RouterLoss | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`forward_padded`, and with ``router`` the router load-balancing loss over the batch's real
    tokens (else ``None``)."""
    backend = checked_backend(model)
    extra = {"output_router_logits": True} if router is not None else {}
    with runtime_context(backend, batch.input_ids.device):
        out = model(**model_inputs(batch), use_cache=False, **extra)
    logps = (
        (out.logits.float() / temperature)
        .log_softmax(-1)
        .gather(-1, batch.labels.clamp(min=0)[..., None])[..., 0]
    )
    aux = None if router is None else router_aux(router, out, batch)
    return logps * (batch.labels != IGNORE_INDEX), aux


def score_head(model: PreTrainedModel) -> torch.nn.Module:
    """The scalar head of a reward / value model (``AutoModelForSequenceClassification`` with 1 label)."""
    for name in ("score", "classifier", "v_head"):
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Module):
            return head
    raise ValueError(
        f"{type(model).__name__} has no scalar head (score / classifier / v_head); load it with task='score'"
    )


def forward_scores(model: torch.nn.Module, batch: PackedBatch | PaddedBatch | TreeRow) -> torch.Tensor:
    """Per-token scalars from a scalar head (fp32): ``[T]`` packed (``[R]`` a tree row), ``[N, L]`` padded."""
    return routed_scores(model, batch)[0]


def routed_scores(
    model: torch.nn.Module, batch: PackedBatch | PaddedBatch | TreeRow, router: RouterLoss | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`forward_scores`, and with ``router`` the router load-balancing loss of the forward (else
    ``None``)."""
    hidden, aux = routed_hidden_states(model, batch, router)
    scores = score_head(unwrap(model))(hidden)[..., 0].float()
    return (scores if isinstance(batch, PaddedBatch) else scores[0]), aux


class EngineOutput(NamedTuple):
    """Per-token results (a NamedTuple so FSDP2 sees its tensors): ``[T]`` on a packed batch, ``[N, L]``
    on a padded one, fp32; ``None`` where not asked for."""

    logps: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None
    weighted: torch.Tensor | None = None  # sum_t w_t logps_t for ``logp_weights`` w (packed batches)
    hidden: torch.Tensor | None = None  # [T, H] last hidden states (a teacher's, for the distillation head)
    divergence: torch.Tensor | None = None  # [T] the distillation head's per-token divergence (values)
    aux: torch.Tensor | None = None  # coef * router load-balancing loss, training forwards of a MoE only


class ModelEngine(torch.nn.Module):
    """A causal LM (policy / reference) or a scalar-head model (reward / value), optionally with a value
    model beside a policy (PPO's actor-critic: one optimizer, one wrapper, one checkpoint for both), and
    the :class:`EngineSettings` its passes run with."""

    def __init__(
        self,
        model: torch.nn.Module,
        value: torch.nn.Module | None = None,
        settings: EngineSettings | None = None,
    ):
        super().__init__()
        self.model = model
        self.value = value
        self.settings = settings or EngineSettings()
        # FSDP2's transformer auto-wrap reads the layer classes here (the models' own lists, merged)
        self._no_split_modules = sorted(
            {name for m in (model, value) if m is not None for name in _no_split(m)}
        )
        self.config = unwrap(model).config  # DeepSpeed sizes its buckets from config.hidden_size
        for m in (model, value):  # the models' structure, checked once here, not before each forward
            if m is not None:
                hybrid.require_packing(unwrap(m))
        if self.settings.varlen_kernel is not None:  # its layers run it in any pass, in any thread
            pin_kernel(self, self.settings.varlen_kernel)
        # each model's router load-balancing term (None: its objective has none, or its coefficient is 0)
        self.routers = [_active_router(m, self.settings.router_aux_loss_coef) for m in (model, value)]
        self._record: RouterRecord | None = None  # the training micro-batch being recorded (recording())
        # whether packed batches run as tree rows (train.tree_packing), decided once per engine
        self.tree = all(
            self.settings.runs_tree(m, loaded_backend(m)) for m in (model, value) if m is not None
        )
        split = self.topology.sequence_parallel  # the group every packed forward is split over
        if split is not None:
            for m in (model, value):
                if m is not None:
                    sequence_parallel.check_model(m, split.degree)
                    sequence_parallel.attach(m, split)  # its layers split over this group

    def forward(
        self,
        batch: PackedBatch | None = None,
        *,
        layout: BatchLayout = PACKED,
        logps: bool = False,
        entropy: bool = False,
        temperature: float = 1.0,
        logp_weights: torch.Tensor | None = None,
        values: bool = False,
        generate: dict[str, Any] | None = None,
        hidden: bool = False,
        head_of: torch.Tensor | None = None,
        distill: Distillation | None = None,
    ) -> EngineOutput | torch.Tensor:
        """Log-probs of ``batch.labels`` (and entropy) from the LM head, per-token values from the value
        model (or from this model's own scalar head), or — with ``generate`` — token ids from
        ``generate(**generate)`` (inside this forward, so sharded parameters are gathered for it).

        The model sees ``batch`` in ``layout``; results are per token in packed order ``[T]`` either way.
        ``logp_weights`` ``[T]`` (the loss weights, known before the forward: SFT) gives
        ``weighted = sum_t w_t logps_t``: packed, its gradient is computed in the head's forward pass and
        the log-probs are values only (see :func:`logps_from_hidden`).

        Distillation (:mod:`padless.forward.distill`): ``hidden`` gives a (teacher's) last hidden states
        ``[T, H]``; ``head_of`` (hidden rows ``[n, H]``) gives this model's fp32 logits of them; ``distill``
        gives the student's per-token divergence from the teacher it names, ``weighted`` its loss.

        Under sequence parallelism a packed batch runs split over the group (each rank its chunk, see
        :mod:`padless.forward.sequence_parallel`) and every rank returns the whole row's results."""
        if generate is not None:
            return self.model.generate(**generate)
        if head_of is not None:
            head = LogitsHead.of(unwrap(self.model), temperature)
            return head.finish(head.module(head_of.to(head.dtype)))
        if not isinstance(batch, PackedBatch):
            raise ValueError(
                f"the engine takes packed batches only, got {type(batch).__name__}; a padded comparison "
                "passes the packed batch with layout=BatchLayout(side, pad_id)"
            )
        kw = dict(logps=logps, entropy=entropy, temperature=temperature, values=values)
        split = self.topology.sequence_parallel
        if hidden or distill is not None:
            if layout.side is not None or split is not None:
                raise ValueError(
                    "distillation runs on packed batches of whole rows: set train.batching: tokens or "
                    "packing, and train.sequence_parallel: 1"
                )
            return self._distill(batch, hidden, distill)
        if batch.routes is not None and (layout.side is not None or split is not None):
            raise ValueError(
                "routing replay runs packed rows whole: set train.batching: tokens and "
                "train.sequence_parallel: 1, or rollout.routing_replay: false"
            )
        if layout.side is not None:
            if split is not None:
                raise sequence_parallel.SequenceParallelError(
                    "train.sequence_parallel > 1 runs packed batches only; set train.batching: tokens "
                    "or packing"
                )
            return self._padded(batch, layout, logp_weights=logp_weights, **kw)
        if split is None:
            return self._forward(batch, logp_weights=logp_weights, **kw)
        return split.run(self._forward, batch, logp_weights, **kw)

    @property
    def topology(self) -> Topology:
        """Where this process stands among the run's: what data it holds and which rows it splits."""
        return self.settings.topology

    @property
    def scorer(self) -> torch.nn.Module:
        """The model whose scalar head gives values and scores: the value model, else this model."""
        return self.value if self.value is not None else self.model

    @contextlib.contextmanager
    def recording(self) -> Iterator[RouterRecord | None]:
        """Inside the block, every forward with gradients adds the router load-balancing term of each model
        that has one to the yielded record (``None``: no model of the engine has one); the loop weights
        it by the step's tokens and adds it to the micro-batch's loss."""
        if not any(self.routers):
            yield None
            return
        if self.topology.sequence_parallel is not None:
            raise sequence_parallel.SequenceParallelError(SPLIT_ROWS)
        self._record = RouterRecord()
        try:
            yield self._record
        finally:
            self._record = None

    def _routers(self) -> tuple[RouterLoss | None, RouterLoss | None]:
        """The router terms of this forward: the model's and the scorer's, while recording with gradients."""
        if self._record is None or not torch.is_grad_enabled():
            return None, None
        model, value = self.routers
        return model, (value if self.value is not None else model)

    def _recorded(self, terms: list[tuple[torch.Tensor | None, RouterLoss | None]], tokens: int):
        """Each ``(aux, router)`` of this forward added to the record; their ``coef * aux`` summed."""
        total = None
        for aux, router in terms:
            if aux is not None:
                term = self._record.add(aux, router.coef, tokens)
                total = term if total is None else total + term
        return total

    def _forward(
        self,
        batch: PackedBatch,
        *,
        logps: bool,
        entropy: bool,
        temperature: float,
        logp_weights: torch.Tensor | None,
        values: bool,
    ) -> EngineOutput:
        """The packed pass (one chunk of the row under sequence parallelism); as a tree row where the engine
        runs them and the batch shares a prefix, its results unfolded to the packed order."""
        row = tree_row(batch) if self.tree and batch.routes is None else None
        run = batch if row is None else row
        if row is not None and logp_weights is not None:
            logp_weights = row.fold(logp_weights)

        def unfold(values: torch.Tensor | None) -> torch.Tensor | None:
            return values if row is None or values is None else values.index_select(0, row.unfold)

        out = EngineOutput()
        routers, terms = self._routers(), []
        if logps:
            # routing replay: the policy's routers choose the experts the sampler's chose
            replay = routing.replaying(unwrap(self.model), batch.routes) if batch.routes is not None else None
            with replay or contextlib.nullcontext():
                tokens = forward_packed(
                    self.model,
                    run,
                    entropy=entropy,
                    temperature=temperature,
                    logp_weights=logp_weights,
                    logits_memory_mb=self.settings.logits_memory_mb,
                    router=routers[0],
                )
            out = out._replace(
                logps=unfold(tokens.logps), entropy=unfold(tokens.entropy), weighted=tokens.weighted
            )
            terms.append((tokens.aux, routers[0]))
        if values:
            scores, aux = routed_scores(self.scorer, run, routers[1])
            out = out._replace(values=unfold(scores))
            terms.append((aux, routers[1]))
        return out._replace(aux=self._recorded(terms, batch.num_tokens))

    def _distill(self, batch: PackedBatch, hidden: bool, distill: Distillation | None) -> EngineOutput:
        """A teacher's hidden states, or the student's distillation head (:mod:`padless.forward.distill`)."""
        router = self._routers()[0]
        states, aux = routed_hidden_states(self.model, batch, router)
        if distill is None:
            return EngineOutput(hidden=states[0])
        got = distill_from_hidden(
            LogitsHead.of(unwrap(self.model)),
            states[0],
            batch.labels[0],
            distill,
            logits_memory_mb=self.settings.logits_memory_mb,
        )
        aux = self._recorded([(aux, router)], batch.num_tokens)
        return EngineOutput(logps=got.logps, divergence=got.divergence, weighted=got.weighted, aux=aux)

    def _padded(
        self,
        batch: PackedBatch,
        layout: BatchLayout,
        *,
        logps: bool,
        entropy: bool,
        temperature: float,
        logp_weights: torch.Tensor | None,
        values: bool,
    ) -> EngineOutput:
        """The comparison mode: ``batch`` padded on ``layout.side`` (full logits, pad compute), results
        gathered back to packed order."""
        if entropy:
            raise ValueError("entropy is computed on packed batches only; use train.batching: tokens")
        padded = to_padded(batch, layout.side, layout.pad_id)
        out = EngineOutput()
        routers, terms = self._routers(), []
        if logps:
            logits, aux = routed_padded(self.model, padded, temperature, routers[0])
            tokens = unpad(logits, padded.attention_mask)
            weighted = None if logp_weights is None else (tokens * logp_weights).sum()
            out = out._replace(logps=tokens, weighted=weighted)
            terms.append((aux, routers[0]))
        if values:
            scores, aux = routed_scores(self.scorer, padded, routers[1])
            out = out._replace(values=unpad(scores, padded.attention_mask))
            terms.append((aux, routers[1]))
        return out._replace(aux=self._recorded(terms, batch.num_tokens))


def _active_router(model: torch.nn.Module | None, override: float | None) -> RouterLoss | None:
    """``model``'s router load-balancing term where its objective has one with a coefficient other than 0."""
    if model is None or not defines_router_loss(model):
        return None
    router = RouterLoss.of(model, override)
    return router if router is not None and router.coef != 0 else None


def _no_split(model: torch.nn.Module) -> list[str]:
    """The model's own layer classes for auto-wrapping, less those it does not hold: accelerate's
    transformer auto-wrap stops on a class it cannot find, and Qwen3.5's text-only model lists its
    vision block."""
    inner = unwrap(model)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    present = {type(m).__name__ for m in inner.modules()}
    return [name for name in getattr(inner, "_no_split_modules", None) or [] if name in present]


def as_engine(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` itself when it is (a prepared) :class:`ModelEngine`, else a new engine around it."""
    return model if isinstance(getattr(model, "module", model), ModelEngine) else ModelEngine(model)


def unwrap(model: torch.nn.Module) -> PreTrainedModel:
    """The model inside a DDP / FSDP wrapper (PEFT wrappers forward attribute access themselves)."""
    return getattr(model, "module", model)


def inner_engine(prepared: torch.nn.Module) -> ModelEngine:
    """The :class:`ModelEngine` inside a DDP / DeepSpeed wrapper (FSDP2 shards it in place)."""
    engine = getattr(prepared, "module", prepared)
    assert isinstance(engine, ModelEngine), f"expected a ModelEngine, got {type(engine).__name__}"
    return engine


@contextlib.contextmanager
def reference_engine(policy: torch.nn.Module, ref_model: torch.nn.Module | None) -> Iterator[torch.nn.Module]:
    """The engine reference passes (DPO, RL) run through inside the block: the frozen copy ``ref_model``,
    or, without one, the (prepared) LoRA ``policy`` with its adapters off: the starting policy, without a
    second copy of the weights."""
    if ref_model is not None:
        yield ref_model
        return
    with inner_engine(policy).model.disable_adapter():
        yield policy


def score_positions(batch: PackedBatch, pad_token_id: int | None) -> torch.Tensor:
    """``[N]`` where each sequence's score is read: its last token that is not ``pad_token_id``.

    This is where transformers' sequence classifiers (and reward models trained with them) read a score.
    With ``pad == eos`` a trailing EOS is skipped exactly as they skip it; a sequence made only of pad
    tokens is read at its last token.
    """
    last = batch.last_token_index
    if pad_token_id is None:
        return last
    positions = torch.arange(batch.num_tokens, device=last.device)
    marked = torch.where(batch.input_ids[0] != pad_token_id, positions, -1)
    best = torch.full_like(last, -1).scatter_reduce(0, batch.sequence_index, marked, "amax")
    return torch.where(best >= 0, best, last)


def score_pad_id(prepared: torch.nn.Module) -> int | None:
    """The pad id the scorer's config names (where its scores are read), as transformers reads it."""
    return unwrap(inner_engine(prepared).scorer).config.pad_token_id


def sequence_scores(
    prepared: torch.nn.Module, batch: PackedBatch, layout: BatchLayout = PACKED
) -> torch.Tensor:
    """One score per sequence ``[N]`` through the engine, read at :func:`score_positions`."""
    values = prepared(batch, layout=layout, values=True).values
    return values[score_positions(batch, score_pad_id(prepared))]
