"""One sampled sequence of a rollout and everything RL learns about it, as typed fields grouped by who
writes them:

- :class:`Drawn`, by the sampler: where the prompt came from, how the sample ended, the sampler's own
  log-probs, its staleness, an episode's statistics and the images its environment showed;
- :class:`Scored`, by the scorer (:mod:`padless.rl.scoring`): the total reward and each source's part;
- :class:`Passes`, by the no-grad passes over the rollout: old and reference log-probs, old values;
- :class:`Algorithm`, by the algorithm: advantages, returns, importance weights, the policy loss's weight.

Per-target fields hold one value per target token in order (a truncated sample masked from the loss has
none). A :class:`Sample` is an :class:`~padless.forward.packing.Example` (ids, targets, image inputs), so
it packs as one. It saves itself as JSON (:meth:`Sample.state`): checkpoints keep a rollout trained half-way
and rollouts sampled ahead; image inputs are not saved (the prompt's are found again from its row, an
environment's images are kept as PNG text).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from padless.forward.packing import Example
from padless.rl.rewards import scored_mean


@dataclass(slots=True)
class EpisodeStats:
    """A multi-turn episode's bookkeeping: turns, tool calls (and how many failed), environment tokens
    (context, never targets), the reward the environment gave, and why it was cut (None: it ended)."""

    turns: int
    tool_calls: int
    failed_tool_calls: int
    env_tokens: int
    env_reward: float
    truncated_by: str | None
    template_differs: bool = False  # a sampled turn the chat template would render otherwise


@dataclass(slots=True)
class Drawn:
    """Written by the sampler."""

    prompt_row: int  # the prompt's row in the training data (finds its images again on resume)
    prompt_length: int
    length: int  # tokens the model wrote (an episode's: all its turns)
    finished: bool  # False when cut before its end-of-sequence token
    text: str | None = None  # what reward functions read; None: the completion decoded
    logps: list[float] | None = None  # the sampler's, per target; None: it gave none (greedy, vLLM modes)
    sampling_s: float = 0.0  # seconds spent sampling (or waiting for the samples) on this rank
    staleness: int | None = None  # updates between the weights that sampled it and now (sampling ahead)
    episode: EpisodeStats | None = None
    env_images: list[str] = field(default_factory=list)  # images an environment showed, as PNG text
    # routing replay: the experts each token was routed to while sampling, [token][router][k] (-1: any)
    routes: list[list[list[int]]] | None = None


@dataclass(slots=True)
class Scored:
    """Written by the scorer: the weighted total and each source's unweighted part (None: not scored)."""

    reward: float = 0.0
    parts: dict[str, float | None] = field(default_factory=dict)

    @property
    def unscored(self) -> bool:
        """No source scored it (every reward function returned None): its reward of 0 means nothing, and
        GRPO leaves it out of its group (advantage 0), as TRL does."""
        return bool(self.parts) and all(v is None for v in self.parts.values())


@dataclass(slots=True)
class Passes:
    """Written by the no-grad passes over the rollout (the recipe's ``passes`` name them), per target."""

    old_logps: list[float] | None = None
    ref_logps: list[float] | None = None
    old_values: list[float] | None = None
    unreplayed_logps: list[float] | None = None  # routing replay: the old log-probs routed anew


@dataclass(slots=True)
class Algorithm:
    """Written by the algorithm from the fields above, per target, read by its loss."""

    advantages: list[float] | None = None
    returns: list[float] | None = None
    is_weights: list[float] | None = None  # the rollout-trainer correction (None: off)
    policy_weight: float = 1.0  # 0 while only a critic learns (PPO's warm-up)


GROUPS = {"drawn": Drawn, "scored": Scored, "passes": Passes, "algorithm": Algorithm}


@dataclass
class Sample(Example):
    """A sampled sequence (prompt and completion; targets: the completion's model tokens) and its record."""

    drawn: Drawn = field(default_factory=lambda: Drawn(0, 0, 0, True))
    scored: Scored = field(default_factory=Scored)
    passes: Passes = field(default_factory=Passes)
    algorithm: Algorithm = field(default_factory=Algorithm)

    @classmethod
    def of(cls, example: Example, drawn: Drawn) -> Sample:
        """``example`` (ids, targets, image inputs) as a freshly drawn sample."""
        return cls(
            example.input_ids,
            example.loss_mask,
            vision=example.vision,
            rope_positions=example.rope_positions,
            drawn=drawn,
        )

    @property
    def routes(self) -> torch.Tensor | None:
        """The sampler's routes ``[L, routers, k]`` (routing replay), replayed by the trainer's passes."""
        return None if self.drawn.routes is None else torch.tensor(self.drawn.routes, dtype=torch.long)

    @property
    def completion_ids(self) -> list[int]:
        return self.input_ids[self.drawn.prompt_length :]

    def state(self) -> dict[str, Any]:
        """Everything but the image inputs, as JSON data."""
        return {
            "input_ids": self.input_ids,
            "loss_mask": self.loss_mask,
            **{name: asdict(getattr(self, name)) for name in GROUPS},
        }

    def check(self) -> Sample:
        """This sample as a saved state must be: ids and targets of one length, a prompt within them, and
        one value per target in every per-target field (a hand-edited or foreign state fails here, named)."""
        n = len(self.input_ids)
        if len(self.loss_mask) != n or not 0 < self.drawn.prompt_length <= n:
            raise ValueError(
                f"a sample has {n} ids, {len(self.loss_mask)} target flags and a prompt of "
                f"{self.drawn.prompt_length} tokens"
            )
        per_target = {
            "drawn.logps": self.drawn.logps,
            **{f"passes.{k}": getattr(self.passes, k) for k in ("old_logps", "ref_logps", "old_values")},
            **{f"algorithm.{k}": getattr(self.algorithm, k) for k in ("advantages", "returns", "is_weights")},
        }
        for name, values in per_target.items():
            if values is not None and len(values) != self.num_targets:
                raise ValueError(f"a sample's {name} has {len(values)} values for {self.num_targets} targets")
        return self

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Sample:
        """The sample :meth:`state` saved, without its image inputs."""
        groups = {name: kind(**state[name]) for name, kind in GROUPS.items()}
        if groups["drawn"].episode is not None:
            groups["drawn"].episode = EpisodeStats(**groups["drawn"].episode)
        return cls(state["input_ids"], state["loss_mask"], **groups)


def per_target(values: Sequence[list[float] | None], device: torch.device) -> torch.Tensor:
    """Per-target values of samples (one list each, in packed target order) as one float32 tensor."""
    return torch.tensor([v for vs in values for v in vs or ()], device=device, dtype=torch.float32)


def summary(samples: Sequence[Sample], prefix: str = "") -> dict[str, float]:
    """What a rollout's samples say: reward mean / std (over the samples some source scored) and per
    source, the share no source scored (when some), completion lengths, truncation,
    sampling tokens/s, staleness (sampling ahead) and episode statistics (multi-turn)."""
    rewards = torch.tensor([s.scored.reward for s in samples if not s.scored.unscored] or [math.nan])
    unscored = sum(s.scored.unscored for s in samples)
    drawn = [s.drawn for s in samples]
    lengths = [d.length for d in drawn]
    sampling_s = max(d.sampling_s for d in drawn)  # ranks sample at once: the slowest counts
    return {
        f"{prefix}reward": rewards.mean().item(),
        f"{prefix}reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
        **{
            f"{prefix}reward/{k}": scored_mean([s.scored.parts[k] for s in samples])
            for k in samples[0].scored.parts
        },
        **({f"{prefix}unscored_fraction": unscored / len(samples)} if unscored else {}),
        f"{prefix}completion_length": sum(lengths) / len(lengths),
        f"{prefix}completion_length_max": max(lengths),
        f"{prefix}truncated_fraction": sum(not d.finished for d in drawn) / len(drawn),
        f"{prefix}tokens_per_s": sum(lengths) / sampling_s,
        **staleness(drawn, prefix),
        **episode_metrics(drawn, prefix),
    }


def staleness(drawn: Sequence[Drawn], prefix: str) -> dict[str, float]:
    """How many updates old the weights were that sampled the rollout (``rollout.max_staleness``)."""
    if drawn[0].staleness is None:
        return {}
    ages = [d.staleness or 0 for d in drawn]  # a refill round's samples are drawn now: 0
    return {f"{prefix}staleness_mean": sum(ages) / len(ages), f"{prefix}staleness_max": float(max(ages))}


def episode_metrics(drawn: Sequence[Drawn], prefix: str) -> dict[str, float]:
    """Multi-turn episodes: turns, tool calls and their success rate, environment tokens (masked from the
    loss), the share of episodes truncated (by max_turns, the token budget or a turn's length), and the share
    with a turn the chat template would render otherwise than the model wrote it."""
    if drawn[0].episode is None:
        return {}
    stats = [d.episode for d in drawn if d.episode is not None]
    n, calls = len(stats), sum(s.tool_calls for s in stats)
    failed = sum(s.failed_tool_calls for s in stats)
    return {
        f"{prefix}turns": sum(s.turns for s in stats) / n,
        f"{prefix}tool_calls": calls / n,
        f"{prefix}tool_call_success": (calls - failed) / calls if calls else math.nan,
        f"{prefix}env_tokens": sum(s.env_tokens for s in stats) / n,
        f"{prefix}truncated_episodes": sum(s.truncated_by is not None for s in stats) / n,
        f"{prefix}template_differs": sum(s.template_differs for s in stats) / n,
    }
