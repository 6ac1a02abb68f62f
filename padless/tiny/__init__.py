"""Embedded tiny defaults: a 4096-token tokenizer, tiny model configs (text and vision-language) and data.

They ship inside the package so that examples, tests and benchmarks run fully offline: nothing is
downloaded. The data and tokenizer are produced by ``scripts/build_tiny.py``; rebuild them with that
script, never by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from padless.tiny.vlm import tiny_qwen2_5_vl

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

TINY_DIR = Path(__file__).resolve().parent
TOKENIZER_DIR = TINY_DIR / "tokenizer"
DATA_DIR = TINY_DIR / "data"

DATASETS = ("sft", "sft_prompt_completion", "preference", "rl", "sft_eval", "preference_eval")
TASKS = ("causal-lm", "score")

# Fixed by scripts/build_tiny.py (special tokens are trained first, in this order).
VOCAB_SIZE = 4096
PAD_TOKEN_ID = 0  # <|endoftext|>
IM_START_TOKEN_ID = 1  # <|im_start|>
EOS_TOKEN_ID = 2  # <|im_end|>


def _tiny_qwen2() -> PretrainedConfig:
    """~3.8M-parameter Qwen2 (q/k/v biases, GQA 8:2, tied embeddings): the main target architecture."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        dtype="float32",
    )


def _tiny_llama() -> PretrainedConfig:
    """~1.4M-parameter Llama (no biases, GQA 4:2, untied head): catches Qwen2-only code paths."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        dtype="float32",
    )


def _tiny_qwen3_5() -> PretrainedConfig:
    """~3.5M-parameter Qwen3.5 text hybrid: three gated delta-net layers then one gated full-attention
    layer (Qwen3.5's 3:1 pattern), partial rotary, GQA 8:2, tied embeddings: a stateful architecture
    that every trainer runs packed (see padless.forward.hybrid)."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=True,
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        dtype="float32",
    )


TINY_MODELS: dict[str, Callable[[], PretrainedConfig]] = {
    "tiny-qwen2": _tiny_qwen2,
    "tiny-llama": _tiny_llama,
    "tiny-qwen3.5": _tiny_qwen3_5,
    "tiny-qwen2.5-vl": tiny_qwen2_5_vl,
}
VISION_MODELS = ("tiny-qwen2.5-vl",)  # load their tokenizer with padless.data.sources.load_processor

# Trained models shipped as Hugging Face folders (built by ``scripts/build_tiny.py --warm-start``):
# ``tiny-llama-arith`` is tiny-llama fine-tuned on the answers of the ``tiny:rl`` prompts, a policy that
# earns some reward, so the RL examples show learning instead of a random model's zero reward.
# ``tiny-llama-calc`` is tiny-llama-arith fine-tuned on calculator conversations (a tool call in the
# embedded template's syntax, its result, the answer) mixed with direct answers: it calls the tool on some
# episodes, the calculator example's start. ``tiny-llama-arith-rl`` is tiny-llama-arith sharpened by GRPO on
# the first 16 ``tiny:rl`` prompts (``--distill-teacher``), the distillation example's teacher.
SHIPPED_MODELS: dict[str, Path] = {
    "tiny-llama-arith": TINY_DIR / "tiny-llama-arith",
    "tiny-llama-calc": TINY_DIR / "tiny-llama-calc",
    "tiny-llama-arith-rl": TINY_DIR / "tiny-llama-arith-rl",
}


def _check_choice(kind: str, value: str, valid: tuple[str, ...] | list[str]) -> None:
    if value not in valid:
        raise ValueError(f"unknown {kind} {value!r}; valid: {', '.join(valid)}")


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh tokenizer on every call: callers set padding_side etc., which must not leak between them."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def tiny_config(name: str) -> PretrainedConfig:
    """A fresh config on every call: transformers mutates configs in place (attn_implementation, dtype)."""
    _check_choice("tiny model", name, list(TINY_MODELS))
    return TINY_MODELS[name]()


def build_tiny_model(name: str, seed: int = 0, task: str = "causal-lm", **kwargs) -> PreTrainedModel:
    """Randomly initialised tiny model; the same seed gives bitwise-identical weights.

    task "causal-lm" builds an LM-head model; "score" builds a sequence-classification model with one
    output, for reward and value models (a vision-language model gets padless's ``score`` head instead).
    ``kwargs`` go to ``from_config`` (e.g. ``attn_implementation``, ``dtype``). Initialisation runs on CPU
    inside a forked RNG, so the caller's global torch RNG state is left untouched.
    """
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForSequenceClassification,
    )

    from padless.forward.vision import add_score_head

    _check_choice("task", task, TASKS)
    config = tiny_config(name)
    image_text = name in VISION_MODELS
    if task == "score" and not image_text:
        config.num_labels = 1
        auto = AutoModelForSequenceClassification
    else:
        auto = AutoModelForImageTextToText if image_text else AutoModelForCausalLM
    # Seed only the CPU generator: torch.manual_seed would also reseed (and so change) every CUDA generator.
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        model = auto.from_config(config, **kwargs)
        return add_score_head(model) if task == "score" and image_text else model


def data_path(name: str) -> Path:
    """Path of an embedded jsonl dataset, e.g. ``data_path("sft")``."""
    _check_choice("dataset", name, DATASETS)
    return DATA_DIR / f"{name}.jsonl"


__all__ = [
    "DATASETS",
    "EOS_TOKEN_ID",
    "IM_START_TOKEN_ID",
    "PAD_TOKEN_ID",
    "SHIPPED_MODELS",
    "TINY_MODELS",
    "VISION_MODELS",
    "VOCAB_SIZE",
    "build_tiny_model",
    "data_path",
    "tiny_config",
    "tiny_tokenizer",
]
