"""Load models on a proven attention backend and run per-token forwards on packed batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from padless import sources
from padless.attention import (
    assert_attention,
    attention_in_use,
    hf_name,
    require_backend,
    runtime_context,
)
from padless.packing import IGNORE_INDEX, PackedBatch, PaddedBatch
from padless.probe import probe_attention
from padless.varlen import sequence_bounds

Task = Literal["causal-lm", "score"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The fp32 logits of one micro-batch may take this much memory before the head runs in chunks
# (train.logits_memory_mb): 1 GiB holds 4,096 positions of a 65k vocabulary, 1,766 of a 152k one.
DEFAULT_LOGITS_MEMORY_MB = 1024
_logits_memory_bytes = DEFAULT_LOGITS_MEMORY_MB * 2**20


def set_logits_memory(megabytes: int) -> None:
    """Set the memory the fp32 logits of one micro-batch may take before the head runs in chunks."""
    global _logits_memory_bytes
    if megabytes <= 0:
        raise ValueError(f"logits memory budget must be positive, got {megabytes} MB")
    _logits_memory_bytes = megabytes * 2**20


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id padless pads with (only ever for ``generate`` and comparisons): pad, else eos."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Tokenizer for an embedded name (``tiny-qwen2``), a local directory or a cached model id."""
    return sources.load_tokenizer(name_or_path, trust_remote_code)


def load_model(
    name_or_path: str,
    *,
    task: Task = "causal-lm",
    attn_implementation: str = "varlen",
    dtype: str | torch.dtype = "float32",
    device: torch.device | str = "cpu",
    seed: int = 0,
    training: bool = False,
    probe: bool = True,
    pad_id: int | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """Load a model whose attention is proven to be ``attn_implementation`` and to isolate packed sequences.

    Embedded names build the tiny models from ``seed``; anything else is checked and loaded from a local
    folder by :mod:`padless.sources` (never downloaded), which gives the model a config object of its own.
    A scorer whose config names no pad token gets ``pad_id`` (its tokenizer's, see :func:`pad_token_id`):
    scores are read at the last token that is not it, as transformers' sequence classifiers read them.
    """
    require_backend(attn_implementation, device, training)
    torch_dtype = resolve_dtype(dtype)
    kwargs: dict[str, Any] = {"attn_implementation": hf_name(attn_implementation), "dtype": torch_dtype}
    model = sources.load_pretrained(
        name_or_path, task, seed=seed, trust_remote_code=trust_remote_code, **kwargs
    )
    if task == "score" and model.config.pad_token_id is None:
        model.config.pad_token_id = pad_id if pad_id is not None else model.config.eos_token_id
    model.to(device)
    model.train(training)
    model.padless_attention = attn_implementation
    if probe:
        model.padless_probe = probe_attention(model, attn_implementation)  # what ran: the run log says it
    else:
        assert_attention(model, attn_implementation)
    return model


@dataclass
class TokenOutputs:
    """Per-token results of a packed forward, each ``[T]`` in fp32; zero where the label is ignored."""

    logps: torch.Tensor
    entropy: torch.Tensor | None = None
    weighted: torch.Tensor | None = None  # sum_t w_t logps_t for logp_weights w (see logps_from_hidden)


def unwrap(model: torch.nn.Module) -> PreTrainedModel:
    """The model inside a DDP / FSDP wrapper (PEFT wrappers forward attribute access themselves)."""
    return getattr(model, "module", model)


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout in ``model`` to 0 (``nn.Dropout`` modules, LoRA's included, and attention
    dropout); returns how many were on. RL divides log-probs of two passes over the same tokens: dropout
    would make that ratio noise."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            module.p, changed = 0.0, changed + 1
        if isinstance(getattr(module, "attention_dropout", None), float) and module.attention_dropout > 0:
            module.attention_dropout, changed = 0.0, changed + 1
    return changed


def checked_backend(model: torch.nn.Module) -> str:
    """The backend the model was loaded with, after checking its config still dispatches to it."""
    inner = unwrap(model)
    backend = getattr(inner, "padless_attention", None) or attention_in_use(inner)
    assert_attention(inner, backend)
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
    return inner.base_model


def hidden_states(model: torch.nn.Module, batch: PackedBatch | PaddedBatch) -> torch.Tensor:
    """Last hidden states (``[1, T, H]`` packed, ``[N, L, H]`` padded) with no head applied.

    Never a KV cache: with one, transformers drops its per-sequence mask.
    """
    backend = checked_backend(model)
    with runtime_context(backend, batch.input_ids.device):
        return backbone(model)(**model_inputs(batch), use_cache=False).last_hidden_state


@dataclass(frozen=True)
class LogitsHead:
    """How a causal LM turns hidden states into the logits its log-probs are taken from:
    ``cap(head(h) / scaling) / temperature``, as transformers' models compute them (Granite divides by
    ``logits_scaling``, Gemma 2 soft-caps with ``final_logit_softcapping``), in fp32."""

    module: torch.nn.Module
    scaling: float = 1.0
    softcap: float | None = None
    temperature: float = 1.0

    @classmethod
    def of(cls, model: PreTrainedModel, temperature: float = 1.0) -> LogitsHead:
        text = model.config.get_text_config()
        return cls(
            model.get_output_embeddings(),
            getattr(text, "logits_scaling", None) or 1.0,
            getattr(text, "final_logit_softcapping", None) or None,
            temperature,
        )

    @property
    def vocab(self) -> int:
        return self.module.weight.shape[0]

    def fusable(self) -> bool:
        """Whether the fused weighted path can read the head's weight directly: a plain bias-free
        ``nn.Linear`` (not a LoRA-wrapped head) whose weight is whole here (not ZeRO-3-partitioned, which
        DeepSpeed gathers only inside the module's own forward)."""
        plain = type(self.module) is torch.nn.Linear and self.module.bias is None
        return plain and not hasattr(self.module.weight, "ds_id")

    def finish(self, raw: torch.Tensor) -> torch.Tensor:
        """fp32 logits from the head's raw output."""
        logits = raw.float()
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
    batch: PackedBatch,
    *,
    entropy: bool = False,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    logp_weights: torch.Tensor | None = None,
) -> TokenOutputs:
    """Per-token log-probs of ``batch.labels`` (and optionally entropy); see :func:`logps_from_hidden`."""
    hidden = hidden_states(model, batch)[0]
    return logps_from_hidden(
        unwrap(model),
        hidden,
        batch.labels[0],
        entropy=entropy,
        temperature=temperature,
        chunk_tokens=chunk_tokens,
        logp_weights=logp_weights,
    )


def logps_from_hidden(
    model: PreTrainedModel,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    *,
    entropy: bool = False,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    logp_weights: torch.Tensor | None = None,
) -> TokenOutputs:
    """The LM head and log-softmax over hidden states ``[T, H]``, on the positions that have a label only.

    The fp32 logits of those positions are computed whole when they fit the logits memory budget
    (:func:`set_logits_memory`), else in chunks of rows that do (``chunk_tokens`` forces a chunk size).
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
    y = labels if rows is None else labels[rows]
    step = chunk_tokens or max(1, _logits_memory_bytes // (4 * head.vocab))
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
    backend = checked_backend(model)
    with runtime_context(backend, batch.input_ids.device):
        logits = model(**model_inputs(batch), use_cache=False).logits
    logps = (
        (logits.float() / temperature)
        .log_softmax(-1)
        .gather(-1, batch.labels.clamp(min=0)[..., None])[..., 0]
    )
    return logps * (batch.labels != IGNORE_INDEX)


def score_head(model: PreTrainedModel) -> torch.nn.Module:
    """The scalar head of a reward / value model (``AutoModelForSequenceClassification`` with 1 label)."""
    for name in ("score", "classifier", "v_head"):
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Module):
            return head
    raise ValueError(
        f"{type(model).__name__} has no scalar head (score / classifier / v_head); load it with task='score'"
    )


def forward_scores(model: torch.nn.Module, batch: PackedBatch | PaddedBatch) -> torch.Tensor:
    """Per-token scalars from a scalar head (fp32): ``[T]`` packed, ``[N, L]`` padded."""
    scores = score_head(unwrap(model))(hidden_states(model, batch))[..., 0].float()
    return scores[0] if isinstance(batch, PackedBatch) else scores
