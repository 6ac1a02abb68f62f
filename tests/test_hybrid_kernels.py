"""The CUDA kernels' branch of gated delta-nets, run on CPU through the kernels' contract stand-ins
(padless.testing.state_kernels): told the packed row's boundaries, the embedded hybrid computes what the
exact per-sequence path computes, the load-time probe proves it, and a kernel told no boundaries is
caught."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch

from padless.attention import AttentionError
from padless.engine import forward_packed
from padless.model import load_model
from padless.packing import Example, pack
from padless.probe import probe_attention
from padless.testing.state_kernels import (
    reference_causal_conv1d_fn,
    reference_chunk_gated_delta_rule,
    state_kernels_on_cpu,
)
from padless.tolerance import bound

HYBRID = "tiny-qwen3.5"


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
