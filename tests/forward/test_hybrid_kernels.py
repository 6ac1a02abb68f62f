"""The CUDA kernels' branch of gated delta-nets, short convolutions and Mamba-2 mixers, run on CPU through
the kernels' contract stand-ins (padless.testing.state_kernels): told the packed row's boundaries, the
embedded hybrid, an LFM2-style and Mamba-2 hybrids compute what the exact per-sequence path computes, the
load-time probe proves it, and a kernel told no boundaries is caught."""

from __future__ import annotations

import functools
import sys
from collections import Counter

import pytest
import torch

from padless.forward import hybrid, hybrid_kernels
from padless.forward.attention import AttentionError
from padless.forward.engine import forward_packed
from padless.forward.packing import Example, pack
from padless.proof.check import zoo_model
from padless.proof.load import load_model
from padless.proof.probe import bound, probe_attention
from padless.testing.state_kernels import (
    reference_causal_conv1d_fn,
    reference_chunk_gated_delta_rule,
    reference_mamba_chunk_scan_combined,
    state_kernels_on_cpu,
)

HYBRID = "tiny-qwen3.5"
SCAN_MODULE = "mamba_ssm.ops.triton.ssd_combined"
# zoo hybrid -> the kernels each of its stateful layers calls once on a packed row
ZOO_KERNELS = {
    "lfm2": ("conv",),  # LFM2: short convolution beside full attention
    "nemotron_h": ("conv", "scan"),  # Nemotron-H: Mamba-2 beside attention, MLP and MoE blocks
    "falcon_h1": ("conv", "scan"),  # Falcon-H1: Mamba-2 and attention side by side in every block
}


def _counted(calls: Counter, name: str, fn):
    @functools.wraps(fn)
    def counting(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)

    return counting


@pytest.fixture(scope="module")
def hybrid_model():
    return load_model(HYBRID, attn_implementation="varlen")


def test_kernel_branch_equals_the_exact_path_and_passes_the_probe(hybrid_model, probe_seqs):
    batch = pack([Example(s) for s in probe_seqs])
    with torch.no_grad():
        exact = forward_packed(hybrid_model, batch).logps
    calls: Counter[str] = Counter()
    with state_kernels_on_cpu() as modules:
        modules["causal_conv1d"].causal_conv1d_fn = _counted(calls, "conv", reference_causal_conv1d_fn)
        rule = _counted(calls, "rule", reference_chunk_gated_delta_rule)
        modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = rule
        with torch.no_grad():
            kernels = forward_packed(hybrid_model, batch).logps
        linear = hybrid_model.config.layer_types.count("linear_attention")
        assert calls == {"conv": linear, "rule": linear}  # each gated delta-net layer, once, whole row
        info = probe_attention(hybrid_model, "varlen")
    limit = bound(torch.float32, exact.abs().max().item())
    assert (kernels - exact).abs().max().item() <= limit
    assert info["max_delta_logps"] <= info["bound"]


def test_a_kernel_told_no_boundaries_fails_the_probe(hybrid_model):
    """The convolution kernel given no seq_idx (what transformers alone passes): taps cross the packed
    boundaries, and the probe refuses."""

    def blind_conv(x, weight, bias=None, seq_idx=None, activation=None, **kwargs):
        return reference_causal_conv1d_fn(x, weight, bias, activation=activation, **kwargs)

    with state_kernels_on_cpu() as modules:
        modules["causal_conv1d"].causal_conv1d_fn = blind_conv
        with pytest.raises(AttentionError, match="leaks between packed sequences"):
            probe_attention(hybrid_model, "varlen")


@functools.cache
def _zoo_hybrid(name: str, probe_seqs: tuple[tuple[int, ...], ...]):
    model = zoo_model(name, [list(s) for s in probe_seqs])
    model.set_attn_implementation("padless_varlen")
    model.padless_attention = "varlen"
    return model


def _count_kernels(modules, calls: Counter) -> None:
    modules["causal_conv1d"].causal_conv1d_fn = _counted(calls, "conv", reference_causal_conv1d_fn)
    scan = _counted(calls, "scan", reference_mamba_chunk_scan_combined)
    modules[SCAN_MODULE].mamba_chunk_scan_combined = scan


@pytest.mark.parametrize("name", list(ZOO_KERNELS))
def test_short_conv_and_mamba2_kernel_branches_equal_the_exact_path(name, probe_seqs, monkeypatch):
    """Each stateful layer calls its kernels once on the whole packed row, in eval and in train mode
    (where a Mamba-2 mixer first tries the fused conv-scan kernel, which the branch sets aside: it would
    get no boundaries); log-probs equal the exact path's within the bound, and the probe passes."""
    model = _zoo_hybrid(name, tuple(map(tuple, probe_seqs)))
    layers = hybrid.installed_layers(model)
    batch = pack([Example(s) for s in probe_seqs])
    with torch.no_grad():
        exact = forward_packed(model, batch).logps
    calls: Counter[str] = Counter()
    with state_kernels_on_cpu() as modules:
        _count_kernels(modules, calls)
        modeling = sys.modules[type(model).__module__]
        if hasattr(modeling, hybrid_kernels.FUSED):  # a fused kernel told nothing must not run
            monkeypatch.setattr(
                modeling, hybrid_kernels.FUSED, lambda *a, **k: pytest.fail("fused kernel ran")
            )
        with torch.no_grad():
            kernels = forward_packed(model, batch).logps
        assert calls == dict.fromkeys(ZOO_KERNELS[name], len(layers))
        model.train()
        try:
            trained = forward_packed(model, batch).logps
        finally:
            model.eval()
        assert calls == dict.fromkeys(ZOO_KERNELS[name], 2 * len(layers))
        info = probe_attention(model, "varlen")
    assert calls == dict.fromkeys(ZOO_KERNELS[name], 3 * len(layers))  # the probe's packed row, too
    limit = bound(torch.float32, exact.abs().max().item())
    assert (kernels - exact).abs().max().item() <= limit
    assert (trained.detach() - exact).abs().max().item() <= limit
    assert info["max_delta_logps"] <= info["bound"]


@pytest.mark.parametrize(
    ("name", "blind"), [("lfm2", "conv"), ("nemotron_h", "conv"), ("nemotron_h", "scan")]
)
def test_a_short_conv_or_mamba2_kernel_told_no_boundaries_fails_the_probe(name, blind, probe_seqs):
    """One kernel given no seq_idx (the other still told): its state or taps cross the packed
    boundaries, and the probe refuses."""

    def blind_conv(x, weight, bias=None, seq_idx=None, activation=None, **kwargs):
        return reference_causal_conv1d_fn(x, weight, bias, activation=activation, **kwargs)

    def blind_scan(*args, seq_idx=None, **kwargs):
        return reference_mamba_chunk_scan_combined(*args, **kwargs)

    model = _zoo_hybrid(name, tuple(map(tuple, probe_seqs)))
    with state_kernels_on_cpu() as modules:
        if blind == "conv":
            modules["causal_conv1d"].causal_conv1d_fn = blind_conv
        else:
            modules[SCAN_MODULE].mamba_chunk_scan_combined = blind_scan
        with pytest.raises(AttentionError, match="leaks between packed sequences"):
            probe_attention(model, "varlen")


def test_a_layer_outside_the_kernel_contract_runs_exact_and_says_so_once(probe_seqs, caplog):
    """A short convolution over 60 channels: the kernel takes seq_idx only channel-last, in multiples of
    8 channels. The layer runs the exact path instead (no kernel call, log-probs still those of each
    sequence alone) and the log says why, once."""
    from transformers import AutoModelForCausalLM

    from padless.proof.zoo import zoo_config

    config = zoo_config("lfm2")
    config.hidden_size, config.num_attention_heads = 60, 6  # heads of 10 (rotary halves them)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="padless_varlen").eval()
    model.padless_attention = "varlen"
    assert hybrid.install(model) == ["model.layers.0.conv"]
    batch = pack([Example(s) for s in probe_seqs])
    calls: Counter[str] = Counter()
    with state_kernels_on_cpu() as modules, torch.no_grad():
        _count_kernels(modules, calls)
        packed = [forward_packed(model, batch).logps for _ in range(2)]
        alone = torch.cat([forward_packed(model, pack([Example(s)])).logps for s in probe_seqs])
    assert calls == {}
    assert (packed[0] - alone).abs().max().item() <= bound(torch.float32, alone.abs().max().item())
    said = [r.getMessage() for r in caplog.records if r.name == hybrid_kernels.__name__]
    assert said == [
        "short convolution Lfm2ShortConv: 60 channels, width 3 (the kernel takes 8k channels, width 2-4); it "
        "runs the exact per-sequence path"
    ]


def test_a_leak_under_the_bf16_bound_is_refused_by_the_float32_probe():
    """In bf16 the probe's bound (~1 nat) is above what a convolution told no boundaries leaks
    (0.03 nats): the float32 probe on the same weights, which load and check run for 16-bit models,
    catches it; with the boundaries the model passes both."""
    from padless.proof.probe import prove_packing

    def blind_conv(x, weight, bias=None, seq_idx=None, activation=None, **kwargs):
        return reference_causal_conv1d_fn(x, weight, bias, activation=activation, **kwargs)

    model = load_model(HYBRID, attn_implementation="varlen", dtype="bfloat16", probe=False)
    with state_kernels_on_cpu() as modules:
        info = prove_packing(model, "varlen")
        assert info["max_delta_logps"] <= info["bound"] and "float32_probe" in info
        modules["causal_conv1d"].causal_conv1d_fn = blind_conv
        probe_attention(model, "varlen")  # 16 bits alone: the leak is under the bound
        with pytest.raises(AttentionError, match="in float32 on the same weights; the 16-bit probe passed"):
            prove_packing(model, "varlen")
