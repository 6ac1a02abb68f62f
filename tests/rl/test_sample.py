"""The typed sample record: every field of every group survives a checkpoint as JSON, a misspelt field is
refused where it is written, and the rollout metrics read the fields they name."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from padless.rl.sample import GROUPS, Algorithm, Drawn, EpisodeStats, Passes, Sample, Scored, summary


def full_sample() -> Sample:
    """A sample whose every field holds something other than its default (checked below)."""
    drawn = Drawn(
        prompt_row=7,
        prompt_length=3,
        length=4,
        finished=False,
        text="the last turn",
        logps=[-0.5, -1.25],
        sampling_s=0.75,
        staleness=1,
        episode=EpisodeStats(2, 3, 1, 5, 0.5, "max_turns"),
        env_images=["iVBORw0KGgo="],
        routes=[[[t % 4, (t + 1) % 4]] for t in range(7)],  # one router, top-2, per token
    )
    return Sample(
        [5, 6, 7, 8, 9, 10, 11],
        [False, False, False, True, True, False, False],
        drawn=drawn,
        scored=Scored(1.5, {"variety": 2.0, "environment": None}),
        passes=Passes([-0.5, -1.0], [-0.75, -1.5], [0.25, 0.125], [-0.5, -1.125]),
        algorithm=Algorithm([0.5, 0.5], [1.0, 2.0], [1.0, 0.75], 0.0),
    )


def test_every_field_survives_a_checkpoint_as_json():
    sample = full_sample()
    defaults = Sample([0])
    for name in GROUPS:  # the test sample sets every field, so a field the state drops shows below
        group, default = getattr(sample, name), getattr(defaults, name)
        for f in dataclasses.fields(group):
            assert getattr(group, f.name) != getattr(default, f.name), (name, f.name)
    saved = json.loads(json.dumps(sample.state()))
    back = Sample.from_state(saved)
    assert back.state() == sample.state()
    assert (back.input_ids, back.loss_mask, back.num_targets) == (sample.input_ids, sample.loss_mask, 2)
    assert isinstance(back.drawn.episode, EpisodeStats) and back.completion_ids == [8, 9, 10, 11]


def test_a_dropped_field_fails_the_round_trip(monkeypatch):
    """Planted: a state that leaves out the algorithm group comes back with other numbers (or not at all)."""
    sample = full_sample()
    state = sample.state()
    state["algorithm"] = {}
    assert Sample.from_state(state).state() != sample.state()
    del state["algorithm"]
    with pytest.raises(KeyError):
        Sample.from_state(state)


def test_a_misspelt_field_is_refused_where_it_is_written():
    sample = full_sample()
    with pytest.raises(AttributeError):
        sample.passes.old_logp = [0.0]  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):  # as the recipe's store writes a pass it names
        setattr(sample.passes, "ref_logp", [0.0])  # noqa: B010


def test_rollout_metrics_read_rewards_parts_lengths_staleness_and_episodes():
    a, b = full_sample(), full_sample()
    b.scored = Scored(-0.5, {"variety": None, "environment": 1.0})
    b.drawn.length, b.drawn.finished, b.drawn.staleness = 2, True, 0
    metrics = summary([a, b], "rollout/")
    assert metrics["rollout/reward"] == 0.5
    assert metrics["rollout/reward_std"] == pytest.approx(torch.tensor([1.5, -0.5]).std().item())
    assert metrics["rollout/reward/variety"] == 2.0 and metrics["rollout/reward/environment"] == 1.0
    assert metrics["rollout/completion_length"] == 3.0 and metrics["rollout/truncated_fraction"] == 0.5
    assert metrics["rollout/tokens_per_s"] == 6 / 0.75
    assert (metrics["rollout/staleness_mean"], metrics["rollout/staleness_max"]) == (0.5, 1.0)
    assert metrics["rollout/turns"] == 2 and metrics["rollout/tool_call_success"] == 2 / 3
