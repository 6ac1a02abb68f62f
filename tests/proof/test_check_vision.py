"""``padless check --model <VLM>`` (padless.proof.check_vision): the matrix over image+text chats passes on
the embedded VLM and on a saved VLM folder, and fails when packed sequences lose their M-RoPE rows."""

from __future__ import annotations

import dataclasses

import pytest

import padless.proof.check_vision as check_vision
from padless.cli import main
from padless.data.sources import load_processor
from padless.proof.check import failures, run_matrix
from padless.proof.load import load_model
from padless.tiny.vlm import IMAGE_TOKEN_ID

BACKENDS = ("varlen", "sdpa", "eager")


@pytest.fixture(scope="module")
def vlm():
    return load_model("tiny-qwen2.5-vl", attn_implementation="varlen")


@pytest.fixture(scope="module")
def probe(vlm):
    return check_vision.probe_examples(vlm, load_processor("tiny-qwen2.5-vl"))


def test_probe_mixes_image_sizes_and_a_text_only_chat(probe):
    grids = [ex.vision["image_grid_thw"].tolist() if ex.vision else [] for ex in probe]
    assert [len(g) for g in grids] == [1, 2, 0, 1]
    assert len({tuple(row) for g in grids for row in g}) > 1  # images of different sizes
    assert all(ex.loss_mask is None for ex in probe)  # every token is compared
    assert all(
        ex.input_ids.count(IMAGE_TOKEN_ID) == int(sum(r[1] * r[2] for r in g) // 4)
        for ex, g in zip(probe, grids, strict=True)
    )


LAYOUTS = {"logps": check_vision.layout_logps, "alone": check_vision.alone_logps}


def test_matrix_passes_on_the_embedded_vlm(vlm, probe):
    rows, bound = run_matrix(vlm, probe, 0, BACKENDS, **LAYOUTS)
    assert [r.backend for r in rows] == list(BACKENDS)
    assert failures(rows, BACKENDS) == []
    assert all(c.max_delta < 1e-5 for r in rows for c in r.cells) and bound < 1e-4


def test_matrix_fails_when_packing_drops_the_mrope_rows(vlm, probe, monkeypatch):
    real_pack = check_vision.pack

    def flat_positions(examples, device="cpu"):
        batch = real_pack(examples, device=device)
        return dataclasses.replace(batch, position_ids=batch.position_ids[0])

    monkeypatch.setattr(check_vision, "pack", flat_positions)
    rows, _ = run_matrix(vlm, probe, 0, ("varlen",), **LAYOUTS)
    packed = next(c for c in rows[0].cells if c.layout == "packed")
    assert "needs position ids [4, 1, T]" in packed.error  # the engine stops rather than run them
    assert f"varlen/packed: {packed.error}" in failures(rows)


def test_cli_check_on_a_saved_vlm_folder(tmp_path, capsys, probe):
    """A folder saved without a video processor (and no torchvision here) still loads its processor, which
    renders the probe exactly as the embedded one does. The default check passes: every backend that runs
    is exact, and flex_attention, which transformers does not offer for Qwen2.5-VL, is listed as refused."""
    load_model("tiny-qwen2.5-vl", probe=False).save_pretrained(tmp_path)
    load_processor("tiny-qwen2.5-vl").save_pretrained(tmp_path)
    assert main(["check", "--model", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"sequence lengths {[len(ex) for ex in probe]}" in out
    assert "OK: every cell that ran is within its bound" in out
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line[:1].isalpha()}
    for backend in ("varlen", "sdpa", "eager"):
        assert len(lines[backend]) == 1 + 4 * 3 and lines[backend][2] == "<=", lines[backend]
    assert lines["flex_attention"][0] == "refused"
    assert "note: flex_attention: ValueError: Qwen2_5_VLForConditionalGeneration does not support" in out
