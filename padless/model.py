"""Load models on a proven attention backend and run per-token forwards on packed batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from padless import sources
from padless.attention import (
    assert_attention,
    attention_in_use,
    hf_name,
    probe_attention,
    require_backend,
    runtime_context,
)
from padless.packing import IGNORE_INDEX, PackedBatch, PaddedBatch

Task = Literal["causal-lm", "score"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# At most this many fp32 logits exist at once in forward_packed: 2**26 floats = 256 MiB.
LOGIT_CHUNK_ELEMENTS = 2**26


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


def _chunk_logps(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    labels: torch.Tensor,
    temperature: float,
    softcap: float | None,
    with_entropy: bool,
    logits_scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden).float() / logits_scaling
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if temperature != 1.0:
        logits = logits / temperature
    logp = logits.log_softmax(-1)
    picked = logp.gather(-1, labels.clamp(min=0)[:, None])[:, 0]
    entropy = -(logp.exp() * logp).sum(-1) if with_entropy else torch.zeros_like(picked)
    return picked, entropy


def forward_packed(
    model: torch.nn.Module,
    batch: PackedBatch,
    *,
    entropy: bool = False,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> TokenOutputs:
    """Per-token log-probs of ``batch.labels`` (and optionally entropy), log-softmax in chunks.

    With gradients on, each chunk is recomputed in backward, so the fp32 ``[T, vocab]`` logits never
    exist at once: memory holds only one chunk of ``LOGIT_CHUNK_ELEMENTS`` floats.
    """
    hidden = hidden_states(model, batch)[0]
    return logps_from_hidden(
        unwrap(model),
        hidden,
        batch.labels[0],
        entropy=entropy,
        temperature=temperature,
        chunk_tokens=chunk_tokens,
    )


def logps_from_hidden(
    model: PreTrainedModel,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    *,
    entropy: bool = False,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> TokenOutputs:
    """The LM head and log-softmax over hidden states ``[T, H]``, chunked (see :func:`forward_packed`)."""
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0]
    step = chunk_tokens or max(1, LOGIT_CHUNK_ELEMENTS // vocab)
    softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    logits_scaling = getattr(model.config.get_text_config(), "logits_scaling", 1.0)  # Granite divides by it
    logps, ents = [], []
    for start in range(0, hidden.shape[0], step):
        args = (
            hidden[start : start + step],
            head,
            labels[start : start + step],
            temperature,
            softcap,
            entropy,
            logits_scaling,
        )
        if torch.is_grad_enabled() and hidden.requires_grad:
            picked, ent = checkpoint(_chunk_logps, *args, use_reentrant=False)
        else:
            picked, ent = _chunk_logps(*args)
        logps.append(picked)
        ents.append(ent)
    keep = labels != IGNORE_INDEX
    logp = torch.cat(logps) * keep
    return TokenOutputs(logps=logp, entropy=torch.cat(ents) * keep if entropy else None)


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
