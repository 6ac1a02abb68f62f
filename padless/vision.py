"""Vision-language models on the packed path: detection, processor loading, M-RoPE positions, vision tower.

Three facts shape this module (transformers 5.23):

- M-RoPE models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) rotate every token by three position rows (time,
  height, width). Packed, each sample's rows must be its own (the model's ``get_rope_index`` run on that
  sample alone) and a fourth row, the text position restarting at 0 per sequence, is stacked on top:
  ``[4, 1, T]``. 2D or ``[3, 1, T]`` ids make packed sequences leak into each other.
- The vision tower bounds each image itself from ``image_grid_thw`` (transformers keeps the text row's
  ``cu_seq_lens_*`` out of it) and calls attention with ``is_causal=False``, which the ``varlen``
  backend honours: pixel values of every sample concatenated encode exactly as each image alone.
- The Qwen-VL processors list a video processor, which needs torchvision; :func:`image_only` builds the
  model's own processor class without it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch


def is_vision_config(config: Any) -> bool:
    """Whether a model config describes a vision-language model (it has a vision tower config)."""
    return getattr(config, "vision_config", None) is not None


def _base_model_class(config: Any) -> type:
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    return MODEL_MAPPING[type(config)]


def uses_mrope(config: Any) -> bool:
    """Whether the model positions tokens with M-RoPE (its base model has ``get_rope_index``)."""
    return is_vision_config(config) and hasattr(_base_model_class(config), "get_rope_index")


class RopeIndex:
    """The model's own ``get_rope_index`` for one sample at a time, without loading the model.

    ``get_rope_index`` reads only ``self.config`` and ``self.get_vision_position_ids`` (which uses no state),
    so it runs on a stand-in holding the config: data preparation gets exact positions from the config
    alone.
    """

    def __init__(self, config: Any) -> None:
        if not uses_mrope(config):
            raise ValueError(f"{type(config).__name__} does not use M-RoPE; it needs no rope index")
        cls = _base_model_class(config)
        self._fn = cls.get_rope_index
        self._self = SimpleNamespace(
            config=config, get_vision_position_ids=partial(cls.get_vision_position_ids, None)
        )
        self.image_token_id = config.image_token_id
        self.video_token_id = getattr(config, "video_token_id", None)

    def __call__(self, input_ids: Sequence[int], image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """Positions ``[3, L]`` (long) of one sequence, whose images have grids ``image_grid_thw``."""
        ids = torch.as_tensor(list(input_ids), dtype=torch.long)[None]
        types = (ids == self.image_token_id).int()
        if self.video_token_id is not None:
            types += 2 * (ids == self.video_token_id).int()
        grid = image_grid_thw if image_grid_thw is not None and len(image_grid_thw) else None
        positions, _ = self._fn(self._self, ids, mm_token_type_ids=types, image_grid_thw=grid)
        return positions[:, 0]


def image_only(processor_class: type) -> type:
    """``processor_class`` without its video processor (which needs torchvision): images and text only.

    ``ProcessorMixin`` takes its sub-processors from the ``__init__`` signature, so a subclass whose
    signature has no video processor is built and called exactly like the original for images.
    """

    class ImageOnly(processor_class):
        def __init__(self, image_processor: Any = None, tokenizer: Any = None, **kwargs: Any) -> None:
            super().__init__(image_processor, tokenizer, **kwargs)

    ImageOnly.__name__ = processor_class.__name__
    ImageOnly.__qualname__ = processor_class.__qualname__
    return ImageOnly


def load_processor(name_or_path: str | Path) -> Any:
    """The model's processor from a local folder, with PIL image processing (no torchvision needed).

    ``AutoProcessor`` is used as is when it loads; when only the video processor is missing (no
    torchvision, or none saved), the same processor class is built without it (padless trains on images).
    """
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    from padless import tiny

    if str(name_or_path) in tiny.TINY_MODELS:
        from padless.tiny.vlm import tiny_vlm_processor

        return tiny_vlm_processor()
    path = str(name_or_path)
    try:
        return AutoProcessor.from_pretrained(path, backend="pil")
    except (ImportError, OSError) as e:  # no torchvision, or a folder saved without a video processor
        if not {"torchvision", "video"} & set(re.findall(r"[a-z]+", str(e).lower())):
            raise
    import transformers

    config_file = Path(path) / "processor_config.json"
    cls_name = json.loads(config_file.read_text()).get("processor_class") if config_file.exists() else None
    if cls_name is None or not hasattr(transformers, cls_name):
        raise ValueError(
            f"{path}: AutoProcessor needs torchvision for this model's video processor and the folder names "
            "no processor_class in processor_config.json to build an image-only one; install torchvision or "
            "add processor_config.json"
        )
    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = AutoImageProcessor.from_pretrained(path, backend="pil")
    return image_only(getattr(transformers, cls_name))(
        image_processor, tokenizer, chat_template=tokenizer.chat_template
    )


def concat_vision(parts: Sequence[dict[str, torch.Tensor] | None]) -> dict[str, torch.Tensor] | None:
    """Concatenate per-sample vision kwargs (``pixel_values``, ``image_grid_thw``, ...) in sample order."""
    present = [p for p in parts if p]
    if not present:
        return None
    keys = set(present[0])
    for p in present[1:]:
        if set(p) != keys:
            raise ValueError(f"samples carry different vision inputs: {sorted(keys)} vs {sorted(p)}")
    return {k: torch.cat([p[k] for p in present]) for k in sorted(keys)}


def auto_class(path: str, task: str) -> type | None:
    """The Auto class of a vision-language folder (AutoModelForCausalLM refuses VLM configs), else None."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(path)
    if not is_vision_config(config):
        return None
    if task != "causal-lm":
        raise ValueError(
            f"{path} is a vision-language model ({type(config).__name__}); padless scores with VLMs through "
            "their language-model head only: use it as a policy (task causal-lm)"
        )
    return AutoModelForImageTextToText
