"""Vision-language models packed (padless.forward.vision + the packed path): per-token invariance on tiny
Qwen2-VL, Qwen2.5-VL and Qwen3-VL built in code, with images of different sizes and text-only rows mixed; an
InternVL (1-D RoPE) on the ordinary packed path; the VLM score head of reward and value models.

The reference is transformers itself: each sample run alone through ``model(...)`` with no position ids, so
the model computes its own M-RoPE positions. Weights are scaled up from the tiny init so that a leak or a
wrong position moves log-probs by far more than fp32 round-off (a random tiny model is nearly flat).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, Qwen2VLConfig, Qwen3VLConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import padless.forward.attention as attention
import padless.forward.varlen as varlen
from padless.data.sources import load_processor
from padless.forward.engine import forward_packed, forward_padded, forward_scores, score_head
from padless.forward.packing import Example, concat_vision, pack, to_padded, unpad
from padless.forward.vision import (
    RopeIndex,
    add_score_head,
    is_vision_config,
    uses_mrope,
)
from padless.proof.load import load_model
from padless.tiny import PAD_TOKEN_ID
from padless.tiny.vlm import (
    IMAGE_TOKEN_ID,
    VIDEO_TOKEN_ID,
    VISION_END_ID,
    VISION_START_ID,
    VLM_VOCAB_SIZE,
    tiny_qwen2_5_vl,
)

FP32_TOL = 1e-5  # fp32 round-off of a different kernel / layout; measured 1e-6 to 3e-6
LEAK_MIN = 0.1  # measured leaks: 1.0 to 3.4
WEIGHT_SCALE = 4.0

TEXT = {
    "vocab_size": VLM_VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "pad_token_id": PAD_TOKEN_ID,
    "bos_token_id": None,
    "eos_token_id": 2,
}
TOKENS = {
    "image_token_id": IMAGE_TOKEN_ID,
    "video_token_id": VIDEO_TOKEN_ID,
    "vision_start_token_id": VISION_START_ID,
    "vision_end_token_id": VISION_END_ID,
}


def _qwen2_vl() -> Qwen2VLConfig:
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
    vision = {"depth": 2, "embed_dim": 64, "hidden_size": 128, "num_heads": 4, "mlp_ratio": 2}
    return Qwen2VLConfig(text_config={**TEXT, "rope_parameters": rope}, vision_config=vision, **TOKENS)


# The vision tower of Qwen3-VL and Qwen3.5-VL (patches of 16, merged into the text width)
QWEN3_VISION = {
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 4,
    "patch_size": 16,
    "out_hidden_size": 128,
    "num_position_embeddings": 64,
}


def _qwen3_vl() -> Qwen3VLConfig:
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [4, 6, 6],
        "mrope_interleaved": True,
    }
    vision = {**QWEN3_VISION, "deepstack_visual_indexes": [0]}
    text = {**TEXT, "head_dim": 32, "rope_parameters": rope}
    return Qwen3VLConfig(text_config=text, vision_config=vision, **TOKENS)


def _qwen3_5_vl():
    from transformers import Qwen3_5Config

    text = {
        **TEXT,
        "head_dim": 32,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        },
    }
    return Qwen3_5Config(text_config=text, vision_config=QWEN3_VISION, **TOKENS)


FAMILIES = {
    "qwen2-vl": (_qwen2_vl, 14),
    "qwen2.5-vl": (tiny_qwen2_5_vl, 14),
    "qwen3-vl": (_qwen3_vl, 16),
    "qwen3.5-vl": (_qwen3_5_vl, 16),
}
HYBRIDS = ("qwen3.5-vl",)  # their own test below; the matrix of tests over `family` runs the others


def _build(family: str, backend: str) -> torch.nn.Module:
    make_config, _ = FAMILIES[family]
    return _seeded(make_config(), backend)


def _seeded(config: Any, backend: str) -> torch.nn.Module:
    """The model of ``config`` from seed 0, its matrices scaled to realistic logit sizes, on ``backend``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(
            config, attn_implementation=attention.hf_name(backend), dtype=torch.float32
        )
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(WEIGHT_SCALE)
    model.padless_attention = backend
    return model.eval()


def _image(rng: np.random.Generator, height: int, width: int) -> Image.Image:
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _samples(family: str) -> list[tuple[list[list[int]], list[Image.Image]]]:
    """Rows as (text pieces, images): an image goes between consecutive pieces. Sizes differ per image."""
    _, patch = FAMILIES[family]
    unit = 2 * patch  # one merged token
    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(1)

    def text(n: int) -> list[int]:
        return torch.randint(3, 4096, (n,), generator=gen).tolist()

    return [
        ([text(5), text(9)], [_image(rng, 2 * unit, 2 * unit)]),
        ([text(31)], []),
        ([text(3), text(2), text(12)], [_image(rng, 3 * unit, 2 * unit), _image(rng, unit, 4 * unit)]),
        ([text(4), text(60)], [_image(rng, 4 * unit, 3 * unit)]),
        ([text(7)], []),
    ]


def _example(family: str, pieces: list[list[int]], images: list[Image.Image]) -> Example:
    """Tokens with each image's placeholder run expanded, its pixel values, and the sample's M-RoPE rows."""
    make_config, patch = FAMILIES[family]
    config = make_config()
    ids = list(pieces[0])
    vision = None
    if images:
        processor = Qwen2VLImageProcessorPil(
            patch_size=patch, merge_size=2, min_pixels=(2 * patch) ** 2, max_pixels=(8 * patch) ** 2
        )
        out = processor(images=images, return_tensors="pt")
        vision = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        for grid, piece in zip(out["image_grid_thw"], pieces[1:], strict=True):
            ids += [VISION_START_ID] + [IMAGE_TOKEN_ID] * int(grid.prod() // 4) + [VISION_END_ID] + piece
    grid = None if vision is None else vision["image_grid_thw"]
    return Example(ids, vision=vision, rope_positions=RopeIndex(config)(ids, grid))


def _alone(model: torch.nn.Module, ex: Example) -> torch.Tensor:
    """transformers' own result for one sample: no position ids given, so the model computes M-RoPE."""
    ids = torch.tensor(ex.input_ids)[None]
    types = (ids == IMAGE_TOKEN_ID).int()
    with torch.no_grad():
        logits = model(input_ids=ids, mm_token_type_ids=types, use_cache=False, **(ex.vision or {})).logits
    return logits[0, :-1].float().log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]


def _packed_logps(model: torch.nn.Module, batch) -> list[torch.Tensor]:
    with torch.no_grad():
        logps = forward_packed(model, batch).logps
    return [s[:-1] for s in batch.split(logps)]


def _unguarded_logps(model: torch.nn.Module, batch) -> list[torch.Tensor]:
    """What the model's own forward computes from ``batch``'s ids, as they are: the engine stops on ids an
    M-RoPE model cannot pack with (``ValueError``); this shows what it would have trained on."""
    from padless.forward.engine import backbone, logps_from_hidden, model_inputs

    with pytest.raises(ValueError, match=r"needs position ids \[4, 1, T\]"):
        forward_packed(model, batch)
    with torch.no_grad():
        hidden = backbone(model)(**model_inputs(batch), use_cache=False).last_hidden_state
        logps = logps_from_hidden(model, hidden[0], batch.labels[0]).logps
    return [s[:-1] for s in batch.split(logps)]


@pytest.fixture(scope="module", params=[f for f in FAMILIES if f not in HYBRIDS])
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def examples(family) -> list[Example]:
    return [_example(family, pieces, images) for pieces, images in _samples(family)]


@pytest.fixture(scope="module")
def reference(family, examples) -> list[torch.Tensor]:
    model = _build(family, "sdpa")
    return [_alone(model, ex) for ex in examples]


def _delta(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    assert [g.shape for g in got] == [w.shape for w in want]
    return max((g - w).abs().max().item() for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("backend", ["varlen", "sdpa", "eager"])
def test_packed_equals_alone(family, examples, reference, backend):
    model = _build(family, backend)
    batch = pack(examples)
    assert tuple(batch.position_ids.shape) == (4, 1, batch.num_tokens)
    assert batch.vision["image_grid_thw"].shape[0] == 4  # every sample's images, in order
    assert _delta(_packed_logps(model, batch), reference) < FP32_TOL


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("backend", ["varlen", "sdpa"])
def test_padded_equals_alone(family, examples, reference, backend, side):
    model = _build(family, backend)
    padded = to_padded(pack(examples), side, PAD_TOKEN_ID)
    assert tuple(padded.position_ids.shape) == (4, *padded.input_ids.shape)
    with torch.no_grad():
        flat = unpad(forward_padded(model, padded), padded.attention_mask)
    got = [s[:-1] for s in flat.split([len(e) for e in examples])]
    assert _delta(got, reference) < FP32_TOL


@pytest.mark.parametrize("rows", ["2d", "3 rows"])
def test_positions_without_text_row_leak(family, examples, reference, rows):
    """2D or [3, 1, T] ids give no per-sequence text row: sdpa then attends across samples (and 2D ids
    also lose the image rows). This is what makes the [4, 1, T] test above able to fail; the engine
    stops on such ids."""
    model = _build(family, "sdpa")
    batch = pack(examples)
    position_ids = batch.position_ids[0] if rows == "2d" else batch.position_ids[1:]
    leaked = _unguarded_logps(model, dataclasses.replace(batch, position_ids=position_ids))
    assert _delta(leaked, reference) > LEAK_MIN


def test_image_rows_matter_on_varlen(family, examples, reference):
    """varlen isolates samples by cu_seqlens whatever the ids, but image tokens still need M-RoPE rows."""
    model = _build(family, "varlen")
    batch = pack(examples)
    flat = _unguarded_logps(model, dataclasses.replace(batch, position_ids=batch.position_ids[0]))
    assert _delta(flat, reference) > LEAK_MIN


def _image_features(model: torch.nn.Module, vision: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model.model.get_image_features(vision["pixel_values"], vision["image_grid_thw"])
    return list(out.pooler_output)


@pytest.mark.parametrize("backend", ["varlen", "sdpa"])
def test_vision_features_packed_equal_per_image(family, examples, backend):
    model = _build(family, backend)
    packed = _image_features(model, concat_vision([ex.vision for ex in examples]))
    alone = [f for ex in examples if ex.vision for f in _image_features(model, ex.vision)]
    assert len(packed) == len(alone) == 4
    assert _delta(packed, alone) < FP32_TOL


def test_varlen_vision_is_not_causal(family, examples, monkeypatch):
    """The vision tower asks for is_causal=False: varlen must match eager, and a causal run must not."""
    vision = concat_vision([ex.vision for ex in examples])
    eager = _image_features(_build(family, "eager"), vision)
    model = _build(family, "varlen")
    assert _delta(_image_features(model, vision), eager) < FP32_TOL
    per_sequence = varlen._exact_per_sequence

    def causal(q, k, v, spans, args):
        return per_sequence(q, k, v, spans, dataclasses.replace(args, causal=True))

    monkeypatch.setattr(varlen, "_exact_per_sequence", causal)
    assert _delta(_image_features(model, vision), eager) > LEAK_MIN


def test_mixed_and_text_only_batches(family, examples, reference):
    model = _build(family, "varlen")
    text_only = [ex for ex in examples if ex.vision is None]
    batch = pack(text_only)
    assert batch.vision is None
    want = [r for ex, r in zip(examples, reference, strict=True) if ex.vision is None]
    assert _delta(_packed_logps(model, batch), want) < FP32_TOL


def test_pack_requires_rope_rows_on_every_example(family, examples):
    broken = [examples[0], dataclasses.replace(examples[1], rope_positions=None)]
    with pytest.raises(ValueError, match=r"example 1: M-RoPE positions must be \[3, 31\]"):
        pack(broken)


def test_rope_index_matches_model(family, examples):
    """RopeIndex (config only) gives the rows the loaded model's get_rope_index gives."""
    model = _build(family, "sdpa")
    for ex in examples:
        ids = torch.tensor(ex.input_ids)[None]
        grid = ex.vision["image_grid_thw"] if ex.vision else None
        want, _ = model.model.get_rope_index(ids, (ids == IMAGE_TOKEN_ID).int(), image_grid_thw=grid)
        assert torch.equal(ex.rope_positions, want[:, 0])


@pytest.mark.parametrize("backend", ["varlen", "sdpa", "eager"])
def test_embedded_vlm_loads_on_proven_backend(backend):
    """load_model's probe packs with [4, 1, T] ids on M-RoPE models (2D ids would leak on sdpa / eager)."""
    model = load_model("tiny-qwen2.5-vl", attn_implementation=backend)
    assert is_vision_config(model.config) and uses_mrope(model.config)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    processor = load_processor("tiny-qwen2.5-vl")
    assert processor.tokenizer.convert_tokens_to_ids("<|image_pad|>") == model.config.image_token_id


def test_embedded_vlm_is_seeded():
    a = load_model("tiny-qwen2.5-vl", seed=3, probe=False)
    b = load_model("tiny-qwen2.5-vl", seed=3, probe=False)
    c = load_model("tiny-qwen2.5-vl", seed=4, probe=False)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def _shape_examples(processor: Any, config: Any, n: int = 4) -> list[Example]:
    from padless.data import load_rows, tokenize_sft
    from padless.data.images import ImageInputs

    rows = load_rows("tiny:shapes_eval")[:n]
    inputs = ImageInputs(processor, config)
    examples, _ = tokenize_sft(rows, processor.tokenizer, max_length=256, images=inputs)
    return examples


def test_score_head_on_a_vlm_reads_images_and_round_trips(tmp_path):
    """A VLM reward / value model: the VLM's backbone with padless's Linear(hidden, 1) ``score`` head (found
    by score_head), scoring each token from the images too; saved as safetensors and read back exactly."""
    model = load_model("tiny-qwen2.5-vl", task="score")
    head = score_head(model)
    assert isinstance(head, torch.nn.Linear) and tuple(head.weight.shape) == (1, 128)
    assert model.config.padless_score_head and model.config.pad_token_id == PAD_TOKEN_ID
    processor = load_processor("tiny-qwen2.5-vl")
    batch = pack(_shape_examples(processor, model.config))
    with torch.no_grad():
        scores = forward_scores(model, batch)
        other = dict(batch.vision, pixel_values=batch.vision["pixel_values"].flip(0))
        moved = forward_scores(model, dataclasses.replace(batch, vision=other))
    assert scores.shape == (batch.num_tokens,)
    assert (scores - moved).abs().max() > 1e-4  # the images reach the head
    model.save_pretrained(tmp_path)
    again = load_model(str(tmp_path), task="score")
    with torch.no_grad():
        assert torch.equal(forward_scores(again, batch), scores)
    assert not hasattr(load_model(str(tmp_path)), "score")  # as a policy it is the plain VLM


def test_score_head_missing_weight_is_refused(tmp_path):
    model = load_model("tiny-qwen2.5-vl", task="score", probe=False)
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file, save_file

    weights = load_file(tmp_path / "model.safetensors")
    del weights["score.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no \*\.safetensors file holds score\.weight"):
        load_model(str(tmp_path), task="score", probe=False)


def test_untied_lm_head_is_frozen_in_a_score_model():
    """The LM head of a score model gets no gradient: frozen when untied, so DDP sees no unused parameter."""
    model = AutoModelForImageTextToText.from_config(_qwen2_vl())
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    add_score_head(model)
    assert not model.get_output_embeddings().weight.requires_grad
    assert model.score.weight.requires_grad


# InternVL-style: a ViT tower on fixed-size tiles and a 1-D-RoPE language model (Qwen2 here). It needs no
# rope index: the ordinary packed path (2D position ids restarting per sequence, cu_seqlens) holds for it.
INTERNVL_TILE = 56  # 4x4 patches of 14, pixel-shuffled to 4 image tokens per tile


def _internvl(backend: str) -> torch.nn.Module:
    from transformers import InternVLConfig

    text = {**TEXT, "model_type": "qwen2"}
    vision = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": INTERNVL_TILE,
        "patch_size": 14,
    }
    config = InternVLConfig(
        text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN_ID, image_seq_length=4
    )
    return _seeded(config, backend)


@pytest.fixture(scope="module")
def internvl_examples() -> list[Example]:
    """Rows with 1, 0, 3 and 2 tiles (a tile is InternVL's unit of image), text of different lengths."""
    gen = torch.Generator().manual_seed(2)
    out = []
    for tiles, words in ((1, 9), (0, 30), (3, 4), (2, 17)):
        ids = torch.randint(3, 4096, (3,), generator=gen).tolist()
        for _ in range(tiles):
            ids += [VISION_START_ID, *[IMAGE_TOKEN_ID] * 4, VISION_END_ID]
        ids += torch.randint(3, 4096, (words,), generator=gen).tolist()
        pixels = torch.randn(tiles, 3, INTERNVL_TILE, INTERNVL_TILE, generator=gen)
        out.append(Example(ids, vision={"pixel_values": pixels} if tiles else None))
    return out


@pytest.fixture(scope="module")
def internvl_reference(internvl_examples) -> list[torch.Tensor]:
    model = _internvl("sdpa")
    assert is_vision_config(model.config) and not uses_mrope(model.config)
    return [_alone(model, ex) for ex in internvl_examples]


@pytest.mark.parametrize("backend", ["varlen", "sdpa", "eager"])
def test_internvl_packed_equals_alone(internvl_examples, internvl_reference, backend):
    batch = pack(internvl_examples)
    assert tuple(batch.position_ids.shape) == (1, batch.num_tokens)  # the ordinary path
    assert batch.vision["pixel_values"].shape[0] == 6  # every row's tiles, in order
    assert _delta(_packed_logps(_internvl(backend), batch), internvl_reference) < FP32_TOL


@pytest.mark.parametrize("side", ["left", "right"])
def test_internvl_padded_equals_alone(internvl_examples, internvl_reference, side):
    padded = to_padded(pack(internvl_examples), side, PAD_TOKEN_ID)
    with torch.no_grad():
        flat = unpad(forward_padded(_internvl("varlen"), padded), padded.attention_mask)
    got = [s[:-1] for s in flat.split([len(e) for e in internvl_examples])]
    assert _delta(got, internvl_reference) < FP32_TOL


def test_internvl_positions_running_on_leak(internvl_examples, internvl_reference):
    """Positions that do not restart per sequence: sdpa attends across rows (the test above can fail)."""
    batch = pack(internvl_examples)
    running = torch.arange(batch.num_tokens)[None]
    leaked = _packed_logps(_internvl("sdpa"), dataclasses.replace(batch, position_ids=running))
    assert _delta(leaked, internvl_reference) > LEAK_MIN


def test_internvl_vision_features_packed_equal_per_tile(internvl_examples):
    model = _internvl("varlen")
    with torch.no_grad():
        features = model.model.get_image_features
        tiles = concat_vision([ex.vision for ex in internvl_examples])["pixel_values"]
        packed = features(tiles).pooler_output
        alone = [features(ex.vision["pixel_values"]).pooler_output for ex in internvl_examples if ex.vision]
    assert _delta(list(packed), [tile for per_row in alone for tile in per_row]) < FP32_TOL


# ----------------------------------------------------------------------------------------------------------
# Qwen3.5 VL: a hybrid language model (gated delta-nets + attention) under M-RoPE
# ----------------------------------------------------------------------------------------------------------


def test_qwen3_5_vl_hybrid_packs_with_per_sample_mrope():
    """Qwen3.5's vision-language model: images of different sizes and text-only rows packed, M-RoPE rows
    per sample as for Qwen2.5-VL, gated delta-net layers restarting per sequence: packed equals each
    sample alone (transformers computing its own positions); without the M-RoPE rows it does not."""
    from padless.forward import hybrid

    examples = [_example("qwen3.5-vl", pieces, images) for pieces, images in _samples("qwen3.5-vl")]
    reference = [_alone(_build("qwen3.5-vl", "sdpa"), ex) for ex in examples]
    model = _build("qwen3.5-vl", "varlen")
    assert hybrid.install(model)  # its gated delta-net layers, as load_model installs them
    batch = pack(examples)
    assert _delta(_packed_logps(model, batch), reference) <= FP32_TOL
    flat = _unguarded_logps(model, dataclasses.replace(batch, position_ids=batch.position_ids[0]))
    assert _delta(flat, reference) > LEAK_MIN


def test_a_vision_config_transformers_maps_to_no_base_model_uses_no_m_rope():
    """ShieldGemma 2's config has a vision tower but no base model in transformers' mapping: no M-RoPE
    (the probe asked and crashed with a KeyError)."""
    from transformers import ShieldGemma2Config

    from padless.forward.vision import uses_mrope

    assert not uses_mrope(ShieldGemma2Config())


def test_qwen3_5_vl_hybrid_trains_packed_with_the_gradients_of_each_sample_alone():
    """SFT's step on Qwen3.5-VL (gated delta-nets, M-RoPE, images of different sizes): the gradient of the
    packed row's NLL equals the sum of each sample's alone, and a few steps on the packed row learn."""
    from padless.forward import hybrid

    examples = [_example("qwen3.5-vl", pieces, images) for pieces, images in _samples("qwen3.5-vl")]
    model = _build("qwen3.5-vl", "varlen")
    hybrid.install(model)
    params = [p for p in model.parameters() if p.requires_grad]

    def grads(batches) -> list[torch.Tensor]:
        model.zero_grad()
        for batch in batches:
            (-forward_packed(model, batch).logps.sum()).backward()
        return [p.grad.clone() for p in params]

    packed, alone = grads([pack(examples)]), grads([pack([ex]) for ex in examples])
    worst = max(((p - a).abs().max() / a.abs().max()).item() for p, a in zip(packed, alone, strict=True))
    assert worst <= 1e-4  # fp32 summation order over one row or four; measured 1.7e-5
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    batch = pack(examples)
    losses = []
    for _ in range(2):
        optimizer.zero_grad()
        loss = -forward_packed(model, batch).logps.mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses  # measured 8.44 -> 6.93
