"""The invariance matrix over image+text sequences, for ``padless check --model <vision-language model>``.

The probe is a handful of chats about drawn shapes, rendered by the model's own processor: images of three
sizes, one chat with two images, and a text-only chat mixed in. The reference ("alone") is transformers
itself: each chat run by itself with no position ids, so the model computes its own (M-RoPE) positions.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import torch
from transformers import PreTrainedModel

from padless.data import Row, tokenize_sft
from padless.data.images import ImageInputs
from padless.forward.engine import forward_packed
from padless.forward.packing import Example, pack
from padless.forward.vision import image_token_types, uses_mrope
from padless.proof.check import Alone, next_token_logps, padded_logps
from padless.tiny.shapes import QUESTIONS, answer, draw

SOURCE = "padless check probe"


def probe_examples(model: PreTrainedModel, processor: Any) -> list[Example]:
    """Image+text chats of different lengths and image sizes, and a text-only one, tokenized for ``model``."""
    rng = random.Random(0)
    rows = []
    for n_images in (1, 2, 0, 1):
        drawn = [draw(rng) for _ in range(n_images)]
        kind = rng.choice(list(QUESTIONS))
        parts = [{"type": "image"} for _ in drawn] + [{"type": "text", "text": rng.choice(QUESTIONS[kind])}]
        reply = " ".join(answer(kind, facts) for _, facts in drawn) or "There is no picture to look at."
        messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": reply}]
        rows.append(Row({"messages": messages, "images": [png for png, _ in drawn]}, SOURCE, len(rows)))
    examples, _ = tokenize_sft(
        rows, processor.tokenizer, max_length=1 << 16, images=ImageInputs(processor, model.config)
    )
    return [replace(ex, loss_mask=None) for ex in examples]  # every token is compared, not only targets


def alone_logps(model: PreTrainedModel, examples: list[Example]) -> Alone:
    """Each chat run alone through transformers' own forward: no position ids, so the model computes its
    (M-RoPE) positions itself; also the sizes the tolerance bound scales with."""
    device = next(model.parameters()).device
    result = Alone([], 0.0, 0.0)
    for ex in examples:
        ids = torch.tensor(ex.input_ids, device=device)[None]
        extra = {k: v.to(device) for k, v in (ex.vision or {}).items()}
        if uses_mrope(model.config):
            extra["mm_token_type_ids"] = image_token_types(ids, model.config)
        logits = model(input_ids=ids, use_cache=False, **extra).logits[0]
        logps = next_token_logps(logits, ids[0])
        result.logps.append(logps)
        result.max_logit = max(result.max_logit, logits[:-1].float().abs().max().item())
        result.max_logp = max(result.max_logp, logps.abs().max().item())
    return result


def layout_logps(
    model: PreTrainedModel, examples: list[Example], layout: str, pad_id: int
) -> list[torch.Tensor]:
    """Per-sequence next-token log-probs ``[L_i - 1]`` of image+text ``examples`` computed in ``layout``."""
    device = next(model.parameters()).device
    batch = pack(examples, device=device)
    if layout == "packed":
        return [t[:-1] for t in batch.split(forward_packed(model, batch).logps)]
    if layout == "alone":
        return alone_logps(model, examples).logps
    return padded_logps(model, batch, layout, pad_id)
