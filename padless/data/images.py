"""Image+text rows for vision-language models: images found, loaded, checked and turned into model inputs.

Two conventions are accepted, and may be mixed:

* message contents that are lists of parts, ``{"type": "image"}`` / ``{"type": "text", "text": ...}``; an
  image part either holds its image (``"image"``, ``"path"`` or ``"url"`` key) or takes the next one from the
  row's ``images`` column (or ``image`` for a single one);
* string contents with ``<image>`` placeholders, filled in order from the ``images`` column.

An image is a path (relative to the data file's folder), raw bytes, a ``{"bytes", "path"}`` dict (what a
``datasets`` Image column holds) or a PIL image. Rows are rendered by the chat template with one image
placeholder token per image; :meth:`ImageInputs.expand` then asks the model's processor for the pixel values
and the number of tokens each image takes, and expands the placeholders in token space, so loss masks from
the template stay aligned. Every count is checked; a missing or unreadable image, or a mismatch, stops with
the file, row and fix: an image is never dropped silently.
"""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from padless.data.records import CHAT_FIELDS, PLACEHOLDER, Row, image_column
from padless.forward.packing import Example

if TYPE_CHECKING:
    from PIL.Image import Image

INLINE_KEYS = ("image", "path", "url")


def _base_dir(row: Row) -> Path:
    path = Path(row.source)
    return path.parent if path.is_file() else Path.cwd()


def to_rgb(image: Image, row: Row, field: str) -> Image:
    """``image`` as 8-bit RGB with what it shows kept: 16- and 32-bit greyscale scaled to 8 bits (Pillow's
    own conversion clips them, so a 16-bit scan turns white), palette and alpha images composited on white
    (as a viewer shows them); an animation or a floating-point image is refused (which frame? which
    scale?)."""
    import numpy as np
    from PIL import Image as PILImage

    frames = getattr(image, "n_frames", 1)
    if frames > 1:
        raise row.error(
            field,
            f"is an animation ({frames} frames); a model reads one still image",
            reason="animated image",
            fix="Save the frame to train on as a PNG or JPEG, or set data.skip_bad_rows: true to skip it.",
        )
    if image.mode == "F":
        raise row.error(
            field,
            "is a floating-point image (mode F): its scale to 8-bit colour is not defined",
            reason="bad image",
            fix="Save it as an 8- or 16-bit PNG, or set data.skip_bad_rows: true to skip the row.",
        )
    if image.mode.startswith("I"):  # I;16, I;16B, I (a 16-bit PNG opens as I;16, or I in older Pillow)
        levels = np.asarray(image, dtype=np.float64)
        if image.mode.startswith("I;16") or levels.max(initial=0) > 255:
            levels = levels / 257.0
        image = PILImage.fromarray(np.clip(np.rint(levels), 0, 255).astype(np.uint8), mode="L")
    if image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    if image.mode in ("RGBA", "LA", "PA", "La", "RGBa"):
        rgba = image.convert("RGBA")
        background = PILImage.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PILImage.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def load_image(row: Row, field: str, value: Any) -> Image:
    """A PIL image (RGB) from a path, bytes, a ``{"bytes", "path"}`` dict or a PIL image."""
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    if isinstance(value, PILImage.Image):
        return to_rgb(value, row, field)
    data, path = None, None
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
    elif isinstance(value, (bytes, bytearray)):
        data = bytes(value)
    elif isinstance(value, str):
        path = value
    else:
        raise row.error(
            field,
            "must be an image path, bytes, a {'bytes', 'path'} dict or a PIL image, "
            f"got {type(value).__name__}",
            reason="bad image",
        )
    if data is None:
        if not path:
            raise row.error(field, "is an image dict with neither 'bytes' nor 'path'", reason="bad image")
        if re.match(r"^[a-z]+://", path):
            raise row.error(
                field,
                f"is a URL ({path}); padless never downloads during training",
                reason="bad image",
                fix="Download the images and give local paths (relative to the data file).",
            )
        file = Path(path).expanduser()
        file = file if file.is_absolute() else _base_dir(row) / file
        if not file.is_file():
            raise row.error(
                field,
                f"names an image file that does not exist: {file}",
                reason="missing image",
                fix="Fix the path (relative paths start at the data file's folder), or set "
                "data.skip_bad_rows: true to skip the row.",
            )
        data = file.read_bytes()
    try:
        with PILImage.open(io.BytesIO(data)) as image:
            return to_rgb(image, row, field)
    except PILImage.DecompressionBombError as e:  # more pixels than PIL decodes (a "decompression bomb")
        raise row.error(
            field,
            f"is too large to decode{f' ({path})' if path else ''}: {e}",
            reason="image too large",
            fix="Downscale the image (PIL decodes at most about 179 million pixels), or set "
            "data.skip_bad_rows: true to skip the row.",
        ) from None
    except (UnidentifiedImageError, OSError) as e:
        raise row.error(
            field,
            f"cannot be read as an image ({type(e).__name__}: {e})",
            reason="unreadable image",
            fix="Replace it with a PNG/JPEG/WebP image, or set data.skip_bad_rows: true to skip the row.",
        ) from None


@dataclass
class ImageRow:
    """A row with its chat fields in list-of-parts form (one ``{"type": "image"}`` per image, in order)."""

    row: Row
    images: list[Image]


class ImageInputs:
    """What a vision-language model needs from the data: its processor and, for M-RoPE, its rope index."""

    def __init__(self, processor: Any, config: Any) -> None:
        from padless.forward.vision import RopeIndex, uses_mrope

        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.image_token = processor.image_token
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        self.rope = RopeIndex(config) if uses_mrope(config) else None

    def prompt_rows(self, rows: Sequence[Row]) -> list[Row]:
        """Generation prompts of chat rows, as prompt rows (:func:`padless.data.prompts.tokenize_prompts`
        reads them): each conversation up to its last assistant turn, with the images of the turns kept."""
        cut = []
        for row in rows:
            prepared = self.prepare(row)
            messages = prepared.row.data["messages"]
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            pictures = iter(prepared.images)  # back inline, in order: the prompt keeps its own images only
            prompt = [
                {
                    **m,
                    "content": [
                        {**p, "image": next(pictures)} if p["type"] == "image" else p for p in m["content"]
                    ],
                }
                if isinstance(m["content"], list)
                else m
                for m in messages[:last]
            ]
            cut.append(replace(row, data={"prompt": prompt}))
        return cut

    # -- rows ------------------------------------------------------------------------------------------------

    def prepare(self, row: Row) -> ImageRow:
        """Normalise the chat fields to parts, load every image, and check that the counts match."""
        column, pool = image_column(row)
        taken = 0
        images: list[Image] = []
        data = dict(row.data)
        for name in CHAT_FIELDS:
            value = data.get(name)
            if not isinstance(value, list):
                if isinstance(value, str) and PLACEHOLDER in value:
                    raise row.error(
                        name,
                        f"is a plain string with {PLACEHOLDER} placeholders; images go in conversations",
                        reason="bad image",
                        fix=f"Give '{name}' as a list of messages (e.g. "
                        f'[{{"role": "user", "content": "{PLACEHOLDER}What is shown?"}}]).',
                    )
                continue
            messages = []
            for j, msg in enumerate(value):
                if not isinstance(msg, dict):
                    messages.append(msg)
                    continue
                parts, taken = self._parts(
                    row, f"{name}[{j}].content", msg.get("content"), pool, taken, images
                )
                messages.append({**msg, "content": parts})
            data[name] = messages
        if taken != len(pool):
            raise row.error(
                column,
                f"holds {len(pool)} image(s) but the conversation has {taken} image placeholder(s) "
                f"({PLACEHOLDER} or {{'type': 'image'}} parts without an image of their own)",
                reason="image count mismatch",
                fix="Make the placeholders and the images match one to one, or set data.skip_bad_rows: true "
                "to skip the row.",
            )
        data.pop(column, None)
        return ImageRow(replace(row, data=data), images)

    def _parts(
        self, row: Row, where: str, content: Any, pool: list[Any], taken: int, images: list[Image]
    ) -> tuple[Any, int]:
        """Content as parts; image parts lose their payload (loaded into ``images``)."""
        if isinstance(content, str):
            if PLACEHOLDER not in content:
                return content, taken
            pieces = content.split(PLACEHOLDER)
            parts: list[dict[str, Any]] = []
            for k, piece in enumerate(pieces):
                if k:
                    taken = self._take(row, where, pool, taken, images)
                    parts.append({"type": "image"})
                if piece:
                    parts.append({"type": "text", "text": piece})
            return parts, taken
        if not isinstance(content, list):
            return content, taken
        parts = []
        for k, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "thinking":  # reasoning: the template's text
                parts.append(part)
                continue
            if not isinstance(part, dict) or part.get("type") not in ("image", "text"):
                got = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise row.error(
                    f"{where}[{k}]",
                    f"must be a {{'type': 'image'}} or {{'type': 'text', 'text': ...}} part, got {got!r}",
                    reason="wrong type",
                )
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise row.error(f"{where}[{k}].text", "must be a string", reason="wrong type")
                parts.append({"type": "text", "text": part["text"]})
                continue
            inline = next((part[key] for key in INLINE_KEYS if part.get(key) is not None), None)
            if inline is None:
                taken = self._take(row, where, pool, taken, images)
            else:
                images.append(load_image(row, f"{where}[{k}]", inline))
            parts.append({"type": "image"})
        return parts, taken

    @staticmethod
    def _take(row: Row, where: str, pool: list[Any], taken: int, images: list[Image]) -> int:
        if taken >= len(pool):
            raise row.error(
                where,
                f"has image placeholder number {taken + 1} but the row's images column holds {len(pool)}",
                reason="image count mismatch",
                fix="Add the missing image to 'images' (in order of appearance), or set data.skip_bad_rows: "
                "true to skip the row.",
            )
        images.append(load_image(row, f"images[{taken}]", pool[taken]))
        return taken + 1

    # -- tokens ----------------------------------------------------------------------------------------------

    def expand(
        self, row: Row, ids: list[int], mask: list[bool] | None, images: Sequence[Image]
    ) -> tuple[list[int], list[bool] | None, dict[str, torch.Tensor] | None]:
        """Replace each image's placeholder token by its run of image tokens; return the vision inputs."""
        found = sum(t == self.image_token_id for t in ids)
        if found != len(images):
            raise row.error(
                None,
                f"renders {found} image token(s) for {len(images)} image(s): the chat template must emit "
                f"{self.image_token!r} once per image part",
                reason="image count mismatch",
                fix="Use the model's own chat template (it handles list contents), or set "
                "data.skip_bad_rows: true to skip the row.",
            )
        if not images:
            return ids, mask, None
        vision = self.inputs(images)
        sizes = [(image.height, image.width) for image in images]
        counts = self.processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]
        new_ids: list[int] = []
        new_mask: list[bool] = []
        k = 0
        for i, t in enumerate(ids):
            n = 1
            if t == self.image_token_id:
                n, k = counts[k], k + 1
            new_ids += [t] * n
            new_mask += [bool(mask[i]) if mask is not None and n == 1 else False] * n
        return new_ids, None if mask is None else new_mask, vision

    def inputs(self, images: Sequence[Image]) -> dict[str, torch.Tensor]:
        """The model's image inputs (pixel values, grids) of ``images``, in order."""
        out = self.processor.image_processor(images=list(images), return_tensors="pt")
        return {key: out[key] for key in ("pixel_values", "image_grid_thw") if key in out}

    def fit(
        self,
        row: Row,
        ids: list[int],
        mask: list[bool] | None,
        vision: dict[str, torch.Tensor] | None,
        max_length: int,
    ) -> tuple[list[int], list[bool] | None, dict[str, torch.Tensor] | None]:
        """Cut to ``max_length`` tokens, never inside an image: an image that does not fit whole goes, with
        its pixels, and the cut moves to before its tokens."""
        if len(ids) <= max_length:
            return ids, mask, vision
        cut = max_length
        runs = self._runs(ids)
        kept = [r for r in runs if r[1] <= cut]
        if len(kept) < len(runs):
            cut = min(cut, runs[len(kept)][0])
            if vision is not None and "image_grid_thw" not in vision:
                raise row.error(
                    None,
                    f"is {len(ids)} tokens, more than max_length={max_length}, and cutting it would drop an "
                    "image this model's inputs cannot be split for",
                    reason="too long",
                    fix="Raise data.max_length, or set data.skip_bad_rows: true to skip the row.",
                )
            if vision is not None:
                grid = vision["image_grid_thw"][: len(kept)]
                rows = int(grid.prod(-1).sum())
                vision = (
                    {"pixel_values": vision["pixel_values"][:rows], "image_grid_thw": grid} if kept else None
                )
        return ids[:cut], None if mask is None else mask[:cut], vision

    def _runs(self, ids: list[int]) -> list[tuple[int, int]]:
        """``(start, end)`` of each image's token run."""
        runs: list[tuple[int, int]] = []
        for i, t in enumerate(ids):
            if t != self.image_token_id:
                continue
            if runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
        return runs

    def example(
        self,
        ids: list[int],
        mask: list[bool] | None,
        vision: dict[str, torch.Tensor] | None,
        meta: dict[str, Any],
    ) -> Example:
        """An example with its vision inputs and, for M-RoPE models, its own position rows."""
        rope = None
        if self.rope is not None:
            rope = self.rope(ids, None if vision is None else vision.get("image_grid_thw"))
        return Example(ids, mask, meta, vision=vision, rope_positions=rope)


def png_text(image: Image) -> str:
    """An image as base64 PNG text (lossless for the 8-bit RGB images padless reads), to save in JSON."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def from_png_text(text: str) -> Image:
    """The image :func:`png_text` saved."""
    from PIL import Image as PILImage

    with PILImage.open(io.BytesIO(base64.b64decode(text))) as image:
        return image.convert("RGB")
