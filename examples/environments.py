"""A multi-turn environment and a tool of your own, as ``rollout.environment`` and ``rollout.tools`` take
them (docs/guides/episodes.md)::

    padless grpo examples/grpo_calculator_tiny.yaml rollout.environment=examples/environments.py:Quiz
"""

from __future__ import annotations

from padless.rl.environments import Environment, Step, Turn


def multiply(a: float, b: float) -> float:
    """Multiply two numbers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


class Quiz(Environment):
    """One instance per episode, built from its prompt row (``self.row``). The first messages are the row's
    prompt (override ``reset`` for others); after every model turn, ``step`` answers: tool results go back
    to the model, a wrong answer gets one more try, a right one ends the episode with a bonus that is added
    to ``reward.functions``' score of the last turn."""

    tools = (multiply,)  # added to rollout.tools

    def step(self, turn: Turn) -> Step:
        if turn.tool_messages:  # the model called a tool: hand it the results
            return Step(messages=turn.tool_messages)
        self.answers = getattr(self, "answers", 0) + 1
        if turn.text.strip().rstrip(".") == str(self.row["answer"]):
            return Step(reward=0.5, done=True)
        if self.answers == 2:
            return Step(done=True)
        return Step(messages=[{"role": "user", "content": "Not quite. Try once more: just the number."}])
