"""A rollout's rewards: every source's part of each sample's reward, weighted and summed.

Sources, in the order they are added (each sample's :class:`~padless.rl.sample.Scored` keeps each one's
part by name):

- the reward functions (``reward.functions``, weighted by ``reward.weights``; each function's own name);
- a reward model (``reward.model``, weighted by ``reward.model_weight``; ``reward_model``), read at each
  sequence's last token on packed batches;
- what an episode's environment gave (``environment``);
- the soft overlong penalty (``reward.overlong_buffer``; ``overlong``).

A source is a method returning the ``[N]`` float32 amount it adds to the totals and its parts (one value
per sample, None where it does not apply), or None when it is not in use; adding one means writing the
method and listing it in :attr:`Scorer.SOURCES`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from padless.data import reward_inputs
from padless.forward.passes import score_examples
from padless.forward.ranks import agreed
from padless.losses import soft_overlong_penalty
from padless.rl.rewards import RewardComposer
from padless.rl.sample import Sample, Scored

if TYPE_CHECKING:
    from padless.data import PromptExample

Parts = dict[str, list[float | None]]


class Scorer:
    """Scores samples by ``cfg.reward``; ``functions`` and ``model`` (a prepared, frozen scoring engine) are
    the reward functions and the reward model when the run has them."""

    SOURCES = ("by_functions", "by_model", "by_environment", "overlong_penalty")

    def __init__(
        self,
        cfg: Any,
        tokenizer: Any,
        functions: RewardComposer | None = None,
        model: torch.nn.Module | None = None,
    ):
        self.cfg, self.tokenizer, self.functions, self.model = cfg, tokenizer, functions, model

    def score(
        self, prompts: Sequence[PromptExample], samples: list[Sample], group: int, filler: Sample
    ) -> None:
        """Each sample's total reward and parts (``group`` consecutive samples per prompt). Every rank calls
        it, one with no samples too (``filler`` keeps it in step with the others' reward-model passes)."""
        totals = torch.zeros(len(samples))
        parts: Parts = {}
        for name in self.SOURCES:
            scored = getattr(self, name)(prompts, samples, group, filler)
            if scored is not None:
                totals += scored[0]
                parts.update(scored[1])
        for i, s in enumerate(samples):
            s.scored = Scored(totals[i].item(), {name: values[i] for name, values in parts.items()})

    def by_functions(
        self, prompts: Sequence[PromptExample], samples: list[Sample], group: int, filler: Sample
    ) -> tuple[torch.Tensor, Parts] | None:
        """The reward functions on the prompts' texts and columns and the completions' texts; a failure on one
        rank stops every rank here, together."""
        functions = self.functions
        if functions is None:
            return None

        def call() -> tuple[torch.Tensor, Parts]:
            if not samples:  # a rank with only fillers still joins the agreement
                return torch.zeros(0), {}
            texts = [
                s.drawn.text
                if s.drawn.text is not None
                else self.tokenizer.decode(s.completion_ids, skip_special_tokens=True)
                for s in samples
            ]
            prompt_texts, fields = reward_inputs(prompts, group)
            return functions(prompt_texts, texts, fields)

        return agreed(call, "a reward function")

    def by_model(
        self, prompts: Sequence[PromptExample], samples: list[Sample], group: int, filler: Sample
    ) -> tuple[torch.Tensor, Parts] | None:
        """The reward model's score at each sequence's last token, on packed batches."""
        if self.model is None:
            return None
        scores = score_examples(self.model, samples, self.cfg.train.max_tokens_per_batch, filler)
        return self.cfg.reward.model_weight * torch.tensor(scores), {"reward_model": list(scores)}

    def by_environment(
        self, prompts: Sequence[PromptExample], samples: list[Sample], group: int, filler: Sample
    ) -> tuple[torch.Tensor, Parts] | None:
        """What each episode's environment gave (multi-turn episodes)."""
        if not samples or samples[0].drawn.episode is None:
            return None
        given = [s.drawn.episode.env_reward if s.drawn.episode else 0.0 for s in samples]
        return torch.tensor(given), {"environment": list(given)}

    def overlong_penalty(
        self, prompts: Sequence[PromptExample], samples: list[Sample], group: int, filler: Sample
    ) -> tuple[torch.Tensor, Parts] | None:
        """DAPO's soft penalty for completions in the last ``reward.overlong_buffer`` tokens allowed."""
        reward = self.cfg.reward
        if not reward.overlong_buffer:
            return None
        lengths = torch.tensor([len(s.completion_ids) for s in samples])
        penalty = soft_overlong_penalty(
            lengths, self.cfg.rollout.max_new_tokens, reward.overlong_buffer, reward.overlong_factor
        )
        return penalty, {"overlong": penalty.tolist()}
