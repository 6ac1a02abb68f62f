"""Image+text rows (padless.data.images): every convention gives the same example, bad images stop with
file, row and fix, truncation never splits an image, and SFT / DPO / RM / RL rows all carry their images."""

from __future__ import annotations

import io
import json

import datasets
import pytest
import torch
from PIL import Image

from padless.data import (
    DataError,
    load_rows,
    tokenize_preference,
    tokenize_prompts,
    tokenize_scoring,
    tokenize_sft,
)
from padless.data.images import ImageInputs
from padless.data.sources import load_processor
from padless.tiny import tiny_config, tiny_tokenizer
from padless.tiny.vlm import IMAGE_TOKEN_ID

QUESTION = "What colour is it?"


@pytest.fixture(scope="module")
def inputs() -> ImageInputs:
    return ImageInputs(load_processor("tiny-qwen2.5-vl"), tiny_config("tiny-qwen2.5-vl"))


def _png(colour: str, size: tuple[int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "red.png").write_bytes(_png("red", (56, 84)))
    (tmp_path / "img" / "blue.png").write_bytes(_png("blue", (112, 56)))
    (tmp_path / "img" / "broken.png").write_bytes(b"not an image")
    return tmp_path


def _write(folder, rows) -> str:
    path = folder / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _sft(inputs, spec, **kwargs):
    return tokenize_sft(
        load_rows(spec), inputs.tokenizer, max_length=kwargs.pop("max_length", 200), images=inputs, **kwargs
    )


def _conversation(user_content):
    return [{"role": "user", "content": user_content}, {"role": "assistant", "content": "Red, then blue."}]


PARTS = [{"type": "image"}, {"type": "text", "text": QUESTION}, {"type": "image"}]
CONVENTIONS = {
    "parts + images column": {"messages": _conversation(PARTS), "images": ["img/red.png", "img/blue.png"]},
    "<image> + images column": {
        "messages": _conversation(f"<image>{QUESTION}<image>"),
        "images": ["img/red.png", "img/blue.png"],
    },
    "inline paths": {
        "messages": _conversation(
            [{"type": "image", "image": "img/red.png"}, PARTS[1], {"type": "image", "path": "img/blue.png"}]
        )
    },
}


def test_every_convention_gives_the_same_example(inputs, folder):
    got = {}
    for name, row in CONVENTIONS.items():
        (ex,), _ = _sft(inputs, _write(folder, [row]))
        got[name] = ex
    want = got.pop("parts + images column")
    assert want.vision["image_grid_thw"].tolist() == [[1, 6, 4], [1, 4, 8]]
    assert want.input_ids.count(IMAGE_TOKEN_ID) == 6 + 8  # merged 2x2 patches per image
    assert want.loss_mask[want.input_ids.index(IMAGE_TOKEN_ID)] is False
    assert inputs.tokenizer.decode([t for t, m in zip(want.input_ids, want.loss_mask, strict=True) if m]) == (
        "Red, then blue.<|im_end|>"
    )
    for name, ex in got.items():
        assert ex.input_ids == want.input_ids, name
        assert torch.equal(ex.vision["pixel_values"], want.vision["pixel_values"]), name
        assert torch.equal(ex.rope_positions, want.rope_positions), name


def test_bytes_and_datasets_image_column(inputs, folder):
    (want,), _ = _sft(inputs, _write(folder, [CONVENTIONS["parts + images column"]]))
    red, blue = ((folder / "img" / f"{c}.png").read_bytes() for c in ("red", "blue"))
    features = datasets.Features(
        {
            "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
            "images": datasets.List(datasets.Image()),
        }
    )
    ds = datasets.Dataset.from_dict(
        {
            "messages": [_conversation(f"<image>{QUESTION}<image>")],
            "images": [[{"bytes": red, "path": None}, {"bytes": blue, "path": None}]],
        },
        features=features,
    )
    (from_ds,), _ = tokenize_sft(load_rows(ds), inputs.tokenizer, max_length=200, images=inputs)
    assert from_ds.input_ids == want.input_ids
    assert torch.equal(from_ds.vision["pixel_values"], want.vision["pixel_values"])


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"messages": _conversation(PARTS), "images": ["img/red.png", "img/missing.png"]},
            r"data.jsonl row 1 \(line 1\): field 'images\[1\]' names an image file that does not exist: "
            r".*img/missing.png\. Fix the path",
        ),
        (
            {"messages": _conversation(PARTS), "images": ["img/red.png", "img/broken.png"]},
            r"row 1 \(line 1\): field 'images\[1\]' cannot be read as an image .* Replace it",
        ),
        (
            {"messages": _conversation(PARTS), "images": ["img/red.png"]},
            r"field 'messages\[0\].content' has image placeholder number 2 but the row's images column "
            "holds 1",
        ),
        (
            {"messages": _conversation(f"<image>{QUESTION}"), "images": ["img/red.png", "img/blue.png"]},
            r"field 'images' holds 2 image\(s\) but the conversation has 1 image placeholder",
        ),
        (
            {"messages": _conversation([{"type": "image", "image": "https://x.org/a.png"}])},
            r"is a URL \(https://x.org/a.png\); padless never downloads",
        ),
    ],
)
def test_bad_images_stop_with_file_row_and_fix(inputs, folder, row, message):
    with pytest.raises(DataError, match=message):
        _sft(inputs, _write(folder, [row]))


def test_bad_image_rows_can_be_skipped_and_are_counted(inputs, folder):
    rows = [CONVENTIONS["inline paths"], {"messages": _conversation(PARTS), "images": ["img/broken.png"] * 2}]
    examples, stats = _sft(inputs, _write(folder, rows), skip_bad_rows=True)
    assert len(examples) == 1
    assert stats.reasons == {"unreadable image": 1}


def test_images_on_a_text_only_model_are_refused(folder):
    spec = _write(folder, [CONVENTIONS["parts + images column"]])
    with pytest.raises(
        DataError, match=r"row 1 \(line 1\): has images, but the model reads text only.*tiny-qwen2.5-vl"
    ):
        tokenize_sft(load_rows(spec), tiny_tokenizer(), max_length=200)


def test_truncation_never_cuts_an_image(inputs, folder):
    turns = [*_conversation(PARTS), *_conversation(PARTS)]  # targets in the first turn survive the cut
    spec = _write(folder, [{"messages": turns, "images": ["img/red.png", "img/blue.png"] * 2}])
    (full,), _ = _sft(inputs, spec)
    starts = [i for i, t in enumerate(full.input_ids) if t == IMAGE_TOKEN_ID and full.input_ids[i - 1] != t]
    cut_inside_third = starts[2] + 3
    (cut,), _ = _sft(inputs, spec, max_length=cut_inside_third, truncation="truncate")
    assert cut.input_ids == full.input_ids[: starts[2]]  # the cut moved to before the third image
    assert cut.vision["image_grid_thw"].tolist() == full.vision["image_grid_thw"][:2].tolist()
    rows = int(full.vision["image_grid_thw"][:2].prod(-1).sum())
    assert torch.equal(cut.vision["pixel_values"], full.vision["pixel_values"][:rows])
    assert cut.rope_positions.shape == (3, len(cut))


def test_text_only_rows_on_an_mrope_model_get_position_rows(inputs):
    rows = load_rows("tiny:sft")[:3]
    examples, _ = tokenize_sft(rows, inputs.tokenizer, max_length=2048, images=inputs)
    for ex in examples:
        assert ex.vision is None
        assert torch.equal(ex.rope_positions, torch.arange(len(ex)).expand(3, -1))


def test_preference_sides_share_the_prompt_images(inputs):
    pairs, _ = tokenize_preference(
        load_rows("tiny:shapes_preference")[:4], inputs.tokenizer, max_length=100, images=inputs
    )
    for pair in pairs:
        c, r = pair.chosen, pair.rejected
        assert c.vision is not None and r.vision is not None
        assert torch.equal(c.vision["pixel_values"], r.vision["pixel_values"])
        k = pair.prompt_length
        assert c.input_ids[:k] == r.input_ids[:k] and IMAGE_TOKEN_ID in c.input_ids[:k]
        assert IMAGE_TOKEN_ID not in c.input_ids[k:] + r.input_ids[k:]
        assert torch.equal(c.rope_positions[:, :k], r.rope_positions[:, :k])


def test_scoring_and_rl_prompts_carry_images(inputs):
    rows = load_rows("tiny:shapes_rl")[:3]
    prompts, _ = tokenize_prompts(rows, inputs.tokenizer, max_prompt_length=64, images=inputs)
    for p in prompts:
        assert p.prompt_ids.count(IMAGE_TOKEN_ID) == int(p.vision["image_grid_thw"].prod() // 4)
        assert set(p.fields) == {"kind", "answer"}  # the images column is consumed, not a reward input
    scoring = [
        type(r)({**r.data, "response": [{"role": "assistant", "content": "It is red."}]}, r.source, r.index)
        for r in rows
    ]
    examples, _ = tokenize_scoring(scoring, inputs.tokenizer, max_length=100, images=inputs)
    assert all(ex.vision is not None and ex.loss_mask is None for ex in examples)


def test_per_turn_examples_carry_the_images_their_context_shows(inputs, folder):
    """data.per_turn on an image chat: each turn's example holds the images of the messages up to it, and
    the last turn's example is the whole row's."""
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this one?"}]},
        {"role": "assistant", "content": "Blue."},
    ]
    spec = _write(folder, [{"messages": messages, "images": ["img/red.png", "img/blue.png"]}])
    (whole,), _ = _sft(inputs, spec)
    first, second = _sft(inputs, spec, per_turn=True)[0]
    assert first.vision["image_grid_thw"].tolist() == [[1, 6, 4]]
    assert second.vision["image_grid_thw"].tolist() == whole.vision["image_grid_thw"].tolist()
    assert second.input_ids == whole.input_ids and torch.equal(second.rope_positions, whole.rope_positions)
    assert first.input_ids == whole.input_ids[: len(first.input_ids)]
    for ex, answer in ((first, "Red."), (second, "Blue.")):
        trained = [t for t, m in zip(ex.input_ids, ex.loss_mask, strict=True) if m]
        assert inputs.tokenizer.decode(trained) == f"{answer}<|im_end|>"


def test_an_image_too_large_to_decode_names_its_file_row_and_fix(inputs, folder, monkeypatch):
    """PIL refuses to decode more than twice ``MAX_IMAGE_PIXELS`` (a 20000 x 20000 image at its default of
    about 89 M): the row, the field, the file and the fix are named (the limit is lowered here so that a
    small file is "too large")."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 56 * 84 // 4)
    row = {"messages": _conversation(PARTS), "images": ["img/red.png", "img/blue.png"]}
    with pytest.raises(DataError) as info:
        _sft(inputs, _write(folder, [row]))
    message = str(info.value)
    assert (
        f"{folder}/data.jsonl row 1 (line 1): field 'images[0]' is too large to decode (img/red.png)"
        in message
    )
    assert "decompression bomb" in message and "Downscale the image" in message
