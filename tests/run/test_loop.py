"""The shared loop's optimizer groups and how it counts steps."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator

from padless.config.schema import TrainSettings
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
