"""The sampling factory: every refused combination of engine, mode and policy in one table, refused before
any model loads; and a sampling mode added from outside through the factory, training GRPO."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest
from safetensors.torch import load_file

from padless.config.loading import load_config
from padless.config.schema import GRPOConfig
from padless.errors import InputError
from padless.proof.load import load_model
from padless.rl import sampling
from padless.rl.generate import Completion
from padless.rl.sample import Sample
from padless.rl.sampler import Request, Sampler
from padless.rl.sampling import Mode, Parts, check_sampling, register_mode
from padless.trainers.grpo import run_grpo

FAST = ["train.logging_steps=1", "train.progress_bar=false", "train.report_to=[jsonl]"]

REFUSED = [
    (["rollout.engine=vllm", "rollout.max_staleness=1"], None, r"max_staleness: 1 with rollout.engine: vllm"),
    (["rollout.engine=vllm"], True, r"vision-language model: padless does not hand images to vLLM"),
    (["rollout.environment=calculator", "rollout.max_staleness=1"], None, "sampled on-policy only"),
    (["rollout.environment=calculator", "rollout.engine=vllm"], None, "vLLM sizes its context"),
    (
        ["rollout.engine=vllm", "rollout.temperature=0.7", "rollout.top_p=0.9"],
        None,
        r"before the temperature or after top-p, never both",
    ),
    (["rollout.routing_replay=true", "rollout.engine=vllm"], None, "does not ask vLLM for the experts"),
    (["rollout.routing_replay=true", "rollout.max_staleness=1"], None, "recorded for single completions"),
]


@pytest.mark.parametrize(("overrides", "vision", "says"), REFUSED)
def test_each_refused_combination_is_refused_in_one_line_with_the_fix(overrides, vision, says):
    with pytest.raises(InputError, match=says) as info:
        check_sampling(load_config(GRPOConfig, None, overrides), vision)
    assert "\n" not in str(info.value) and "; fix: " in str(info.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["rollout.max_staleness=2"],  # hf samples ahead on a copy
        ["rollout.engine=vllm", "rollout.temperature=0.7"],  # log-probs after the temperature
        ["rollout.environment=calculator", "rollout.engine=vllm", "rollout.max_episode_tokens=64"],
        [
            "rollout.engine=vllm",
            "rollout.temperature=0.7",
            "rollout.top_p=0.9",
            "rollout.importance_sampling_correction=false",
        ],
    ],
)
def test_what_the_table_does_not_list_is_allowed(overrides):
    check_sampling(load_config(GRPOConfig, None, overrides), vision=False)


def test_a_refused_combination_stops_the_run_before_any_model_loads(tmp_path, monkeypatch):
    def loads(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("padless.rl.setup.start_session", loads)
    overrides = ["rollout.environment=calculator", "rollout.max_staleness=1", f"train.output_dir={tmp_path}"]
    with pytest.raises(InputError, match="sampled on-policy only"):
        run_grpo(load_config(GRPOConfig, None, overrides))


class Counting(Sampler):
    """A toy mode: the k-th sample of a prompt is its prompt followed by k + 1 copies of one token and EOS,
    drawn without the engine (as a sampler that replays stored completions would)."""

    requests: ClassVar[list[Request]] = []  # every request of the run, in order

    def sample(self, request: Request) -> list[Sample]:
        self.requests.append(request)
        eos = 2  # the embedded tokenizer's
        return [
            self.record(Completion(p.prompt_ids, [100 + k] * (k + 1) + [eos], True), p, request.greedy, 0.01)
            for p in request.prompts
            for k in range(request.group)
        ]


def test_a_mode_registered_through_the_factory_samples_a_grpo_run(tmp_path, monkeypatch):
    """Registered before the built-in modes, the toy mode draws every rollout: the run trains on its
    samples (their lengths in the logs, a reward that tells them apart, a non-zero loss, moved weights)."""
    monkeypatch.setattr(sampling, "MODES", list(sampling.MODES))
    monkeypatch.setattr(Counting, "requests", [])
    register_mode(Mode("counting", lambda cfg: True, lambda parts: Counting(parts.engine, parts.cfg.rollout)))
    assert sampling.MODES[0].name == "counting" and isinstance(
        sampling.make_sampler(
            Parts(load_config(GRPOConfig, None, []), None, None, None, None, lambda e: None)
        ),
        Counting,
    )
    variety = tmp_path / "variety.py"
    variety.write_text(
        "def variety(prompts, completions, **fields):\n    return [len(c) for c in completions]\n"
    )
    overrides = [
        "model.name=tiny-llama",
        f"train.output_dir={tmp_path / 'run'}",
        "train.max_steps=2",
        "train.learning_rate=1e-2",
        f"reward.functions=[{variety}:variety]",
        "rollout.prompts_per_step=2",
        "rollout.num_generations=3",
        *FAST,
    ]
    metrics = run_grpo(load_config(GRPOConfig, None, overrides))
    assert [(len(r.prompts), r.group, r.epoch) for r in Counting.requests] == [(2, 3, 0), (2, 3, 1)]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rollouts = [r for r in records if "rollout/reward" in r]
    assert [r["rollout/completion_length"] for r in rollouts] == [3.0, 3.0]  # 2, 3 and 4 tokens
    assert all(r["rollout/reward_std"] > 0 for r in rollouts) and metrics["train/loss"] != 0
    before = load_model("tiny-llama", probe=False).state_dict()
    after = load_file(tmp_path / "run" / "checkpoint-2" / "model.safetensors")
    assert max((after[k] - before[k]).abs().max().item() for k in after) > 1e-4
