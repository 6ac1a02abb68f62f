"""Routing replay: the experts a mixture of experts routed each token to are recorded and forced again
exactly; what cannot be replayed exactly is refused."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_moe import modeling_qwen3_moe

from padless.errors import InputError
from padless.forward import routing
from padless.forward.engine import forward_packed, use_backend
from padless.forward.packing import Example, pack
from padless.proof.zoo import build_zoo_model
from padless.rl.generate import generate


def recorded(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's logits on ``ids`` and the routes it took ``[T, routers, k]``."""
    with torch.no_grad(), routing.recording(model) as rec:
        logits = model(input_ids=ids).logits
    return logits, torch.stack([calls[0] for calls in rec.calls], dim=1)


@pytest.mark.parametrize("name", ["qwen3-moe", "gpt-oss"])
def test_replaying_a_models_own_routes_changes_nothing_and_other_routes_change_it(name):
    """Qwen3-MoE normalises its top-k probabilities, gpt-oss soft-maxes its top-k logits: both compute
    their weights for replayed experts with their own code. Rows marked -1 route as the router chooses."""
    model = build_zoo_model(name, "eager")
    routing.check_replayable(model)
    ids = torch.randint(0, 4000, (1, 12), generator=torch.Generator().manual_seed(0))
    logits, routes = recorded(model, ids)
    assert routes.shape == (12, 2, 2)
    other = (routes + 1) % 4
    other[:6] = -1  # the first half routes freely
    with torch.no_grad():
        with routing.replaying(model, routes):
            again = model(input_ids=ids).logits
        with routing.replaying(model, other):
            moved = model(input_ids=ids).logits
    assert torch.equal(again, logits)
    assert torch.equal(moved[0, :6], logits[0, :6]) and (moved[0, 6:] - logits[0, 6:]).abs().max() > 0.1


class TwoStageRouter(modeling_qwen3_moe.Qwen3MoeTopKRouter):
    """A router choosing in two top-k steps (as group-limited routers do): not one choice to replay."""

    def forward(self, hidden_states):
        logits, scores, indices = super().forward(hidden_states)
        torch.topk(logits, 1, dim=-1)
        return logits, scores, indices


def test_what_cannot_be_replayed_exactly_is_refused():
    with pytest.raises(InputError, match="has no expert routers"):
        routing.check_replayable(build_zoo_model("qwen3", "eager"))
    model = build_zoo_model("qwen3-moe", "eager")
    for layer in model.model.layers:
        layer.mlp.gate.__class__ = TwoStageRouter
    with pytest.raises(InputError, match="TwoStageRouter chose its experts with 2 top-k selections"):
        routing.check_replayable(model)


def test_generate_records_the_routes_the_packed_forward_replays(tokenizer):
    """The routes ``generate`` records (left-padded prefill, then one decoded token at a time) are those
    the packed forward takes on the same tokens (fp32: no flips), the last token never fed (-1); the
    replayed packed forward routes exactly as recorded."""
    model = build_zoo_model("qwen3-moe", "padless_varlen")
    use_backend(model, "varlen")
    prompts = [[11, 12, 13], [21, 22, 23, 24, 25, 26, 27]]
    out = generate(model, tokenizer, prompts, max_new_tokens=6, seeds=[1, 2], routes=True)
    for c in out:
        ids = c.prompt_ids + c.completion_ids
        assert c.routes.shape == (len(ids), 2, 2)
        assert (c.routes[-1] == -1).all() and (c.routes[:-1] >= 0).all()
        batch = pack([Example(ids)])
        with torch.no_grad(), routing.recording(model) as rec:
            forward_packed(model, batch)
        packed = torch.stack([calls[0] for calls in rec.calls], dim=1)
        assert torch.equal(packed[:-1], c.routes[:-1])
        forced = (c.routes + 1) % 4
        forced[-1] = -1
        batch.routes = forced
        with torch.no_grad(), routing.recording(model) as rec, routing.replaying(model, forced):
            forward_packed(model, batch)
        assert torch.equal(torch.stack([calls[0] for calls in rec.calls], dim=1)[:-1], forced[:-1])
