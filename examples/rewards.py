"""A reward function of your own, as ``reward.functions`` takes it (docs/guides/rl.md)::

padless grpo examples/grpo_tiny.yaml 'reward.functions=[arithmetic, examples/rewards.py:bare_answer]'
"""

from __future__ import annotations


def bare_answer(
    prompts: list[str], completions: list[str], answer: list[str], **fields
) -> list[float | None]:
    """1.0 when a completion is the answer and nothing else (spaces and a final period aside), else 0.0.

    ``answer`` is a column of the prompt rows (one value per completion, repeated for a prompt's samples);
    ``**fields`` takes the other columns, so a data set with more of them still works. Return None for a
    completion the function does not apply to."""
    return [float(c.strip().rstrip(".") == str(a)) for c, a in zip(completions, answer, strict=True)]
