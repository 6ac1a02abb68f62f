"""Load models: an embedded tiny model or a local folder, on a proven attention backend, with its
tokenizer. What runs on a loaded model (every forward, its heads and settings) is
:mod:`padless.forward.engine`."""

from __future__ import annotations

from typing import Any, Literal

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from padless.config.choices import DTYPE_NAMES
from padless.data import sources
from padless.forward import hybrid
from padless.forward.attention import assert_attention, hf_name, pin_kernel, require_backend
from padless.forward.engine import EngineSettings
from padless.proof.probe import prove

Task = Literal["causal-lm", "score"]
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


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
    varlen_kernel: str | None = None,
    settings: EngineSettings | None = None,
) -> PreTrainedModel:
    """Load a model whose attention is proven to be ``attn_implementation`` and to isolate packed sequences.

    Embedded names build the tiny models from ``seed``; anything else is checked and loaded from a local
    folder by :mod:`padless.data.sources` (never downloaded), which gives the model a config object of its
    own. A scorer whose config names no pad token gets ``pad_id`` (its tokenizer's, see :func:`pad_token_id`):
    scores are read at the last token that is not it, as transformers' sequence classifiers read them.
    ``varlen_kernel`` is the kernel pinned behind ``varlen`` on the model (``None``: ``auto``): it travels
    with the model (:func:`padless.forward.attention.pin_kernel`) and is checked and proven here.
    ``settings``: those of the engines the model will run in; where they run tree rows
    (:meth:`~padless.forward.engine.EngineSettings.runs_tree`), the probe proves that layout too.
    """
    kernel = varlen_kernel or "auto"
    require_backend(attn_implementation, device, training, kernel)
    torch_dtype = resolve_dtype(dtype)
    kwargs: dict[str, Any] = {"attn_implementation": hf_name(attn_implementation), "dtype": torch_dtype}
    model = sources.load_pretrained(
        name_or_path, task, seed=seed, trust_remote_code=trust_remote_code, **kwargs
    )
    hybrid.install(model)  # every sequence of a packed row starts at zero state in stateful layers
    pin_kernel(model, kernel)
    if task == "score" and model.config.pad_token_id is None:
        model.config.pad_token_id = pad_id if pad_id is not None else model.config.eos_token_id
    model.to(device)
    model.train(training)
    model.padless_attention = attn_implementation
    if probe:
        tree = settings is not None and settings.runs_tree(model, attn_implementation)
        model.padless_probe = prove(model, attn_implementation, tree)  # what ran: the log says it
    else:
        hybrid.require_packing(model)  # what the probe refuses first, without it
        assert_attention(model, attn_implementation)
    return model


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


def tokenizer_differences(student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase) -> list[str]:
    """What differs between two tokenizers that must map text to the same ids (a student's and its
    teacher's): the vocabulary, the special tokens, the chat template. Empty when they are the same."""
    found = []
    mine, theirs = student.get_vocab(), teacher.get_vocab()
    if mine != theirs:
        moved = sum(mine[t] != theirs[t] for t in mine.keys() & theirs.keys())
        only_mine, only_theirs = len(mine.keys() - theirs.keys()), len(theirs.keys() - mine.keys())
        found.append(
            f"the vocabulary ({len(mine)} vs {len(theirs)} tokens, {only_mine} only in the student's, "
            f"{only_theirs} only in the teacher's, {moved} with another id)"
        )
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        a, b = getattr(student, name, None), getattr(teacher, name, None)
        if a != b:
            found.append(f"{name} ({a!r} vs {b!r})")
    extra = sorted(set(student.all_special_tokens) ^ set(teacher.all_special_tokens))
    if extra:
        found.append(f"special tokens ({', '.join(map(repr, extra[:3]))}{' ...' if len(extra) > 3 else ''})")
    if student.chat_template != teacher.chat_template:
        found.append("the chat template")
    return found
