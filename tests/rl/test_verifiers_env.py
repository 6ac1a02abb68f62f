"""A verifiers taskset built in code as padless prompt rows (``data.train: verifiers:<file>:<name>``) and its
tasks as padless episodes (``rollout.environment: verifiers``): each episode opens with the task's messages
and its reward is verifiers' own scoring of the task's rubric (weights included); a taskset that changed
since the rows were made is refused; ``padless grpo`` trains on it. A taskset whose tasks bring a tool
server (a ``vf.Toolset``) and an ``Env`` that answers a wrong answer with a user turn play their tool and
environment turns in the episode (never in the loss), and the reward is verifiers' score of the whole
conversation."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from padless.data import load_rows
from padless.errors import DataError, InputError, UserCodeError
from padless.rl.environments import Turn, load_environment
from padless.rl.generate import Completion

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
    first.close(), second.close()
    # correct (weight 1) + has_digit (weight 0.5), as the rubric says
    for text, reward in [("3", 1.5), (" 3\n", 1.5), ("4", 0.5), ("three", 0.0)]:
        env = env_class(rows[1])
        env.reset()
        step = env.step(Turn(index=0, text=text, token_ids=[]))
        env.close()
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
    with pytest.raises(DataError, match="not_a_taskset is a list, not a verifiers Taskset or Env"):
        load_rows(f"verifiers:{path}:not_a_taskset")
    with pytest.raises(DataError, match=r"cannot be loaded \(AttributeError"):
        load_rows(f"verifiers:{path}:nothing")


# A taskset whose tasks bring a calculator tool server, and an Env over it that tells a wrong first answer
# so (a user turn) and takes a second one; its finalize records a penalty for the retry.
CALCULATOR = """
import verifiers.v1 as vf

from padless.data import load_rows
from padless.rl.environments import calculate
from padless.rl.rewards import first_number


class Calculator(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # the model calls it "calculate", as tiny-llama-calc learnt to

    @vf.tool
    async def calculate(self, expression: str) -> str:
        \"\"\"Compute two numbers joined by an operator, e.g. "26 + 19" or "47 minus 35".\"\"\"
        return calculate(expression)


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @classmethod
    def toolsets(cls, config):
        return [Calculator(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def correct(self, task, trace) -> float:
        return float(first_number(trace.last_reply) == first_number(task.answer))

    @vf.reward(weight=0.5)
    async def used_the_tool(self, trace) -> float:
        return float(any(m.role == "tool" and not str(m.content).startswith("error") for m in trace.messages))


class Sums(vf.Taskset[SumTask]):
    def load(self):
        for row in load_rows("tiny:rl[:6]"):
            yield SumTask(SumData(prompt=row.data["prompt"], answer=row.data["answer"]))


class TeacherConfig(vf.EnvConfig):
    student: vf.AgentConfig = vf.AgentConfig()


class Teacher(vf.Env[TeacherConfig]):
    async def setup(self, agents):
        agents.student.trainable = STUDENT_TRAINS

    async def run(self, task, agents):
        async with agents.student.interaction(task) as chat:
            reply = await chat.turn()
            if first_number(reply.last_reply) != first_number(task.data.answer):
                await chat.turn("That is not right. Try again: just the number.")

    async def finalize(self, task, episode):
        for trace in episode.traces:
            trace.record_reward("retried", float(trace.num_turns > 1), weight=-0.25)


__all__ = ["Sums"]


def tools():
    return Sums(vf.TasksetConfig(id=__name__))


def teacher():
    return Teacher(TeacherConfig(taskset=vf.TasksetConfig(id=__name__)))
"""
CALL = '<call>{"name": "calculate", "arguments": {"expression": "26 + 19"}}</call>'
RETRY = "That is not right. Try again: just the number."


@pytest.fixture(scope="module")
def calculator(tmp_path_factory):
    """The calculator module as a file (its module name is verifiers' taskset id)."""
    path = tmp_path_factory.mktemp("vf") / "calculator.py"
    path.write_text(CALCULATOR.replace("STUDENT_TRAINS", "True"))
    return path


class Scripted:
    """An engine answering every episode's turns with fixed texts (log-prob -1 per token)."""

    def __init__(self, tok, turns: list[str]):
        self.tok, self.turns, self.calls = tok, turns, 0

    def complete(self, prompts, n, seeds, greedy=False, vision=None):
        self.calls += 1
        ids = self.tok(self.turns[self.calls - 1], add_special_tokens=False)["input_ids"] + [
            self.tok.eos_token_id
        ]
        return [Completion(p, list(ids), True, [-1.0] * len(ids)) for p in prompts]


def episodes(tok, spec: str, rows, engine, **settings):
    from padless.config.loading import load_config
    from padless.config.schema import GRPOConfig
    from padless.rl.episodes import make_runner

    overrides = ["rollout.environment=verifiers", "rollout.max_new_tokens=64", f"data.train={spec}"]
    rollout = load_config(GRPOConfig, None, overrides + [f"rollout.{k}={v}" for k, v in settings.items()])
    runner = make_runner(tok, rollout.rollout, {tok.eos_token_id}, None, [spec])
    return runner, runner.run(engine, rows, list(range(len(rows))), greedy=False)


def conversation(text: str) -> list[dict]:
    """A rendered episode read back by the embedded template's role markers (no padless code involved)."""
    turns = re.findall(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>", text, re.S)
    return [{"role": role, "content": content} for role, content in turns if role != "system"]


def verifiers_score(spec: str, idx: int, messages: list[dict]) -> float:
    """verifiers' own score of a conversation: the task's rubric on its trace, then the Env's finalize."""
    import verifiers.v1 as vf
    from pydantic import TypeAdapter

    from padless.data.procedural import verifiers_source

    env, _, tasks = verifiers_source(spec)
    task, read = tasks[idx], TypeAdapter(vf.Message)
    typed = [{**m, "tool_call_id": "call"} if m["role"] == "tool" else m for m in messages]
    nodes = [
        vf.MessageNode(
            parent=i - 1 if i else None, message=read.validate_python(m), sampled=m["role"] == "assistant"
        )
        for i, m in enumerate(typed)
    ]
    data = vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash)
    trace = vf.Trace(task=data, agent=vf.AgentInfo(config=vf.AgentConfig()), nodes=nodes)
    asyncio.run(task.score(trace))
    if env is not None:
        asyncio.run(env.finalize(task, vf.Episode(task=data, traces=[trace])))
    return trace.reward


def test_a_tool_server_and_an_env_play_their_turns_and_verifiers_scores_the_conversation(
    tokenizer, calculator
):
    """The tool call runs on the task's own tool server (its MCP schema is what the template shows), the
    Env's user turn follows a wrong answer; both are environment tokens; the reward is verifiers' score."""
    tools, teacher = f"verifiers:{calculator}:tools", f"verifiers:{calculator}:teacher"
    row = load_rows(tools)[1].data  # What is 26 + 19?
    runner, [e] = episodes(tokenizer, tools, [row], Scripted(tokenizer, [CALL, "45"]))
    [schema] = runner.tools.schemas
    assert schema["function"]["name"] == "calculate" and schema["function"]["parameters"]["required"] == [
        "expression"
    ]
    said = conversation(tokenizer.decode(e.prompt_ids + e.ids))
    assert said[1:] == [
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": "45"},
        {"role": "assistant", "content": "45"},
    ]
    assert e.reward == verifiers_score(tools, 1, said) == 1.5  # correct + used the tool
    env_ids = [t for t, m in zip(e.ids, e.model, strict=True) if not m]
    assert tokenizer.decode(env_ids) == "\n<|im_start|>tool\n45<|im_end|>\n<|im_start|>assistant\n"

    row = load_rows(teacher)[1].data
    _, [e] = episodes(tokenizer, teacher, [row], Scripted(tokenizer, ["44", CALL, "45"]))
    said = conversation(tokenizer.decode(e.prompt_ids + e.ids))
    assert [m["role"] for m in said] == ["user", "assistant", "user", "assistant", "tool", "assistant"]
    assert said[2]["content"] == RETRY and said[4]["content"] == "45"
    assert e.reward == verifiers_score(teacher, 1, said) == 1 + 0.5 - 0.25
    model = tokenizer.decode([t for t, m in zip(e.ids, e.model, strict=True) if m])
    assert model == "44<|im_end|>" + CALL + "<|im_end|>45<|im_end|>"  # every other token is the environment's


def test_a_seat_a_box_or_tool_state_padless_cannot_play_and_an_env_that_never_asks_are_refused(
    tokenizer, tmp_path
):
    path = tmp_path / "untrained.py"
    path.write_text(CALCULATOR.replace("STUDENT_TRAINS", "False"))
    spec = f"verifiers:{path}:teacher"
    with pytest.raises(UserCodeError, match="seat 'student' is marked untrainable by the Env"):
        episodes(tokenizer, spec, [load_rows(spec)[0].data], Scripted(tokenizer, ["1"]))
    path = tmp_path / "silent.py"
    path.write_text(
        CALCULATOR.replace("STUDENT_TRAINS", "True").replace("reply = await chat.turn()", "return")
    )
    spec = f"verifiers:{path}:teacher"
    with pytest.raises(UserCodeError, match="the environment ended before the model's first turn"):
        episodes(tokenizer, spec, [load_rows(spec)[0].data], Scripted(tokenizer, ["1"]))
    path = tmp_path / "boxed.py"  # an agent program's box has nothing to run in: refused, not dropped
    path.write_text(
        CALCULATOR.replace("STUDENT_TRAINS", "True").replace("(task) as chat", "(task, runtime=1) as chat")
    )
    spec = f"verifiers:{path}:teacher"
    with pytest.raises(
        UserCodeError, match="seat 'student' is handed runtime: resources of a verifiers agent"
    ):
        episodes(tokenizer, spec, [load_rows(spec)[0].data], Scripted(tokenizer, ["1"]))
    path = tmp_path / "stateful.py"  # a tool server whose state verifiers carries between calls: refused
    stateful = (
        "class Memo(vf.State):\n    n: int = 0\n\n\nclass Calculator(vf.Toolset[vf.ToolsetConfig, Memo]):"
    )
    path.write_text(CALCULATOR.replace("class Calculator(vf.Toolset[vf.ToolsetConfig]):", stateful))
    spec = f"verifiers:{path}:tools"
    with pytest.raises(InputError, match=r"tool server Calculator keeps state between calls \(Memo\)"):
        episodes(tokenizer, spec, [load_rows(spec)[0].data], Scripted(tokenizer, ["1"]))


@pytest.mark.slow
def test_a_verifiers_env_with_a_tool_server_trains_through_padless_grpo(
    tmp_path, calculator, tokenizer, monkeypatch
):
    """tiny-llama-calc plays the Teacher over the calculator taskset, verifiers' rubric the only reward, for
    two steps. Every sample trained: its targets are exactly the model's turns (the user's and the tool's
    turns are context), and its reward is verifiers' own score of its conversation, read back from its ids.
    The episodes hold both kinds of environment turns (measured: 10 of 12 retried, 2 called the tool)."""
    from padless.cli import main
    from padless.data.procedural import verifiers_tasks
    from padless.trainers.grpo import GRPORecipe

    trained, process = [], GRPORecipe.process
    monkeypatch.setattr(
        GRPORecipe, "process", lambda self, s, epoch: trained.extend(s) or process(self, s, epoch)
    )
    spec = f"verifiers:{calculator}:teacher"
    out = tmp_path / "run"
    overrides = [
        "model.name=tiny-llama-calc",
        f"data.train={spec}",
        "rollout.environment=verifiers",
        "reward.functions=[]",
        "rollout.max_new_tokens=64",
        "rollout.prompts_per_step=3",
        "rollout.num_generations=2",
        "train.max_steps=2",
        "train.logging_steps=1",
        "train.progress_bar=false",
        f"train.output_dir={out}",
    ]
    assert main(["grpo", *overrides]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == [1, 2]
    prompts = [t.data.prompt for t in verifiers_tasks(spec)]
    kinds = []
    for s in trained:
        said = conversation(tokenizer.decode(s.input_ids))
        targets = tokenizer.decode([t for t, m in zip(s.input_ids, s.loss_mask, strict=True) if m])
        if not s.drawn.finished:  # cut by max_turns or max_new_tokens: masked from the loss
            assert targets == ""
            continue
        assert s.scored.reward == verifiers_score(spec, prompts.index(said[0]["content"]), said)
        # the targets: the model's turns, each with its end-of-turn token, and nothing else
        assert targets == "".join(m["content"] + "<|im_end|>" for m in said if m["role"] == "assistant")
        kinds += [
            m["role"] if m["role"] == "tool" else m["content"] for m in said[2:] if m["role"] != "assistant"
        ]
    assert len(trained) == 12 and set(kinds) == {"tool", RETRY}
