"""The one interface RL samples through: a :class:`Sampler` turns a :class:`Request` (this rank's prompts,
how many samples each, their seeds) into :class:`~padless.rl.sample.Sample` s with their sampler fields
written.

The modes, each a file, built by :func:`padless.rl.sampling.make_sampler`:

- :class:`SingleTurn` (here): one completion per sample from the engine, on the current weights;
- :class:`padless.rl.episodes.EpisodeSampler`: multi-turn episodes with an environment or tools;
- :class:`padless.rl.ahead.AheadSampler`: wraps another and samples the next rollouts in the background
  from the weights as they are (``rollout.max_staleness``).

An engine (:class:`padless.rl.generate.Engine`: HF ``generate`` or vLLM) draws the tokens; a sampler
decides what is asked of it and records what came back. Every rank asks for as many samples (the request
holds fillers where a rank's prompts run out), so sharded engines stay in lockstep.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from padless.data.images import from_png_text, png_text
from padless.forward.packing import Example, concat_vision
from padless.rl.generate import Completion, Engine, HFEngine
from padless.rl.sample import Drawn, Sample

if TYPE_CHECKING:
    from padless.data import PromptExample
    from padless.data.images import ImageInputs


@dataclass
class Request:
    """What to sample: ``group`` samples for each of ``prompts`` (this rank's share, fillers included),
    prompt ``i``'s drawn from ``seeds[i]`` alone; ``epoch``: the rollout it is for (None: drawn now, outside
    the schedule: evaluation, a refill round)."""

    prompts: list[PromptExample]
    group: int
    seeds: list[int]
    greedy: bool = False
    epoch: int | None = None


class Sampler:
    """Draws samples through ``engine``; ``images``: a vision-language policy's image side (its samples carry
    their prompt's images), ``rollout``: the rollout settings."""

    def __init__(self, engine: Engine, rollout: Any, images: ImageInputs | None = None):
        self.engine, self.rollout, self.images = engine, rollout, images

    def sample(self, request: Request) -> list[Sample]:
        """``request.group`` samples per prompt, a prompt's consecutive, with their :class:`Drawn` fields."""
        raise NotImplementedError(f"{type(self).__name__} draws no samples")

    def bind(self, policy: torch.nn.Module) -> None:
        """Sample through the prepared engine from now on (the HF engine samples the policy itself)."""
        if isinstance(self.engine, HFEngine):
            self.engine.policy = policy

    def state(self) -> list[dict[str, Any]] | None:
        """What the sampler holds that a checkpoint must keep (samples drawn ahead, not yet trained), as JSON
        data; None: nothing."""
        return None

    def restore(self, state: list[dict[str, Any]], revive: Callable[[dict[str, Any]], Sample]) -> None:
        """Take back what :meth:`state` saved; ``revive`` turns a saved sample back into a :class:`Sample`."""
        raise NotImplementedError(f"{type(self).__name__} keeps no state to restore")

    # -- what every mode shares ------------------------------------------------------------------------

    def vision(self, prompts: list[PromptExample]) -> list[dict[str, torch.Tensor] | None] | None:
        """The prompts' image inputs for the engine (a vision-language policy), else None."""
        return [p.vision for p in prompts] if self.images is not None else None

    def record(self, c: Completion, prompt: PromptExample, greedy: bool, seconds: float) -> Sample:
        """A completion as a sample: its targets are the tokens the model wrote, none when it was cut before
        its end and ``rollout.mask_truncated`` is set; the sampler's log-probs of its targets (sampling
        only); an episode's statistics and the images its environment showed (as PNG)."""
        trained = c.finished or not self.rollout.mask_truncated
        model = c.model_mask or [True] * len(c.completion_ids)  # episodes: the environment's are context
        targets = [False] * len(c.prompt_ids) + [trained and m for m in model]
        drawn = Drawn(
            prompt_row=prompt.row,
            prompt_length=len(c.prompt_ids),
            length=sum(model),
            finished=c.finished,
            text=c.text,
            logps=(c.logprobs if trained else []) if c.logprobs is not None and not greedy else None,
            sampling_s=seconds,
            episode=c.episode,
            env_images=[png_text(image) for image in c.env_images or ()],
            routes=None if c.routes is None else c.routes.tolist(),
        )
        vision = prompt.vision if c.vision is None else c.vision  # an episode's: with its env's images
        return Sample.of(self.example(c.prompt_ids + c.completion_ids, targets, vision), drawn)

    def example(self, ids: list[int], targets: list[bool], vision: dict[str, Any] | None) -> Example:
        """A sequence; with a vision-language policy it carries its images and per-sample positions."""
        if self.images is None:
            return Example(ids, targets)
        return self.images.example(ids, targets, vision, {})


class SingleTurn(Sampler):
    """One completion per sample, from the policy's current weights (synced into the engine first)."""

    def sample(self, request: Request) -> list[Sample]:
        started = time.perf_counter()
        self.engine.sync_weights()
        prompts, group = request.prompts, request.group
        completions = self.engine.complete(
            [p.prompt_ids for p in prompts], group, request.seeds, request.greedy, self.vision(prompts)
        )
        seconds = time.perf_counter() - started
        return [
            self.record(c, prompts[j // group], request.greedy, seconds) for j, c in enumerate(completions)
        ]


def revive(state: dict[str, Any], images: ImageInputs | None, prompt_vision: dict[str, Any] | None) -> Sample:
    """A sample saved with :meth:`Sample.state` back, with its image inputs: its prompt's
    (``prompt_vision``, found again from the prompt row), then those of the images its environment showed."""
    sample = Sample.from_state(state)
    if images is None:
        return sample
    vision = prompt_vision
    if sample.drawn.env_images:
        shown = [from_png_text(text) for text in sample.drawn.env_images]
        vision = concat_vision([vision, images.inputs(shown)])
    example = images.example(sample.input_ids, sample.loss_mask, vision, {})
    sample.vision, sample.rope_positions = example.vision, example.rope_positions
    return sample
