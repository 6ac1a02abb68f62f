"""Stateful layers of hybrid models kept apart per sequence: each kind found by what it is, its packed
outputs equal to each sequence alone per token (values and gradients), a state carried over one boundary
refused by the load-time probe, and what padless does not cover still refused.

The bound is :func:`padless.proof.probe.bound` at the size of the compared numbers, as for attention:
grouping sequences into other batch shapes changes only fp32 round-off (a few ulps of each number).
"""

from __future__ import annotations

import copy

import pytest
import torch

from padless.forward import hybrid
from padless.forward.attention import AttentionError
from padless.forward.engine import ModelEngine, forward_packed
from padless.forward.hybrid import packing_problem
from padless.forward.packing import Example, pack
from padless.proof.check import alone_logps, zoo_model
from padless.proof.probe import bound, probe_attention
from padless.proof.zoo import build_zoo_model

# zoo architecture -> the stateful kind its tiny config has, and the decoder class that holds it
KINDS = {
    "qwen3-next": "gated_delta_net",  # Qwen3-Next: gated delta-net (its convolution inside)
    "qwen3_5_text": "gated_delta_net",  # Qwen3.5 (separate q/k/v/z/b/a projections)
    "lfm2": "short_conv",  # LFM2: short causal convolution
    "nemotron_h": "mamba2",  # Nemotron-H: Mamba-2 beside attention, MLP and MoE blocks
    "falcon_h1": "mamba2",  # Falcon-H1: Mamba-2 and attention side by side in every block
    "jamba": "mamba",  # Jamba: Mamba-1 selective scan
    "minimax": "lightning",  # MiniMax: lightning attention (a decayed K^T V state carried block to block)
    "kimi_linear": "delta_net",  # Kimi Linear: delta attention, its decay in a gate of its own
}


def _packed_batch(seqs: list[list[int]]):
    return pack([Example(s) for s in seqs])


@pytest.mark.parametrize(("name", "kind"), list(KINDS.items()))
def test_stateful_layers_are_found_by_what_they_are_and_wrapped(name, kind):
    model = build_zoo_model(name, "eager")
    kinds = {hybrid.layer_kind(m) for m in model.modules()} - {None}
    assert kinds == {kind}
    assert hybrid.installed_layers(model) and hybrid.unhandled(model) == []
    assert hybrid.install(model) == hybrid.installed_layers(model)  # idempotent
    assert packing_problem(model) is None


# one model per kind but Mamba-1 (Jamba's sequential scan takes 20 s here; the zoo proves it exact)
@pytest.mark.parametrize("name", ["qwen3_5_text", "lfm2", "falcon_h1", "minimax"])
def test_a_state_carried_over_one_boundary_fails_the_probe(name, monkeypatch):
    """The planted leak: the runner of the model's kind merges the first two sequences of every packed
    row (the second starts from the first one's final state). The probe, on the model's own forward,
    measures it and refuses; with the real runner the same model passes."""
    model = zoo_model(name, [list(range(3, 40))])
    model.set_attn_implementation("padless_varlen")
    assert probe_attention(model, "varlen")["max_delta_logps"] >= 0  # exact: passes
    kind = KINDS[name]
    monkeypatch.setitem(hybrid.RUNNERS, kind, _carrying_over(hybrid.RUNNERS[kind]))
    with pytest.raises(AttentionError, match="leaks between packed sequences"):
        probe_attention(model, "varlen")


def _carrying_over(exact: hybrid.Runner) -> hybrid.Runner:
    """``exact`` with the first two sequences of every packed row merged: the second starts from the
    first one's final state."""

    def leaky(module, forward, hidden, bounds, kwargs):
        if len(bounds.spans) < 2:  # each sequence alone: nothing to carry over
            return exact(module, forward, hidden, bounds, kwargs)
        (row, s0, _), (_, _, e1), *rest = bounds.spans
        merged = hybrid.Boundaries([(row, s0, e1), *rest], bounds.batch, bounds.length, None)
        return exact(module, forward, hidden, merged, kwargs)

    return leaky


@pytest.mark.parametrize(
    ("name", "kind"), [("mamba", "mamba"), ("falcon_mamba", "mamba"), ("mamba2", "mamba2")]
)
def test_a_pure_mamba_packs_exactly_and_a_leak_names_its_state_layers(name, kind, monkeypatch):
    """Mamba's, Falcon-Mamba's and Mamba-2's blocks are handed no boundaries (their decoder drops position
    ids): the decoder's own call records them for the mixers, and the probe passes. A state carried over
    one boundary is refused naming what leaked, not attention the model does not have."""
    model = zoo_model(name, [list(range(3, 40))])
    model.set_attn_implementation("padless_varlen")
    assert {hybrid.layer_kind(m) for m in model.modules()} - {None} == {kind}
    info = probe_attention(model, "varlen")
    assert info["max_delta_logps"] <= info["bound"] and info["calls"] == 0
    monkeypatch.setitem(hybrid.RUNNERS, kind, _carrying_over(hybrid.RUNNERS[kind]))
    with pytest.raises(AttentionError) as refused:
        probe_attention(model, "varlen")
    assert (
        ": a layer that carries a state across tokens (backbone.layers.0.mixer, backbone.layers.1.mixer) "
        "leaks between packed sequences (the model has no attention layer): packed, per-token log-probs"
    ) in str(refused.value)
    assert "attention argument" not in str(refused.value)


def test_packed_gradients_equal_each_sequence_alone(probe_seqs):
    """Backward through the regrouped rows: the weight gradient of the packed row's summed log-probs
    equals the sum over each sequence run alone, every element within the bound at the size of the
    largest gradient (round-off flows back through activations every parameter shares)."""
    model = build_zoo_model("qwen3-next", "padless_varlen")
    model.padless_attention = "varlen"
    batch = _packed_batch(probe_seqs)
    forward_packed(model, batch).logps.sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for s in probe_seqs:
        one = _packed_batch([s])
        forward_packed(model, one).logps.sum().backward()
    alone = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert packed.keys() == alone.keys() and any("linear_attn" in n for n in packed)
    limit = bound(torch.float32, max(g.abs().max().item() for g in alone.values()))
    for n, g in packed.items():
        assert (g - alone[n]).abs().max() <= limit, n


def test_without_the_wrapper_a_packed_row_leaks_and_is_refused(probe_seqs):
    """Why the wrapper exists: the same model unwrapped, packed through position ids, carries the state
    from one sequence into the next (far over the bound), and padless refuses to run it; given the
    boundaries, transformers' PyTorch path refuses them (if a release accepts them, revisit the runner)."""
    from transformers import AutoModelForCausalLM

    from padless.proof.zoo import zoo_config

    torch.manual_seed(0)
    raw = AutoModelForCausalLM.from_config(zoo_config("qwen3-next"), attn_implementation="sdpa").eval()
    problem = packing_problem(raw)
    assert problem and "has linear_attention layers, which carry a state" in problem
    # refused where it is proven or put in an engine (its structure), not first at a forward
    with pytest.raises(AttentionError, match="has linear_attention layers, which carry a state"):
        probe_attention(raw, "sdpa")
    with pytest.raises(AttentionError, match="has linear_attention layers, which carry a state"):
        ModelEngine(raw)
    batch = _packed_batch(probe_seqs)
    with torch.no_grad():
        alone = torch.cat(alone_logps(raw, probe_seqs).logps)
        logits = raw(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits[0]
        packed = logits.log_softmax(-1)[:-1].gather(-1, batch.input_ids[0, 1:, None])[:, 0]
        ends = batch.cu_seqlens[1:-1].tolist()
        keep = torch.ones(len(packed), dtype=torch.bool)
        keep[[e - 1 for e in ends]] = False  # the pairs that straddle a boundary
        assert (packed[keep] - alone).abs().max() > 1e-2
        with pytest.raises(ValueError, match="can't keep packed sequences apart"):
            raw(input_ids=batch.input_ids, position_ids=batch.position_ids, **batch.attention_kwargs())
        hybrid.install(raw)
        assert packing_problem(raw) is None


def test_a_deep_copy_reads_its_own_boundaries():
    """Jamba's decoder layer hands its mixer no boundaries: the layer's pre-hook records them for it. A
    deep copy of the model (stale sampling copies the policy) must record them for its own mixer."""
    model = build_zoo_model("jamba", "eager")
    twin = copy.deepcopy(model)
    mixer, twin_mixer = model.model.layers[0].mamba, twin.model.layers[0].mamba
    assert twin_mixer.forward is not mixer.forward and twin_mixer.forward.forward.__self__ is twin_mixer
    positions = torch.tensor([[0, 1, 2, 0, 1]])
    with torch.no_grad():
        twin(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), position_ids=positions, use_cache=False)
    assert twin_mixer.forward.context is None and mixer.forward.context == {}  # the twin's own, used once


def test_boundaries_only_the_decoder_layer_knew_are_not_reused_by_a_recompute(probe_seqs):
    """transformers checkpoints a layer's ``forward``, not ``__call__``: the recompute in backward runs
    without the layer's pre-hook, so Jamba's mixer would see no fresh boundaries. It stops, saying so."""
    model = build_zoo_model("jamba", "padless_varlen").train()
    model.padless_attention = "varlen"
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = _packed_batch([s[:12] for s in probe_seqs])
    out = forward_packed(model, batch).logps.sum()
    with pytest.raises(AttentionError, match=r"set model\.gradient_checkpointing: false"):
        out.backward()


def test_kinds_padless_does_not_cover_stay_refused():
    """RecurrentGemma's recurrent blocks (an RG-LRU) carry a state padless has no runner for: refused."""
    problem = packing_problem(build_zoo_model("recurrent_gemma", "eager"))
    assert problem and "has linear_attention layers, which carry a state" in problem


def test_zero3_on_several_ranks_is_refused_for_a_hybrid_and_nothing_else():
    """ZeRO-3 gathers per layer call; the exact path's call count follows each rank's sequence lengths."""
    qwen35, plain = build_zoo_model("qwen3_5_text", "eager"), build_zoo_model("qwen2", "eager")
    hybrid.install(qwen35)
    problem = hybrid.sharded_problem(qwen35, "zero3", 2)
    assert problem and "ZeRO-3 on 2 processes" in problem and "use FSDP2, DDP or ZeRO-2" in problem
    assert hybrid.sharded_problem(qwen35, "zero3", 1) is None  # one rank: one count
    assert hybrid.sharded_problem(qwen35, "fsdp2", 2) is None
    assert hybrid.sharded_problem(plain, "zero3", 2) is None
