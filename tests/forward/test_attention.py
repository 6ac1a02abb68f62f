"""Attention backends by name, and transformers' backends driven packed: the KV-cache contamination
padless exists to prevent, varlen in a model, and refusals.

(The load-time probe is tested in test_probe.py, the varlen kernel in test_varlen.py, the full model x
backend x layout matrix in test_check.py.)"""

from __future__ import annotations

import pytest
import torch

import padless.forward.attention as attention
from padless.forward.attention import (
    BACKENDS,
    VARLEN_NAME,
    AttentionError,
    available_backends,
    backend_problem,
    hf_name,
    kernel_of,
    pin_kernel,
    pinned,
    validate_backend_name,
    varlen_kernel,
)
from padless.forward.engine import forward_packed
from padless.forward.packing import Example, pack, to_padded, unpad
from padless.proof.load import load_model

FP32_TOL = 1e-5
CONTAMINATED = 0.05  # packed sequences that attend to each other move log-probs far more than this


def _split_next_token_logps(logps: torch.Tensor, batch) -> list[torch.Tensor]:
    """From per-position log-probs ``[T]`` of the packed labels, drop each sequence's last position."""
    return [t[:-1] for t in batch.split(logps)]


def _logits_to_logps(logits: torch.Tensor, batch) -> list[torch.Tensor]:
    """Per-sequence next-token log-probs from full packed logits ``[T, V]``."""
    out = []
    for part, ids in zip(batch.split(logits), batch.split(batch.input_ids[0]), strict=True):
        out.append(torch.log_softmax(part[:-1].float(), -1).gather(-1, ids[1:, None])[:, 0])
    return out


# ----------------------------------------------------------------------------------------------------------
# KV-cache contamination (transformers 5.x): the bug padless exists to prevent
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("train_mode", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_default_kv_cache_contaminates_packed_batch(
    models, reference, probe_seqs, per_token_delta, backend, train_mode
):
    model = models[backend]
    assert model.config.use_cache, "precondition: the config default builds a KV cache"
    batch = pack([Example(s) for s in probe_seqs])
    model.train(train_mode)
    try:
        with torch.no_grad():
            # What a user (or a trainer) writes for padding-free: restarting positions, no mask, defaults.
            logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits[0]
            naive = _logits_to_logps(logits, batch)
            ours = _split_next_token_logps(forward_packed(model, batch).logps, batch)
    finally:
        model.eval()
    # The first sequence has nothing before it to attend to; the later ones see their predecessors.
    assert per_token_delta(naive[:1], reference[:1]) <= FP32_TOL
    assert per_token_delta(naive, reference) > CONTAMINATED, (
        "the transformers KV-cache contamination no longer reproduces; padless's guard is still right, "
        "but update DESIGN.md"
    )
    assert per_token_delta(ours, reference) <= FP32_TOL


def test_varlen_is_immune_to_the_default_kv_cache(models, reference, probe_seqs, per_token_delta):
    model = models["varlen"]
    batch = pack([Example(s) for s in probe_seqs])
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits[0]
    assert per_token_delta(_logits_to_logps(logits, batch), reference) <= FP32_TOL


# ----------------------------------------------------------------------------------------------------------
# The varlen backend in a model
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["left", "right"])
def test_varlen_model_padded_batch_matches_alone(
    models, reference, probe_seqs, pad_id, per_token_delta, side
):
    batch = pack([Example(s) for s in probe_seqs])
    padded = to_padded(batch, side, pad_id)
    with torch.no_grad():
        logits = models["varlen"](
            input_ids=padded.input_ids,
            attention_mask=padded.attention_mask,
            position_ids=padded.position_ids,
            use_cache=False,
        ).logits
    real_logits = unpad(logits, padded.attention_mask)  # [T, V] in packed order
    assert per_token_delta(_logits_to_logps(real_logits, batch), reference) <= FP32_TOL


def test_varlen_model_refuses_holey_mask(models, probe_seqs):
    ids = torch.tensor(probe_seqs[1])[None]
    mask = torch.ones_like(ids)
    mask[0, 5] = 0
    with pytest.raises(AttentionError, match="attention mask has holes"), torch.no_grad():
        models["varlen"](input_ids=ids, attention_mask=mask, use_cache=False)


def test_varlen_model_refuses_kv_cache_decode(models, probe_seqs):
    model = models["varlen"]
    ids = torch.tensor(probe_seqs[1])[None]
    with torch.no_grad():
        prefill = model(input_ids=ids, use_cache=True)  # the prefill itself runs whole sequences: fine
        with pytest.raises(AttentionError, match="takes no KV cache"):
            model(input_ids=ids[:, -1:], past_key_values=prefill.past_key_values, use_cache=True)


# ----------------------------------------------------------------------------------------------------------
# Names, availability and refusals
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("typo", "suggestion"), [("sdpaa", "sdpa"), ("varln", "varlen"), ("eagre", "eager")])
def test_unknown_backend_suggests_close_match(typo, suggestion):
    with pytest.raises(
        AttentionError, match=f"unknown attention backend '{typo}'.*Did you mean '{suggestion}'"
    ):
        validate_backend_name(typo)
    with pytest.raises(AttentionError, match=f"Did you mean '{suggestion}'"):
        load_model("tiny-qwen2", attn_implementation=typo)


def test_unknown_backend_without_close_match():
    with pytest.raises(AttentionError, match="unknown attention backend 'nope'") as err:
        hf_name("nope")
    assert "Did you mean" not in str(err.value)
    for b in BACKENDS:
        assert b in str(err.value)


def test_hf_names():
    assert hf_name("varlen") == VARLEN_NAME
    assert [hf_name(b) for b in BACKENDS[1:]] == list(BACKENDS[1:])


def test_flash_attention_2_refused_on_cpu():
    problem = backend_problem("flash_attention_2", "cpu")
    assert problem is not None and "CUDA" in problem
    with pytest.raises(AttentionError, match="needs a CUDA device"):
        load_model("tiny-qwen2", attn_implementation="flash_attention_2")


def test_flash_attention_2_without_flash_attn_names_the_install(monkeypatch):
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: False)
    problem = backend_problem("flash_attention_2", "cuda")
    assert problem is not None and "pip install 'padless[flash]'" in problem
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: True)
    assert backend_problem("flash_attention_2", "cuda") is None


def test_flex_attention_training_refused_on_cpu():
    assert backend_problem("flex_attention", "cpu") is None  # forward only is fine
    problem = backend_problem("flex_attention", "cpu", training=True)
    assert problem is not None and "no backward pass on CPU" in problem and "varlen" in problem
    assert backend_problem("flex_attention", "cuda", training=True) is None
    with pytest.raises(AttentionError, match="no backward pass on CPU"):
        load_model("tiny-qwen2", attn_implementation="flex_attention", training=True)


def test_available_backends_on_cpu():
    assert available_backends("cpu") == ["varlen", "sdpa", "eager", "flex_attention"]
    assert available_backends("cpu", training=True) == ["varlen", "sdpa", "eager"]


def test_varlen_torch_kernel_refused_on_cpu(models, probe_seqs):
    problem = backend_problem("varlen", "cpu", kernel="torch")
    assert problem is not None and "needs a CUDA device" in problem and "sdpa" in problem
    with pytest.raises(AttentionError, match="varlen kernel 'torch' needs a CUDA device"):
        load_model("tiny-qwen2", attn_implementation="varlen", varlen_kernel="torch")
    # An already loaded model pinned to it refuses at its next forward rather than silently running another
    # kernel; the pin is the model's own, given back after the block.
    model = models["varlen"]
    with pinned(model, "torch"), pytest.raises(AttentionError, match="needs a CUDA device"), torch.no_grad():
        forward_packed(model, pack([Example(s) for s in probe_seqs]))
    assert kernel_of(model) == kernel_of(model.model.layers[0].self_attn) == "auto"
    assert backend_problem("varlen", "cpu") is None


def test_pin_kernel_rejects_unknown_name():
    layer = torch.nn.Linear(2, 2)
    with pytest.raises(AttentionError, match="unknown varlen kernel 'triton'"):
        pin_kernel(layer, "triton")
    assert kernel_of(layer) == "auto"  # pin unchanged
    assert varlen_kernel(torch.device("cpu"), torch.float32, kernel_of(layer)) == "sdpa"


def test_varlen_kernel_choice(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # device objects only: no CUDA needed
    assert varlen_kernel(cpu, torch.float32) == "sdpa"
    assert varlen_kernel(cpu, torch.bfloat16) == "sdpa"
    assert varlen_kernel(cuda, torch.float32) == "sdpa"  # the fused kernels take no fp32
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: True)
    assert varlen_kernel(cuda, torch.bfloat16) == "flash_attn"
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: False)
    assert varlen_kernel(cuda, torch.float16) == "torch"
    monkeypatch.setattr(attention, "torch_varlen_available", lambda: True)
    assert varlen_kernel(cuda, torch.bfloat16, "torch") == "torch"
    with pytest.raises(AttentionError, match="fp16/bf16 only"):
        varlen_kernel(cuda, torch.float32, "torch")
    with pytest.raises(AttentionError, match=r"pip install 'padless\[flash\]'"):
        varlen_kernel(cuda, torch.bfloat16, "flash_attn")
    monkeypatch.setattr(attention, "torch_varlen_available", lambda: False)
    with pytest.raises(AttentionError, match="upgrade torch"):
        varlen_kernel(cuda, torch.bfloat16, "torch")
