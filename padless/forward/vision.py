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

Reward and value models of a VLM are the VLM with padless's ``score`` head (:func:`add_score_head`):
transformers has no sequence-classification class for these models.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from padless.forward.engine import unwrap

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def is_vision_config(config: Any) -> bool:
    """Whether a model config describes a vision-language model (it has a vision tower config)."""
    return getattr(config, "vision_config", None) is not None


def _base_model_class(config: Any) -> type | None:
    """The base model class transformers maps ``config`` to (``None``: it maps none, e.g. ShieldGemma 2)."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    return MODEL_MAPPING.get(type(config), None)


def uses_mrope(config: Any) -> bool:
    """Whether the model positions tokens with M-RoPE (its base model has ``get_rope_index``)."""
    return is_vision_config(config) and hasattr(_base_model_class(config), "get_rope_index")


def placeholder_ids(config: Any) -> tuple[int, ...]:
    """The image / video placeholder token ids of a vision-language config (none for a text model)."""
    ids = (getattr(config, "image_token_id", None), getattr(config, "video_token_id", None))
    return tuple(i for i in ids if i is not None)


def image_token_types(ids: torch.Tensor, config: Any) -> torch.Tensor:
    """transformers' ``mm_token_type_ids`` for inputs with images and no video: 1 at image placeholders."""
    return (ids == config.image_token_id).int()


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


def load_image_text_model(path: str | Path, task: str, **kwargs: Any) -> PreTrainedModel:
    """A vision-language model from ``path`` (``AutoModelForCausalLM`` refuses their configs), with its
    ``score`` head for task ``"score"`` (see :func:`add_score_head`)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(str(path), trust_remote_code=kwargs.get("trust_remote_code", False))
    cls = AutoModelForImageTextToText._model_mapping[type(config)]
    if task != "score":
        return cls.from_pretrained(str(path), **kwargs)
    # the head is read by add_score_head: transformers must not report its weight as unexpected
    ignored = cls.__dict__.get("_keys_to_ignore_on_load_unexpected")
    cls._keys_to_ignore_on_load_unexpected = [*(ignored or []), rf"^{re.escape(SCORE_KEY)}$"]
    try:
        model = cls.from_pretrained(str(path), **kwargs)
    finally:
        if ignored is None:
            del cls._keys_to_ignore_on_load_unexpected
        else:
            cls._keys_to_ignore_on_load_unexpected = ignored
    return add_score_head(model, path)


# A vision-language reward / value model is the VLM with a ``score`` head: transformers has no
# sequence-classification class for these models. The flag in its config says the saved weights hold one.
SCORE_FLAG = "padless_score_head"
SCORE_KEY = "score.weight"


def add_score_head(model: PreTrainedModel, path: str | Path | None = None) -> PreTrainedModel:
    """Give a vision-language model a scalar head: ``model.score``, a ``Linear(hidden, 1)`` that
    :func:`padless.forward.engine.score_head` finds, applied to the language model's last hidden states.

    The head is read back from ``path`` when its config says it was saved with one (``save_pretrained`` writes
    ``score.weight`` beside the VLM's weights), else initialised like transformers' sequence classifiers'
    (normal, ``initializer_range``). The LM head is then never used: frozen when it is not tied to the input
    embeddings, so data-parallel wrappers see no parameter without a gradient.
    """
    config, text = model.config, model.config.get_text_config()
    reference = model.get_input_embeddings().weight
    head = torch.nn.Linear(text.hidden_size, 1, bias=False, dtype=reference.dtype, device=reference.device)
    saved = _saved_score_weight(path) if path is not None and getattr(config, SCORE_FLAG, False) else None
    with torch.no_grad():
        if saved is None:
            head.weight.normal_(0.0, getattr(text, "initializer_range", 0.02))
        else:
            head.weight.copy_(saved)
    model.score = head
    setattr(config, SCORE_FLAG, True)
    for key in ("pad_token_id", "eos_token_id"):  # where scores are read (VLM configs keep them per part)
        if getattr(config, key, None) is None:
            setattr(config, key, getattr(text, key, None))
    lm_head = model.get_output_embeddings()
    if lm_head is not None and lm_head.weight is not reference:
        lm_head.requires_grad_(False)
    return model


def _saved_score_weight(path: str | Path) -> torch.Tensor:
    from safetensors import safe_open

    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            if SCORE_KEY in f.keys():  # noqa: SIM118 (safe_open has keys(), not __contains__)
                return f.get_tensor(SCORE_KEY)
    raise ValueError(
        f"{path}: config.json says {SCORE_FLAG} but no *.safetensors file holds {SCORE_KEY}; the folder "
        f"is incomplete: save it again, or remove {SCORE_FLAG} from config.json to start a fresh head"
    )


def require_same_inputs(policy: torch.nn.Module, other: torch.nn.Module, role: str) -> None:
    """A reward or value model reads the policy's samples as they are: images (and M-RoPE positions) for a
    vision-language policy, text for a text one, and token ids its embeddings must cover. A mismatch would
    drop the images, misplace tokens or index past the embeddings."""

    want, got = is_vision_config(unwrap(policy).config), is_vision_config(unwrap(other).config)
    if want != got:
        kind = {True: "a vision-language model", False: "a text-only model"}
        raise ValueError(
            f"{role} is {kind[got]} but the policy is {kind[want]}: it would read the policy's samples "
            f"without their {'images' if want else 'text positions'}; use {kind[want]} there too"
        )
    need = unwrap(policy).get_input_embeddings().num_embeddings
    have = unwrap(other).get_input_embeddings().num_embeddings
    if have < need:
        raise ValueError(
            f"{role} embeds {have} token ids, but the policy's vocabulary has {need}: it reads the policy's "
            "token ids as they are, and a higher one would index past its embeddings; use a model built on "
            "the policy's tokenizer there"
        )


def model_keys(model: torch.nn.Module, weights: dict[str, Any]) -> dict[str, Any]:
    """Weights as ``save_pretrained`` wrote them, under the model's own parameter names.

    transformers saves vision-language models under their original checkpoint names (``model.*`` for what
    the module calls ``model.language_model.*``, ``visual.*`` for ``model.visual.*``) and renames them back
    when loading; a checkpoint read back into a live model needs the same renaming.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    return {rename_source_key(key, renamings, [])[0]: value for key, value in weights.items()}
