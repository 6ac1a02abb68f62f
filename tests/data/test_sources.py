"""Where models come from: LoRA checkpoints that load anywhere offline (padless generate, peft), cached hub
ids resolved without the network, and trust_remote_code passed explicitly, never a prompt."""

from __future__ import annotations

import importlib.util
import json
import math
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from PIL import Image
from safetensors.torch import load_file

from padless.cli import main
from padless.data import sources
from padless.forward.engine import forward_packed
from padless.forward.packing import Example, pack
from padless.proof.load import load_model, load_tokenizer
from padless.tiny import build_tiny_model, tiny_tokenizer

FAST = [
    "data.train=tiny:sft_eval",
    "train.progress_bar=false",
    "train.report_to=[jsonl]",
    "train.max_steps=1",
]


@pytest.fixture
def no_network(monkeypatch) -> list[tuple]:
    """Every attempt to open a network connection is recorded and refused."""
    attempts: list[tuple] = []

    def refuse(self, address, *args):
        attempts.append(address)
        raise OSError("network is off in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: attempts.append(a) or refuse(None, a))
    return attempts


def logps(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return forward_packed(model.eval(), pack([Example(ids)])).logps


def test_lora_checkpoints_load_anywhere_offline(tmp_path, no_network, capsys):
    """A LoRA checkpoint of the embedded model records a base padless loads offline; `padless generate`
    and peft (onto padless's base) load it, with every adapter tensor in place; nothing asks the network."""
    run = tmp_path / "run"
    lora = ["model.lora.r=2", "model.lora.target_modules=[q_proj,v_proj]", "model.lora.dropout=0"]
    assert main(["sft", "model.name=tiny-llama@3", *lora, *FAST, f"train.output_dir={run}"]) == 0
    ckpt = run / "checkpoint-1"
    assert json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny-llama@3"
    assert (
        main(["generate", "--model", str(ckpt), "--prompt", "What is 2 + 3?", "--max-new-tokens", "3"]) == 0
    )
    assert "What is 2 + 3?" in capsys.readouterr().out

    peft_model = PeftModel.from_pretrained(load_model("tiny-llama@3"), str(ckpt))
    saved = load_file(ckpt / "adapter_model.safetensors")
    state = peft_model.state_dict()
    for name, tensor in saved.items():
        torch.testing.assert_close(state[name.replace(".weight", ".default.weight")], tensor, rtol=0, atol=0)
    merged = load_model(str(ckpt))  # padless: base rebuilt from its seed, adapter applied and merged
    ids = tiny_tokenizer()("What is 2 + 3? It is 5.")["input_ids"]
    torch.testing.assert_close(logps(merged, ids), logps(peft_model, ids), rtol=0, atol=1e-5)
    assert (logps(merged, ids) - logps(load_model("tiny-llama@3"), ids)).abs().max() > 1e-4  # trained
    assert no_network == []


def test_lora_on_a_local_base_records_its_absolute_path(tmp_path, monkeypatch):
    base = tmp_path / "base"
    build_tiny_model("tiny-llama", seed=1).save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    monkeypatch.chdir(tmp_path)
    lora = ["model.lora.r=2", "model.lora.target_modules=[q_proj]"]
    assert main(["sft", "model.name=base", *lora, *FAST, "train.output_dir=run"]) == 0
    config = json.loads((tmp_path / "run" / "checkpoint-1" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve())


def test_a_cached_hub_id_loads_from_the_cache_and_keeps_its_id(tmp_path, monkeypatch, no_network):
    """A model in the Hugging Face cache is found there (no download, no network), and adapters trained
    on it would record the hub id, not the snapshot folder."""
    import huggingface_hub.constants

    snapshot = tmp_path / "hub" / "models--someone--tiny" / "snapshots" / "abc123"
    build_tiny_model("tiny-llama", seed=2).save_pretrained(snapshot)
    tiny_tokenizer().save_pretrained(snapshot)
    (tmp_path / "hub" / "models--someone--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--someone--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    model = load_model("someone/tiny")
    assert model.name_or_path == "someone/tiny"
    expected = build_tiny_model("tiny-llama", seed=2)
    assert torch.equal(model.model.embed_tokens.weight, expected.model.embed_tokens.weight)
    assert len(load_tokenizer("someone/tiny")) == 4096
    assert no_network == []


def test_trust_remote_code_is_passed_explicitly_and_off_by_default(tmp_path, monkeypatch):
    """transformers prompts [y/N] when trust_remote_code is left unset: padless always sets it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path / "model"
    build_tiny_model("tiny-llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    seen: list[dict] = []
    for auto in (AutoModelForCausalLM, AutoTokenizer):
        original = auto.from_pretrained.__func__

        def record(cls, *args, _original=original, **kwargs):
            seen.append(kwargs)
            return _original(cls, *args, **kwargs)

        monkeypatch.setattr(auto, "from_pretrained", classmethod(record))
    load_tokenizer(str(folder))
    load_model(str(folder))
    assert [(k["trust_remote_code"], k["local_files_only"]) for k in seen] == [(False, True), (False, True)]


def test_trusting_remote_code_lets_the_folder_through(tmp_path):
    folder = tmp_path / "model"
    build_tiny_model("tiny-llama").save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "m.M"}}))
    with pytest.raises(sources.InputError, match="trust_remote_code"):
        sources.check_model_folder(folder, "model", trust_remote_code=False)
    assert sources.check_model_folder(folder, "model", trust_remote_code=True)["auto_map"]


def test_seeded_embedded_names(tmp_path):
    model = load_model("tiny-llama@7")
    assert model.name_or_path == "tiny-llama@7"
    assert torch.equal(model.lm_head.weight, build_tiny_model("tiny-llama", seed=7).lm_head.weight)
    assert load_model("tiny-llama").name_or_path == "tiny-llama"
    with pytest.raises(sources.InputError, match=r"model\.seed is 5"):
        load_model("tiny-llama@7", seed=5)


def test_row_slices_of_a_source(tmp_path):
    from padless.data import load_rows

    rows = load_rows("tiny:rl[:16]")
    assert len(rows) == 16 and rows[0].index == 1 and rows[-1].index == 16
    assert [r.index for r in load_rows("tiny:rl[298:]")] == [299, 300]
    odd = tmp_path / "odd[1:2].jsonl"  # an existing file is read whole, whatever its name
    odd.write_text('{"text": "a"}\n{"text": "b"}\n')
    assert len(load_rows(str(odd))) == 2
    assert Path(str(odd)).exists()


def test_an_adapter_trained_from_an_adapter_checkpoint_names_it_as_its_base(tmp_path):
    """Training LoRA on a LoRA checkpoint trains on base + first adapter (merged): the second adapter's
    recorded base is the first checkpoint, so loading it rebuilds the whole chain."""
    lora = ["model.lora.r=2", "model.lora.target_modules=[q_proj,v_proj]", "model.lora.dropout=0"]
    first, second = tmp_path / "a", tmp_path / "b"
    assert main(["sft", "model.name=tiny-llama", *lora, *FAST, f"train.output_dir={first}"]) == 0
    ckpt = first / "checkpoint-1"
    assert main(["sft", f"model.name={ckpt}", *lora, *FAST, f"train.output_dir={second}"]) == 0
    config = json.loads((second / "checkpoint-1" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(ckpt.resolve())
    chain = PeftModel.from_pretrained(load_model(str(ckpt)), str(second / "checkpoint-1"))
    ids = tiny_tokenizer()("What is 2 + 3? It is 5.")["input_ids"]
    torch.testing.assert_close(
        logps(load_model(str(second / "checkpoint-1")), ids), logps(chain, ids), atol=1e-5, rtol=0
    )


def _hub_folder(folder: Path, name: str, tokenizer: Any, template: str, vision: bool) -> Path:
    """``name``'s weights laid out the way the Hub ships Qwen2.5(-VL) folders, written by hand: the tokenizer
    class in tokenizer_config.json, the chat template there (text) or only in chat_template.json (VL), the
    processor class only in preprocessor_config.json (no processor_config.json, no video processor config)."""
    build_tiny_model(name).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    specials = [
        t for t in tokenizer.all_special_tokens if t not in (tokenizer.eos_token, tokenizer.pad_token)
    ]
    hub_config = {
        "add_prefix_space": False,
        "additional_special_tokens": specials,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": tokenizer.eos_token,
        "errors": "replace",
        "model_max_length": 2048,
        "pad_token": tokenizer.pad_token,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    if not vision:  # Qwen2.5-VL keeps its template in chat_template.json (the processor's) instead
        hub_config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(hub_config))
    if vision:
        from padless.tiny import vlm

        image = vlm.tiny_vlm_processor().image_processor
        (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}))
        preprocessor = {
            "min_pixels": vlm.MIN_PIXELS,
            "max_pixels": vlm.MAX_PIXELS,
            "patch_size": image.patch_size,
            "temporal_patch_size": image.temporal_patch_size,
            "merge_size": image.merge_size,
            "image_mean": list(image.image_mean),
            "image_std": list(image.image_std),
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2_5_VLProcessor",
        }
        (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return folder


@pytest.fixture
def hub_vl(tmp_path) -> Path:
    from padless.tiny.vlm import CHAT_TEMPLATE, tiny_vlm_processor

    return _hub_folder(
        tmp_path / "vl", "tiny-qwen2.5-vl", tiny_vlm_processor().tokenizer, CHAT_TEMPLATE, True
    )


def test_hub_layout_folders_load_like_the_embedded_ones(tmp_path, hub_vl):
    """A text folder and a Qwen2.5-VL folder as the Hub lays them out load without torchvision, with the
    tokenizer, chat template and image processor of the embedded models they were written from."""
    assert importlib.util.find_spec("torchvision") is None  # the case the image-only fallback exists for
    embedded = tiny_tokenizer()
    text = _hub_folder(tmp_path / "text", "tiny-qwen2", embedded, embedded.chat_template, False)
    chat = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]
    assert load_tokenizer(str(text)).apply_chat_template(chat) == embedded.apply_chat_template(chat)

    want, got = sources.load_processor("tiny-qwen2.5-vl"), sources.load_processor(str(hub_vl))
    assert type(got).__name__ == "Qwen2_5_VLProcessor"
    assert load_tokenizer(str(hub_vl)).chat_template == want.chat_template  # from chat_template.json
    picture = Image.new("RGB", (60, 44), "red")
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]
    prompt = want.apply_chat_template(chat, add_generation_prompt=True)
    assert got.apply_chat_template(chat, add_generation_prompt=True) == prompt
    a, b = (p(text=[prompt], images=[picture], return_tensors="pt") for p in (want, got))
    assert a["input_ids"].tolist() == b["input_ids"].tolist()
    torch.testing.assert_close(a["pixel_values"], b["pixel_values"], rtol=0, atol=0)


def test_a_folder_naming_no_processor_class_loads_the_one_its_model_type_maps_to(hub_vl):
    """As AutoProcessor does: no processor_class in any file, the class of config.json's model_type
    (qwen2_5_vl: Qwen2_5_VLProcessor), image-only without torchvision, processing as the embedded one."""
    preprocessor = json.loads((hub_vl / "preprocessor_config.json").read_text())
    del preprocessor["processor_class"]
    (hub_vl / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    assert sources._processor_class(hub_vl) == "Qwen2_5_VLProcessor"
    want, got = sources.load_processor("tiny-qwen2.5-vl"), sources.load_processor(str(hub_vl))
    assert type(got).__name__ == "Qwen2_5_VLProcessor"
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]
    prompt = want.apply_chat_template(chat, add_generation_prompt=True)
    a, b = (
        p(text=[prompt], images=[Image.new("RGB", (60, 44), "red")], return_tensors="pt") for p in (want, got)
    )
    assert a["input_ids"].tolist() == b["input_ids"].tolist()
    torch.testing.assert_close(a["pixel_values"], b["pixel_values"], rtol=0, atol=0)


@pytest.mark.slow
def test_hub_layout_qwen2_5_vl_trains_with_padless_sft(tmp_path, hub_vl):
    """`padless sft` on the Hub-layout folder, in a venv without torchvision: two steps on image rows."""
    assert importlib.util.find_spec("torchvision") is None
    run = tmp_path / "run"
    args = ["data.train=tiny:shapes_sft", "data.max_length=256", "train.max_tokens_per_batch=256"]
    assert main(["sft", f"model.name={hub_vl}", *args, *FAST[1:], f"train.output_dir={run}"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == [1]
    assert math.isfinite(next(r["train/loss"] for r in records if "train/loss" in r))
