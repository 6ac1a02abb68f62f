"""A mixture of experts' own objective: padless's loss on a sequence alone is the model's own
``forward(labels=...).loss`` (load-balancing term included), and on a packed row the router loss is the
model's own over the real tokens of the batch, never over padding.

Model: a tiny Qwen3-MoE (4 experts top-2) with ``output_router_logits`` on and a coefficient large enough
that the term is far above round-off (0.02 x ~2: hundreds of times the bound), head scaled to |logit| 30.
"""

from __future__ import annotations

import pytest
import torch

from padless.errors import InputError
from padless.forward.engine import BatchLayout, EngineSettings, ModelEngine, use_backend
from padless.forward.packing import Example, pack, to_padded
from padless.forward.routers import RouterLoss
from padless.losses import load_balancing_loss, sft_token_weights
from padless.proof.check import alone_logps, zoo_model
from padless.proof.probe import bound
from padless.proof.zoo import build_zoo_model

COEF = 0.02


def moe(name: str, seqs: list[list[int]], coef: float = COEF) -> torch.nn.Module:
    model = zoo_model(name, seqs)
    model.config.output_router_logits = True
    model.config.router_aux_loss_coef = model.router_aux_loss_coef = coef  # its forward copied it at init
    use_backend(model, "varlen")
    return model


def own(model: torch.nn.Module, ids: torch.Tensor, **kwargs):
    """The model's own forward with labels, on eager attention (its reference computation)."""
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return model(input_ids=ids, labels=ids, output_router_logits=True, **kwargs)
    finally:
        use_backend(model, "varlen")


def sft_loss(engine: ModelEngine, seqs: list[list[int]]) -> tuple[torch.Tensor, float]:
    """padless's SFT loss of ``seqs`` as one micro-batch that is a whole step (every token a target), as
    the loop adds the router term; and the router loss alone."""
    batch = pack([Example(s, [True] * len(s)) for s in seqs])
    weights = sft_token_weights(batch.loss_mask[0], batch.loss_mask.sum().item())
    with engine.recording() as routed:
        nll = engine(batch, logps=True, logp_weights=weights).weighted
    return nll + routed.weighted / batch.num_tokens, routed.plain / batch.num_tokens


@pytest.fixture(scope="module")
def qwen3_moe(probe_seqs) -> torch.nn.Module:
    return moe("qwen3-moe", probe_seqs)


def test_loss_of_a_sequence_alone_is_the_models_own(qwen3_moe, probe_seqs):
    """(Every MoE of the zoo is compared the same way by the load-time probe: tests/proof/test_zoo.py.)"""
    model = qwen3_moe
    engine = ModelEngine(model)
    for seq in probe_seqs:
        ours, aux = sft_loss(engine, [seq])
        theirs = own(model, torch.tensor([seq]))
        limit = bound(torch.float32, alone_logps(model, [seq]).magnitude)
        assert COEF * theirs.aux_loss.item() > 300 * limit  # the term matters: leaving it out fails
        assert aux == pytest.approx(theirs.aux_loss.item(), abs=limit)
        assert ours.item() == pytest.approx(theirs.loss.item(), abs=limit)


def test_router_loss_of_a_packed_row_counts_real_tokens_only(qwen3_moe, probe_seqs, pad_id):
    """Packed: the model's own router loss of the batch padded with its mask (real tokens), in the engine's
    packed and padded layouts alike; counting padding (the mask left out) moves it far off."""
    model = qwen3_moe
    engine = ModelEngine(model)
    batch = pack([Example(s, [True] * len(s)) for s in probe_seqs])
    padded = to_padded(batch, "right", pad_id)
    theirs = own(model, padded.input_ids, attention_mask=padded.attention_mask).aux_loss.item()
    with_pads = own(model, padded.input_ids).aux_loss.item()
    recorded = {}
    for side in (None, "right", "left"):
        with engine.recording() as routed:
            engine(batch, layout=BatchLayout(side, pad_id), logps=True)
        recorded[side] = routed.plain / batch.num_tokens
    assert recorded[None] == pytest.approx(theirs, abs=1e-5)
    assert recorded["right"] == pytest.approx(theirs, abs=1e-5)
    assert recorded["left"] == pytest.approx(theirs, abs=1e-5)
    assert abs(with_pads - theirs) > 1e-3
    with torch.no_grad(), engine.recording() as routed:  # passes without gradients train nothing
        engine(batch, logps=True)
    assert routed.weighted is None


def test_load_balancing_loss_is_the_switch_formula():
    """num_experts * sum_e f_e P_e by hand, over two layers of three tokens."""
    logits = (torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.5], [0.0, 0.0, 3.0]]), torch.zeros(3, 3))
    probs = torch.cat([t.softmax(-1) for t in logits])
    chosen = [0, 1, 2, 0, 0, 0]  # top-1 of each row; ties take the first expert, as torch.topk does
    f = torch.bincount(torch.tensor(chosen), minlength=3).float() / 6
    assert load_balancing_loss(logits, 3, 1).item() == pytest.approx(3 * (f * probs.mean(0)).sum().item())


def test_the_coefficient_is_the_configs_or_the_override(qwen3_moe):
    model = qwen3_moe
    assert RouterLoss.of(model).coef == COEF and RouterLoss.of(model, 0.5).coef == 0.5
    off = RouterLoss.of(model, 0.0)
    assert "the router load-balancing loss is off (model.router_aux_loss_coef: 0)" in off.describe("m", 0.0)
    engine = ModelEngine(model, settings=EngineSettings(router_aux_loss_coef=0.0))
    with engine.recording() as routed:
        assert routed is None  # nothing recorded, nothing added
    dense = build_zoo_model("qwen3", "eager")
    with pytest.raises(InputError, match="adds no router load-balancing loss to its objective"):
        RouterLoss.of(dense, 0.01)
    assert RouterLoss.of(dense) is None
