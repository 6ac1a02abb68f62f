"""The embedded vision-language default: a tiny Qwen2.5-VL built from a seed, and its processor.

The tokenizer is the embedded text tokenizer with Qwen's four vision tokens appended (ids 4096-4099) and a
chat template that renders list contents (``{"type": "image"}`` / ``{"type": "text"}`` parts). The image
processor is Qwen2-VL's PIL one, sized for 28-112 pixel images, so nothing needs torchvision or a download.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig, ProcessorMixin

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
VISION_START_ID, VISION_END_ID, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = 4096, 4097, 4098, 4099
VLM_VOCAB_SIZE = 4100
PATCH_SIZE = 14
MERGE_SIZE = 2
MIN_PIXELS = 28 * 28  # one merged token
MAX_PIXELS = 112 * 112  # 16 merged tokens

# ChatML whose contents may be lists of parts. Each image part becomes one <|image_pad|> between the vision
# delimiters; the processor expands it to as many tokens as the image has merged patches. Assistant content
# and its <|im_end|> sit inside {% generation %} so the loss mask comes from the template.
CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- generation -%}{{ render(message['content']) + '<|im_end|>' }}{%- endgeneration -%}"
    "{{ '\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + render(message['content']) + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def tiny_qwen2_5_vl() -> PretrainedConfig:
    """~1M-parameter Qwen2.5-VL: 2 vision blocks (one windowed, one full) and a 2-layer M-RoPE decoder."""
    from transformers import Qwen2_5_VLConfig

    from padless.tiny import EOS_TOKEN_ID, PAD_TOKEN_ID

    hidden = 128
    return Qwen2_5_VLConfig(
        text_config={
            "vocab_size": VLM_VOCAB_SIZE,
            "hidden_size": hidden,
            "intermediate_size": 344,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
            "bos_token_id": None,
            "eos_token_id": EOS_TOKEN_ID,
            "pad_token_id": PAD_TOKEN_ID,
            "initializer_range": 0.02,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 4,
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": MERGE_SIZE,
            "temporal_patch_size": 2,
            "window_size": 56,  # 2x2 merged tokens per window: small images still get several windows
            "fullatt_block_indexes": [1],
            "out_hidden_size": hidden,
            "initializer_range": 0.02,
        },
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
        tie_word_embeddings=True,
        dtype="float32",
    )


def tiny_vlm_processor() -> ProcessorMixin:
    """A fresh processor (tokenizer + PIL image processor) for the tiny VLM on every call."""
    from transformers import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from padless.forward.vision import image_only
    from padless.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    ids = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    if ids != [VISION_START_ID, VISION_END_ID, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID]:
        raise RuntimeError(f"vision tokens got ids {ids}; the embedded tokenizer changed size")
    tokenizer.chat_template = CHAT_TEMPLATE
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH_SIZE, merge_size=MERGE_SIZE
    )
    return image_only(Qwen2_5_VLProcessor)(image_processor, tokenizer, chat_template=CHAT_TEMPLATE)
