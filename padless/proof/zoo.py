"""Tiny configs, built in code, of the architectures people fine-tune, each set up to exercise what makes
its attention different (sliding windows, soft-capping, sinks, MLA head sizes, NoPE layers, scaling
multipliers, chunked attention, linear-attention layers).

Every model is 2 layers of hidden size 64 over the embedded tokenizer's 4096-token vocabulary, so the
whole zoo runs through ``padless check --zoo`` and the test suite in seconds on a CPU. Weights are drawn
with a larger spread than real initialisations (``INIT_STD``) so that attention scores are far from
uniform and a dropped argument (a soft-cap, a sink, a window) moves log-probs visibly; the LM head is
then rescaled so that the largest |logit| on the probe text is ``LOGIT_TARGET``, where real models live.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from padless.forward import hybrid
from padless.forward.vision import is_vision_config
from padless.tiny import EOS_TOKEN_ID, PAD_TOKEN_ID, VOCAB_SIZE

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
MAX_PARAMETERS = 150_000_000  # janus's image head is the largest that builds (121M); the rest are < 45M
INTERMEDIATE = 128
WINDOW = 8  # sliding windows far shorter than the probe sequences, so the window decides results
INIT_STD = 0.1
LOGIT_TARGET = 30.0


def _common(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": 1024,
        "initializer_range": INIT_STD,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "dtype": "float32",
    }
    base.update(overrides)
    return base


def _llama3() -> PretrainedConfig:
    from transformers import LlamaConfig

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return LlamaConfig(**_common(head_dim=HEAD_DIM, rope_parameters=rope))


def _qwen2() -> PretrainedConfig:
    from transformers import Qwen2Config

    return Qwen2Config(**_common())


def _qwen3() -> PretrainedConfig:
    from transformers import Qwen3Config

    return Qwen3Config(**_common(head_dim=HEAD_DIM))


def _qwen3_moe() -> PretrainedConfig:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **_common(head_dim=HEAD_DIM, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    )


def _mistral() -> PretrainedConfig:
    from transformers import MistralConfig

    return MistralConfig(**_common(head_dim=HEAD_DIM, sliding_window=WINDOW))


def _gemma2() -> PretrainedConfig:
    from transformers import Gemma2Config

    return Gemma2Config(
        **_common(
            head_dim=HEAD_DIM,
            query_pre_attn_scalar=HEAD_DIM,
            sliding_window=WINDOW,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=30.0,
        )
    )


def _gemma3() -> PretrainedConfig:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **_common(
            head_dim=HEAD_DIM,
            query_pre_attn_scalar=HEAD_DIM,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        )
    )


def _gemma3_bidirectional() -> PretrainedConfig:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **_common(
            head_dim=HEAD_DIM,
            query_pre_attn_scalar=HEAD_DIM,
            use_bidirectional_attention=True,
            layer_types=["full_attention", "full_attention"],
        )
    )


def _phi3() -> PretrainedConfig:
    from transformers import Phi3Config

    return Phi3Config(**_common(sliding_window=2 * WINDOW))


def _olmo2() -> PretrainedConfig:
    from transformers import Olmo2Config

    return Olmo2Config(**_common())


def _smollm3() -> PretrainedConfig:
    from transformers import SmolLM3Config

    return SmolLM3Config(**_common(no_rope_layer_interval=2))


def _granite() -> PretrainedConfig:
    from transformers import GraniteConfig

    return GraniteConfig(
        **_common(
            attention_multiplier=0.5,
            embedding_multiplier=4.0,
            residual_multiplier=0.5,
            logits_scaling=4.0,
        )
    )


def _gpt_oss() -> PretrainedConfig:
    from transformers import GptOssConfig

    return GptOssConfig(
        **_common(
            head_dim=HEAD_DIM,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 8.0,  # max_position_embeddings / original_max_position_embeddings
                "original_max_position_embeddings": 128,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        )
    )


def _deepseek_v3() -> PretrainedConfig:
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        **_common(
            num_key_value_heads=HEADS,
            moe_intermediate_size=32,
            n_shared_experts=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    )


def _qwen3_next() -> PretrainedConfig:
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        **_common(
            head_dim=HEAD_DIM,
            layer_types=["linear_attention", "full_attention"],
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        )
    )


def _lfm2() -> PretrainedConfig:
    from transformers import Lfm2Config

    return Lfm2Config(**_common(layer_types=["conv", "full_attention"], conv_L_cache=3, conv_bias=True))


def _llama4_text() -> PretrainedConfig:
    from transformers import Llama4TextConfig

    return Llama4TextConfig(
        **_common(
            head_dim=HEAD_DIM,
            intermediate_size_mlp=INTERMEDIATE,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=1,
            attention_chunk_size=WINDOW,
            no_rope_layer_interval=2,  # layer 0: RoPE, chunked; layer 1: NoPE, full, temperature-tuned
            floor_scale=4 * WINDOW,
        )
    )


@dataclass(frozen=True)
class ZooEntry:
    """One architecture of the zoo and what its tiny config exercises."""

    config: Callable[[], PretrainedConfig]
    exercises: str


ZOO: dict[str, ZooEntry] = {
    "llama3": ZooEntry(_llama3, "llama3 RoPE scaling, GQA 4:2"),
    "qwen2": ZooEntry(_qwen2, "q/k/v biases, GQA"),
    "qwen3": ZooEntry(_qwen3, "q/k RMSNorm"),
    "qwen3-moe": ZooEntry(_qwen3_moe, "sparse MoE, 4 experts top-2"),
    "mistral": ZooEntry(_mistral, f"sliding window {WINDOW} on every layer"),
    "gemma2": ZooEntry(_gemma2, f"attention soft-cap 2, final soft-cap 30, sliding window {WINDOW}"),
    "gemma3": ZooEntry(_gemma3, f"q/k norm, sliding window {WINDOW} / full layers"),
    "gemma3-bidirectional": ZooEntry(
        _gemma3_bidirectional, "bidirectional attention (module.is_causal False), as in EmbeddingGemma"
    ),
    "phi3": ZooEntry(_phi3, f"fused qkv, sliding window {2 * WINDOW}"),
    "olmo2": ZooEntry(_olmo2, "q/k norm after projection, post-norm blocks"),
    "smollm3": ZooEntry(_smollm3, "NoPE layers (no rotary on every 2nd layer)"),
    "granite": ZooEntry(_granite, "attention / embedding / residual multipliers, logits scaling"),
    "gpt-oss": ZooEntry(_gpt_oss, f"attention sinks, sliding window {WINDOW} / full layers, YaRN, MoE"),
    "deepseek-v3": ZooEntry(_deepseek_v3, "MLA: q/k head size 24, value head size 8; MoE"),
    "qwen3-next": ZooEntry(_qwen3_next, "hybrid: gated delta-net linear attention + gated full attention"),
    "lfm2": ZooEntry(_lfm2, "hybrid: short causal convolution (kernel 3) + full attention"),
    "llama4_text": ZooEntry(
        _llama4_text,
        f"chunked attention (chunks of {WINDOW}) / NoPE layers with query temperature tuning from "
        f"{4 * WINDOW} tokens on, MoE top-1",
    ),
}


def zoo_names() -> list[str]:
    """The whole zoo: the hand-built configs, then every other causal-LM model type of transformers (a
    hand-built config named after a model type, e.g. ``qwen2``, stands for it), then the
    image-text-to-text ones padless loads (:func:`image_text_types`)."""
    return [*ZOO, *(t for t in (*causal_lm_types(), *image_text_types()) if t not in ZOO)]


def zoo_config(name: str) -> PretrainedConfig:
    """A fresh config (transformers writes into config objects: never share one between models): the
    hand-built one, else one derived from the model type's defaults (:func:`derived_config`)."""
    if name in ZOO:
        return ZOO[name].config()
    if name in causal_lm_types() or name in image_text_types():
        return derived_config(name)
    raise ValueError(
        f"unknown zoo architecture {name!r}; choose one of {', '.join(ZOO)} or a causal-LM model type of "
        "transformers (padless check --zoo lists them)"
    )


def exercises(name: str, config: PretrainedConfig) -> str:
    """What a zoo config exercises: the hand-built entry's note, or what a derived config kept."""
    if name in ZOO:
        return ZOO[name].exercises
    text = config.get_text_config()
    found = [
        f"{k.replace('_', ' ')} {v}"
        for k in OPTIONAL - {"num_key_value_heads", "q_lora_rank"}
        if isinstance(v := getattr(text, k, None), int)
    ]
    kinds = sorted(set(getattr(text, "layer_types", None) or ()))
    if len(kinds) > 1:
        found.append("layers " + " / ".join(kinds))
    if getattr(text, "kv_lora_rank", None):
        found.append("MLA")
    if isinstance(top := getattr(text, "index_topk", None), int):
        found.append(f"indexer top-{top} keys")
    if isinstance(block := getattr(text, "block_size", None), int):
        found.append(f"blocks of {block}")
    if any(
        isinstance(getattr(text, k, None), int)
        for k in ("num_experts", "num_local_experts", "n_routed_experts")
    ):
        found.append("MoE")
    return "derived: " + (", ".join(found) or "defaults shrunk")


def build_zoo_model(name: str, attn_implementation: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """Randomly initialised zoo model on CPU (same seed, same weights), in eval mode, head not yet scaled.
    A vision-language config builds its image-text-to-text class, as padless loads it (text-only
    sequences run through its language model)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = zoo_config(name)
    auto = AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM
    with torch.device("meta"):  # sized before a byte is allocated: a part left large stops here
        size = sum(p.numel() for p in auto.from_config(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(
            f"the derived config still has {size / 1e6:.0f}M parameters (a part the shrinking does not "
            f"reach); the zoo builds at most {MAX_PARAMETERS / 1e6:.0f}M"
        )
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        model = auto.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    hybrid.install(model)
    return model.eval()


def scale_head(model: PreTrainedModel, factor: float) -> None:
    """Multiply the LM head so every logit is ``factor`` times larger (before any final soft-cap)."""
    head = model.get_output_embeddings()
    with torch.no_grad():
        head.weight.mul_(factor)
        if getattr(head, "bias", None) is not None:
            head.bias.mul_(factor)


# ----------------------------------------------------------------------------------------------------------
# Tiny configs derived from every causal-LM architecture transformers registers
# ----------------------------------------------------------------------------------------------------------

# Config key -> its tiny value, set wherever an architecture's config has the key (and, for the keys of
# optional features, a value: a window or an MLA rank that is None stays off).
TINY_SIZES: dict[str, int] = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "embed_dim", "model_dim"), HIDDEN),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers"), LAYERS),
    **dict.fromkeys(
        ("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads"), HEADS
    ),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"), KV_HEADS),
    **dict.fromkeys(("head_dim", "kv_channels", "attention_head_dim"), HEAD_DIM),
    **dict.fromkeys(
        ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "decoder_ffn_dim"), INTERMEDIATE
    ),
    **dict.fromkeys(("vocab_size",), VOCAB_SIZE),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "seq_length", "n_ctx"), 1024),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(
        ("num_experts_per_tok", "moe_topk", "num_selected_experts", "moe_k", "num_experts_per_token"), 2
    ),
    **dict.fromkeys(
        ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"), 32
    ),
    **dict.fromkeys(
        ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts", "n_group", "topk_group"), 1
    ),
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 8,
    **dict.fromkeys(("rotary_dim", "rotary_emb_base_dim"), HEAD_DIM // 2),
    **dict.fromkeys(("sliding_window", "attention_chunk_size", "local_window_size"), WINDOW),
    "block_size": WINDOW,  # lightning attention's blocks (MiniMax): its state carried from block to block
    "index_topk": WINDOW,  # indexed sparse attention (DeepSeek-V3.2): the indexer chooses among the keys
    # linear-attention and state-space layers: few small heads and states, several scan chunks per sequence
    **dict.fromkeys(
        ("linear_key_head_dim", "linear_value_head_dim", "mamba_d_head", "mamba_head_dim"), HEAD_DIM
    ),
    **dict.fromkeys(("linear_num_key_heads", "mamba_n_groups", "n_groups"), 1),
    **dict.fromkeys(("linear_num_value_heads", "mamba_n_heads", "mamba_num_heads"), 2 * HEADS),
    **dict.fromkeys(("mamba_d_state", "ssm_state_size"), 16),
    "mamba_d_ssm": 2 * HIDDEN,
    "mamba_chunk_size": 32,
    "initializer_range": INIT_STD,
}
OPTIONAL = frozenset(
    {"sliding_window", "attention_chunk_size", "local_window_size", "q_lora_rank", "num_key_value_heads"}
)


def causal_lm_types() -> list[str]:
    """Every model type in transformers' causal-LM auto mapping (the installed release's)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def image_text_types() -> list[str]:
    """The image-text-to-text model types padless loads (their config has a vision tower,
    :func:`padless.forward.vision.is_vision_config`) that the causal-LM mapping does not list already."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return sorted(
        t
        for t in set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES) - set(causal_lm_types())
        if t in CONFIG_MAPPING and "vision_config" in getattr(CONFIG_MAPPING[t], "sub_configs", {})
    )


def _tiny_kwargs(defaults: dict[str, object]) -> dict[str, object]:
    """The overrides that shrink one config (given as its defaults) to the zoo's size."""
    kwargs: dict[str, object] = {
        key: value
        for key, value in TINY_SIZES.items()
        if key in defaults and not (key in OPTIONAL and defaults[key] is None)
    }
    # per-layer kinds (layer_types, mlp_layer_types, ...): every kind of layer once, in order (mixed stays
    # mixed), every list as long as the deepest needs
    kinds = {
        key: list(dict.fromkeys(value))
        for key, value in defaults.items()
        if key.endswith("layer_types") and isinstance(value, list) and value
    }
    layers = max([LAYERS, *map(len, kinds.values())])
    for key, kept in kinds.items():
        kwargs[key] = [kept[i % len(kept)] for i in range(layers)]
    kwargs.update({k: layers for k in TINY_SIZES if TINY_SIZES[k] == LAYERS and k in defaults})
    depth = defaults.get("num_hidden_layers")
    for key, value in defaults.items():  # other per-layer values (Gemma 3n's sparsity and widths): the tiny
        if key in kinds or not isinstance(value, list) or not value or len(value) != depth:  # depth's first
            continue
        kwargs[key] = [TINY_SIZES.get(key, value[i % len(value)]) for i in range(layers)]
    for key, value in defaults.items():  # overrides of layers by index (Gemma 4's per_layer_config): none
        if isinstance(value, dict) and value and all(isinstance(k, str) and k.isdigit() for k in value):
            kwargs[key] = {}
    if defaults.get("kv_lora_rank") and "num_key_value_heads" in kwargs:  # MLA: one latent per query head
        kwargs["num_key_value_heads"] = HEADS
    if "qk_rope_head_dim" in defaults:  # MLA: head_dim is the rotary part, qk_head_dim the whole
        kwargs["head_dim"] = TINY_SIZES["qk_rope_head_dim"]
        kwargs["qk_head_dim"] = TINY_SIZES["qk_rope_head_dim"] + TINY_SIZES["qk_nope_head_dim"]
    if isinstance(defaults.get("expand"), int) and {"num_heads", "head_dim"} <= kwargs.keys():
        kwargs["num_heads"] = HIDDEN * defaults["expand"] // HEAD_DIM  # Mamba-2: heads span the expansion
    for key, value in defaults.items():  # special tokens inside the tiny vocabulary
        if key.endswith(("_token_id", "_token_index")) and isinstance(value, int) and value >= VOCAB_SIZE:
            kwargs[key] = VOCAB_SIZE - 1
    if "is_decoder" in defaults:  # encoder architectures registered as causal LMs decode causally
        kwargs["is_decoder"] = True
    kwargs.update({"pad_token_id": PAD_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "tie_word_embeddings": False})
    return {k: v for k, v in kwargs.items() if k in defaults or k == "tie_word_embeddings"}


def derived_config(model_type: str) -> PretrainedConfig:
    """A tiny config of ``model_type``, derived from its config class's defaults: sizes shrunk
    (:data:`TINY_SIZES`), windows and chunks cut to ``WINDOW`` tokens, every kind of layer kept. Raises
    whatever transformers raises when the architecture cannot be built that way."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    defaults = cls().to_dict()
    kwargs = {**_tiny_kwargs(defaults), **_mrope(cls, defaults)}
    for key, sub in cls.sub_configs.items():  # composite configs (text + vision): shrink each part
        if isinstance(defaults.get(key), dict):
            kind = defaults[key].get("model_type")
            # AutoConfig names no class; the lazy mapping's .get skips its __getitem__, hence no .get
            part = CONFIG_MAPPING[kind] if kind in CONFIG_MAPPING else sub  # noqa: SIM401
            kwargs[key] = {**defaults[key], **_tiny_kwargs(defaults[key]), **_mrope(part, defaults[key])}
    return cls(**kwargs, dtype="float32")


def _mrope(cls: type, defaults: dict[str, object]) -> dict[str, object]:
    """M-RoPE's sections (temporal, height, width) cut to the tiny head: they must sum to half of it.
    Unset, the modeling code's default (16, 24, 24: a 128-wide head) is the one scaled."""
    rope = defaults.get("rope_parameters")
    mrope = "mrope_section" in getattr(cls, "ignore_keys_at_rope_validation", ())
    if not mrope or not isinstance(rope, dict):
        return {}
    section = list(rope.get("mrope_section") or (16, 24, 24))
    half = HEAD_DIM // 2
    tiny = [max(1, round(s * half / sum(section))) for s in section]
    tiny[-1] += half - sum(tiny)
    return {"rope_parameters": {**rope, "mrope_section": tiny}}
