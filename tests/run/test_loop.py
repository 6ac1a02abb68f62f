"""The shared loop's optimizer groups and how it counts steps."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator

from padless.config.schema import TrainSettings
from padless.forward.engine import ModelEngine, use_backend
from padless.forward.packing import Example, pack
from padless.losses import sft_token_weights
from padless.proof.check import zoo_model
from padless.run.loop import MicroBatch, Recipe, Trainer, parameter_groups, plan_steps


class Pair(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.policy, self.value = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
        self.value.bias.requires_grad_(False)


def test_parameter_groups_split_decay_and_learning_rates():
    model = Pair()
    groups = parameter_groups(model, lr=1e-5, weight_decay=0.1, learning_rates={"value.": 1e-3})
    got = {(g["lr"], g["weight_decay"]): [p.shape for p in g["params"]] for g in groups}
    assert got == {
        (1e-5, 0.1): [torch.Size([3, 3])],  # policy weight
        (1e-5, 0.0): [torch.Size([3])],  # policy bias: no decay
        (1e-3, 0.1): [torch.Size([1, 3])],  # value weight; its frozen bias is left out
    }


class Stated(Recipe):
    """A recipe that says it plans 3 steps per epoch and plans 2."""

    def steps_per_epoch(self) -> int:
        return 3

    def plan(self, epoch: int) -> list[MicroBatch]:
        return [MicroBatch(None, 1, 1, step=s) for s in range(2)]


def test_a_recipe_planning_other_than_it_stated_is_stopped(tmp_path):
    settings = TrainSettings(output_dir=str(tmp_path), max_steps=6)
    trainer = Trainer(Stated(), Pair(), None, settings, Accelerator(cpu=True))
    assert trainer.total_steps == 6  # counted without planning
    with pytest.raises(RuntimeError, match="stated 3 steps per epoch but planned 2"):
        trainer.steps_of(0)


class Growing(Recipe):
    """A recipe whose epoch ``e`` plans ``2 + e`` steps, as token-budget packing can differ per epoch."""

    def plan(self, epoch: int) -> list[MicroBatch]:
        return [MicroBatch(None, 1, 1) for _ in range(2 + epoch)]


@pytest.mark.parametrize(("epochs", "total"), [(1, 2), (2, 5), (2.5, 7), (0.5, 1)])
def test_steps_are_counted_on_every_epochs_own_plan(tmp_path, epochs, total):
    settings = TrainSettings(output_dir=str(tmp_path), num_epochs=epochs)
    assert Trainer(Growing(), Pair(), None, settings, Accelerator(cpu=True)).total_steps == total


@pytest.mark.parametrize(
    ("count", "ranks", "accumulation", "numbered"), [(13, 4, 1, False), (5, 2, 2, False), (7, 3, 1, True)]
)
def test_every_rank_runs_the_same_number_of_micro_batches_in_every_step(count, ranks, accumulation, numbered):
    """Sharded engines deadlock on uneven counts (13 micro-batches on 4 ranks used to give [1, 1, 1, 2]):
    each rank gets as many micro-batches as the busiest one, fillers with weight 0; every real micro-batch
    is run exactly once with weight 1 and the step's normaliser and token count are the whole step's."""
    micros = [
        MicroBatch(i, units=i + 1, tokens=10 * (i + 1), step=(i // 3 if numbered else None))
        for i in range(count)
    ]
    plans = [plan_steps(micros, accumulation, ranks, rank) for rank in range(ranks)]
    assert len({len(p) for p in plans}) == 1
    real = []
    for s in range(len(plans[0])):
        steps = [p[s] for p in plans]
        assert len({len(step.micros) for step in steps}) == 1, [len(step.micros) for step in steps]
        assert len({(step.normaliser, step.tokens) for step in steps}) == 1
        done = [m.data for step in steps for m in step.micros if m.scale == 1.0]
        assert steps[0].normaliser == sum(i + 1 for i in done)
        assert all(m.scale in (0.0, 1.0) for step in steps for m in step.micros)
        real += done
    assert sorted(real) == list(range(count))
    assert any(m.scale == 0.0 for p in plans for step in p for m in step.micros)  # fillers were needed


class Whole(Recipe):
    """SFT over fixed micro-batches of one sequence each (every token a target), two per step."""

    def __init__(self, seqs: list[list[int]]):
        self.seqs = seqs

    def plan(self, epoch: int) -> list[MicroBatch]:
        return [MicroBatch([s], len(s) - 1, len(s)) for s in self.seqs]

    def loss(self, model, micro, normaliser):
        batch = pack([Example(s, [True] * len(s)) for s in micro.data])
        loss = model(
            batch, logps=True, logp_weights=sft_token_weights(batch.loss_mask[0], normaliser)
        ).weighted
        return loss, {"loss": loss.item()}


def test_a_mixture_of_experts_router_loss_is_weighted_by_each_micro_batchs_tokens(probe_seqs, tmp_path):
    """One step of two micro-batches of a MoE with a load-balancing term: the loop adds
    coef * sum_m aux_m T_m / T to the loss (T_m the micro-batch's tokens, T the step's), logs
    sum_m aux_m T_m / T as aux_loss, and the step's gradient is that of the sum (recomputed by hand)."""
    model = zoo_model("qwen3-moe", probe_seqs)
    model.config.output_router_logits, model.router_aux_loss_coef = True, 0.02
    use_backend(model, "varlen")
    engine = ModelEngine(model)
    settings = TrainSettings(
        output_dir=str(tmp_path), max_steps=1, gradient_accumulation_steps=2, max_grad_norm=0
    )
    trainer = Trainer(Whole(probe_seqs[:2]), engine, None, settings, Accelerator(cpu=True))
    step = trainer.steps_of(0)[0]
    seqs = [m.data[0] for m in step.micros]
    tokens, targets = sum(len(s) for s in seqs), sum(len(s) - 1 for s in seqs)
    expected = 0.0
    for s in seqs:  # by hand, before the step changes the weights
        batch = pack([Example(s, [True] * len(s))])
        with engine.recording() as routed:
            nll = engine(
                batch, logps=True, logp_weights=sft_token_weights(batch.loss_mask[0], targets)
            ).weighted
        (nll + routed.weighted / tokens).backward()
        expected += routed.plain / tokens
    router = model.model.layers[0].mlp.gate.weight
    by_hand, router.grad = router.grad.clone(), None
    seen = {}
    trainer.optimizer.optimizer.register_step_pre_hook(lambda *_: seen.update(grad=router.grad.clone()))
    metrics = trainer._train_step(step)
    assert metrics["aux_loss"] == pytest.approx(expected, rel=1e-6) and expected > 1.0
    assert torch.allclose(seen["grad"], by_hand, atol=1e-7) and by_hand.abs().max() > 1e-4
