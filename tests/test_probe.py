"""The load-time probe: the requested kernel runs, and it isolates packed sequences."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import padless.probe as probe
from padless.attention import (
    VARLEN_NAME,
    AttentionError,
    assert_attention,
    attention_in_use,
)
from padless.engine import forward_packed
from padless.model import load_model
from padless.packing import Example, pack
from padless.probe import (
    count_attention_calls,
    probe_attention,
)
from padless.tiny import tiny_config
from padless.varlen import (
    KERNEL_CALLS,
    varlen_attention_forward,
)

# ----------------------------------------------------------------------------------------------------------
# The probe: the requested kernel runs, and it isolates packed sequences
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("backend", "kernel"), [("varlen", "sdpa"), ("sdpa", "sdpa"), ("eager", "eager")])
def test_probe_passes_and_reports_kernel(models, backend, kernel):
    info = probe_attention(models[backend], backend)
    assert info["backend"] == backend
    assert info["kernel"] == kernel
    assert 0.0 <= info["max_delta_hidden"] <= info["bound"] < 1e-4  # fp32 round-off, far from a leak


@pytest.mark.parametrize("backend", ["varlen", "sdpa"])
def test_probe_reports_one_call_per_layer(models, backend):
    info = probe_attention(models[backend], backend)
    assert info["calls"] == models[backend].config.num_hidden_layers


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama"])
def test_packed_forward_calls_varlen_once_per_layer(name, probe_seqs):
    model = load_model(name, attn_implementation="varlen")
    layers = model.config.num_hidden_layers
    before = KERNEL_CALLS["varlen:sdpa"]
    with torch.no_grad(), count_attention_calls() as counts:
        forward_packed(model, pack([Example(s) for s in probe_seqs]))
    assert dict(counts) == {VARLEN_NAME: layers}
    assert KERNEL_CALLS["varlen:sdpa"] - before == layers
    # The counting wrappers are removed afterwards.
    assert ALL_ATTENTION_FUNCTIONS[VARLEN_NAME] is varlen_attention_forward


def test_shared_config_switch_is_caught(probe_seqs):
    cfg = tiny_config("tiny-qwen2")
    first = AutoModelForCausalLM.from_config(cfg, attn_implementation=VARLEN_NAME)
    first.padless_attention = "varlen"
    assert_attention(first, "varlen")
    AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")  # same config object
    assert attention_in_use(first) == "eager", "precondition: transformers writes the kernel into cfg"
    with pytest.raises(AttentionError, match="same config object"):
        assert_attention(first, "varlen")
    with pytest.raises(AttentionError, match="same config object"):
        forward_packed(first, pack([Example(s) for s in probe_seqs]))
    with pytest.raises(AttentionError, match="same config object"):
        probe_attention(first, "varlen")


def test_config_mismatch_raises(monkeypatch, probe_seqs):
    model = load_model("tiny-qwen2", attn_implementation="varlen")
    assert model.padless_attention == "varlen"
    monkeypatch.setattr(model.config, "_attn_implementation", "sdpa")
    with pytest.raises(AttentionError, match=r"loaded with attention 'varlen'.*dispatches to 'sdpa'"):
        forward_packed(model, pack([Example(s) for s in probe_seqs]))
    with pytest.raises(AttentionError, match="dispatches to 'sdpa'"):
        assert_attention(model, "varlen")


def test_probe_catches_a_layer_running_another_kernel():
    model = load_model("tiny-qwen2", attn_implementation="varlen")
    layer = model.model.layers[1].self_attn
    layer.config = copy.deepcopy(layer.config)
    layer.config._attn_implementation = "sdpa"
    assert attention_in_use(model) == "varlen"  # the top-level config still says varlen
    with pytest.raises(AttentionError, match=r"requested attention 'varlen' but a packed forward called"):
        probe_attention(model, "varlen")


def test_probe_reference_runs_on_eager_and_every_config_is_restored():
    """The probe's reference runs on transformers' eager kernel; afterwards each config (here one layer
    holding a config of its own) dispatches exactly where it did before."""
    model = load_model("tiny-qwen2", attn_implementation="varlen")
    layer = model.model.layers[1].self_attn
    layer.config = copy.deepcopy(layer.config)
    layer.config._attn_implementation = "sdpa"
    with probe._eager(model), count_attention_calls() as calls, torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=False)
    assert dict(calls) == {}  # eager is the built-in default: no registered function ran
    assert model.config._attn_implementation == VARLEN_NAME and layer.config._attn_implementation == "sdpa"


def _leaky_varlen(module, query, key, value, attention_mask, **kwargs):
    """The varlen function with the sequence boundaries dropped: one causal attention over the whole row."""
    for k in ("cu_seq_lens_q", "cu_seq_lens_k", "position_ids"):
        kwargs.pop(k, None)
    return varlen_attention_forward(module, query, key, value, attention_mask, **kwargs)


def test_probe_catches_a_leaking_kernel(monkeypatch):
    model = load_model("tiny-qwen2", attn_implementation="varlen")
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, VARLEN_NAME, _leaky_varlen)
    with pytest.raises(AttentionError, match="leaks between packed sequences"):
        probe_attention(model, "varlen")
    with pytest.raises(AttentionError, match="leaks between packed sequences"):
        load_model("tiny-qwen2", attn_implementation="varlen")
