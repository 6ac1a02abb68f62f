"""A verifiers task as a padless episode: its prompt, the policy's answer, its rubric as the reward.

The rows come from ``data.train: verifiers:<module>:<taskset>`` (:mod:`padless.data.procedural`); with
``rollout.environment: verifiers`` each episode finds its task again by the row's position in the taskset
(checked against the task's key, so a taskset that changed since the rows were made is refused), opens with
the task's messages (its system prompt first), and ends after the model's answer: verifiers scores a trace
of the conversation with the task's own ``@vf.reward`` functions (and any it was configured with), and the
weighted total (``Trace.reward``) is the episode's reward. ``pip install 'padless[verifiers]'``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from padless.data.procedural import verifiers_tasks
from padless.errors import InputError
from padless.rl.environments import Environment, Step, Turn


class VerifiersEnvironment(Environment):
    """One verifiers task per episode (single-turn: the model's first answer is scored and ends it)."""

    def __init__(self, row: dict[str, Any]) -> None:
        super().__init__(row)
        ref = row.get("verifiers")
        if not isinstance(ref, dict) or not {"taskset", "idx", "key"} <= set(ref):
            raise InputError(
                "rollout.environment: verifiers reads each row's 'verifiers' column (the task's taskset, "
                f"position and key); this row has {sorted(row)}; fix: set data.train: "
                "verifiers:<module>:<name>"
            )
        tasks = verifiers_tasks(ref["taskset"])
        task = tasks[ref["idx"]] if 0 <= ref["idx"] < len(tasks) else None
        if task is None or task.key != ref["key"]:
            raise InputError(
                f"{ref['taskset']}: task {ref['idx']} is not the one this row was made from (the taskset "
                "changed since); fix: make the rows again (clear the data cache) or restore the taskset"
            )
        self.task = task

    def reset(self) -> list[dict[str, Any]]:
        data = self.task.data
        system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        if isinstance(data.prompt, str):
            return [*system, {"role": "user", "content": data.prompt}]
        return [*system, *(m.model_dump(mode="json", exclude_none=True) for m in data.prompt or [])]

    def step(self, turn: Turn) -> Step:
        answered = [*self.reset(), {"role": "assistant", "content": turn.text}]
        return Step(reward=score(self.task, answered), done=True)


def score(task: Any, messages: list[dict[str, Any]]) -> float:
    """The task's rubric on a conversation: verifiers' own scoring of a trace holding it (the model's
    messages marked sampled), the weighted total of its rewards."""
    import verifiers.v1 as vf
    from pydantic import TypeAdapter
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask
    from verifiers.v1.types import Message

    read = TypeAdapter(Message)
    nodes = [
        MessageNode(
            parent=i - 1 if i else None, message=read.validate_python(m), sampled=m["role"] == "assistant"
        )
        for i, m in enumerate(messages)
    ]
    trace = Trace(
        task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=AgentInfo(config=vf.AgentConfig()),
        nodes=nodes,
    )
    asyncio.run(task.score(trace))
    return trace.reward
