"""A verifiers taskset built in code as padless prompt rows (``data.train: verifiers:<file>:<name>``) and its
tasks as padless episodes (``rollout.environment: verifiers``): each episode opens with the task's messages
and its reward is verifiers' own scoring of the task's rubric (weights included); a taskset that changed
since the rows were made is refused; ``padless grpo`` trains on it."""

from __future__ import annotations

import json

import pytest

from padless.data import load_rows
from padless.errors import DataError, InputError
from padless.rl.environments import Turn, load_environment

pytest.importorskip("verifiers")

TASKSET = """
import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply.strip() == task.answer)

    @vf.reward(weight=0.5)
    async def has_digit(self, trace) -> float:
        return float(any(ch.isdigit() for ch in trace.last_reply))


class Sums(vf.Taskset[SumTask]):
    def load(self):
        for a in range(N):
            system = "Answer with the number only." if a % 2 else None
            data = SumData(prompt=f"What is {a} + {a + 1}?", answer=str(2 * a + 1), system_prompt=system)
            yield SumTask(data)


def make():
    return Sums(vf.TasksetConfig(id="sums"))


not_a_taskset = [1, 2]
"""


def taskset_file(tmp_path, n: int = 4):
    path = tmp_path / "sums.py"
    path.write_text(TASKSET.replace("range(N)", f"range({n})"))
    return path


def test_episodes_open_with_the_task_and_are_scored_by_its_rubric(tmp_path):
    spec = f"verifiers:{taskset_file(tmp_path)}:make"
    rows = [r.data for r in load_rows(spec)]
    assert [r["prompt"] for r in rows] == [f"What is {a} + {a + 1}?" for a in range(4)]
    env_class = load_environment("verifiers")
    first, second = env_class(rows[0]), env_class(rows[1])
    assert first.reset() == [{"role": "user", "content": "What is 0 + 1?"}]
    assert second.reset() == [
        {"role": "system", "content": "Answer with the number only."},
        {"role": "user", "content": "What is 1 + 2?"},
    ]
    # correct (weight 1) + has_digit (weight 0.5), as the rubric says
    for text, reward in [("3", 1.5), (" 3\n", 1.5), ("4", 0.5), ("three", 0.0)]:
        step = second.step(Turn(index=0, text=text, token_ids=[]))
        assert step.done and not step.messages and step.reward == reward, text


def test_a_changed_taskset_a_row_without_its_task_and_a_wrong_spec_are_refused(tmp_path):
    path = taskset_file(tmp_path)
    row = load_rows(f"verifiers:{path}:make")[3].data
    env_class = load_environment("verifiers")
    with pytest.raises(InputError, match="task 3 is not the one this row was made from"):
        env_class({**row, "verifiers": {**row["verifiers"], "key": "0" * 64}})  # planted: another task
    with pytest.raises(InputError, match="task 7 is not the one"):
        env_class({**row, "verifiers": {**row["verifiers"], "idx": 7}})
    with pytest.raises(InputError, match="reads each row's 'verifiers' column"):
        env_class({"prompt": "What is 1 + 2?"})
    with pytest.raises(DataError, match="not_a_taskset is a list, not a verifiers Taskset"):
        load_rows(f"verifiers:{path}:not_a_taskset")
    with pytest.raises(DataError, match=r"cannot be loaded \(AttributeError"):
        load_rows(f"verifiers:{path}:nothing")


@pytest.mark.slow
def test_a_verifiers_taskset_trains_through_padless_grpo(tmp_path, capsys):
    """The rubric is the only reward (no reward functions): every rollout's mean reward is one the rubric
    can give (0, 0.5 or 1.5 per episode, averaged over 8), and the run trains two steps."""
    from padless.cli import main

    spec = f"verifiers:{taskset_file(tmp_path, 8)}:make"
    out = tmp_path / "run"
    overrides = [
        "model.name=tiny-llama-arith",
        f"data.train={spec}",
        "rollout.environment=verifiers",
        "reward.functions=[]",
        "rollout.max_new_tokens=8",
        "rollout.prompts_per_step=2",
        "rollout.num_generations=4",
        "train.max_steps=2",
        "train.logging_steps=1",
        "train.progress_bar=false",
        f"train.output_dir={out}",
    ]
    assert main(["grpo", *overrides]) == 0, capsys.readouterr().err
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rollouts = [r for r in records if "rollout/reward" in r]
    assert len(rollouts) == 2 and [r["step"] for r in records if "train/loss" in r] == [1, 2]
    for r in rollouts:
        assert r["rollout/reward"] == r["rollout/reward/environment"]
        assert round(r["rollout/reward"] * 8 / 0.5, 6).is_integer() and 0 <= r["rollout/reward"] <= 1.5
