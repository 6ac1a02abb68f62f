"""The one factory of RL sampling: the engine that draws the tokens (``rollout.engine``: :data:`ENGINES`),
the sampler that turns a rollout's prompts into samples (the first of :data:`MODES` whose test the settings
pass), sampling ahead around it (``rollout.max_staleness``), and every combination of engine, mode and
policy padless refuses, in one table (:data:`REFUSALS`), checked before any model loads and again once it
is known whether the policy reads images.

Adding a sampling mode is a file with its :class:`~padless.rl.sampler.Sampler` and an entry here
(:func:`register_mode` for one from outside padless); a combination it cannot serve is a row of
:data:`REFUSALS`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from padless.data.images import ImageInputs
from padless.errors import InputError
from padless.forward import routing
from padless.forward.engine import as_engine, inner_engine, unwrap
from padless.rl.ahead import AheadSampler
from padless.rl.episodes import EpisodeSampler, make_runner
from padless.rl.generate import Engine, HFEngine, eos_token_ids
from padless.rl.sampler import Request, Sampler, SingleTurn
from padless.rl.vllm_engine import logprobs_mode


def _vllm(cfg: Any, policy: torch.nn.Module, tokenizer: Any) -> Engine:
    if cfg.rollout.vllm_mode == "server":
        from padless.rl.vllm_server import VLLMServerEngine

        return VLLMServerEngine(policy, tokenizer, cfg.rollout, cfg.data.max_prompt_length)
    from padless.rl.vllm_engine import VLLMEngine

    return VLLMEngine(policy, tokenizer, cfg.rollout, cfg.data.max_prompt_length, cfg.train.seed)


ENGINES: dict[str, Callable[[Any, torch.nn.Module, Any], Engine]] = {
    "hf": lambda cfg, policy, tokenizer: HFEngine(policy, tokenizer, cfg.rollout),  # generate() on the policy
    # vLLM colocated in the training process, or a server (rollout.vllm_mode); either is sent the policy's
    # weights before every rollout
    "vllm": _vllm,
}


@dataclass(frozen=True)
class Refusal:
    """A combination padless refuses: ``when(rollout, vision)`` (``vision``: whether the policy reads
    images, None before the model is loaded) says it is asked for; the message names the settings, why,
    and the fix."""

    when: Callable[[Any, bool | None], bool]
    why: Callable[[Any], str]
    fix: str


REFUSALS = [
    Refusal(
        lambda r, vision: r.max_staleness > 0 and r.engine == "vllm",
        lambda cfg: (
            f"rollout.max_staleness: {cfg.rollout.max_staleness} with rollout.engine: vllm: padless samples "
            "ahead on a copy of the policy in a thread beside training, and its vLLM engine holds one set of "
            "weights that every sync replaces (and, in process on CPU, pins torch to 1 thread, which would "
            "starve the training beside it)"
        ),
        "use rollout.engine: hf, or rollout.max_staleness: 0",
    ),
    Refusal(
        lambda r, vision: r.engine == "vllm" and logprobs_mode(r) is None and r.correction(),
        lambda cfg: (
            f"rollout.engine: vllm with rollout.temperature: {cfg.rollout.temperature} and rollout.top_p: "
            f"{cfg.rollout.top_p}: vLLM returns sampled-token log-probs before the temperature or after "
            "top-p, never both, so the importance-sampling correction (on by default for this engine) "
            "cannot run"
        ),
        "leave the temperature or top_p at 1, use rollout.engine: hf, or set "
        "rollout.importance_sampling_correction: false to train uncorrected",
    ),
    Refusal(
        lambda r, vision: r.engine == "vllm" and bool(vision),
        lambda cfg: (
            f"rollout.engine: vllm with {cfg.model.name}, a vision-language model: padless does not hand "
            "images to vLLM yet, so the samples would ignore them (vLLM's Qwen2-VL / Qwen2.5-VL code imports "
            "transformers' torchvision image processor, and no CPU build of torchvision installs here, so "
            "the path could not be tested; docs/guides/sampling.md: vLLM on CPU)"
        ),
        "set rollout.engine: hf",
    ),
    Refusal(
        lambda r, vision: r.episodes() and r.max_staleness > 0,
        lambda cfg: (
            "rollout.max_staleness, rollout.environment: multi-turn episodes are sampled on-policy only for "
            "now (the ahead sampler runs single completions)"
        ),
        "set max_staleness: 0",
    ),
    Refusal(
        lambda r, vision: r.episodes() and r.engine == "vllm" and r.max_episode_tokens is None,
        lambda cfg: (
            "rollout.max_episode_tokens, rollout.engine: vLLM sizes its context when it starts, and an "
            "episode's turns have no length limit without a token budget"
        ),
        "set rollout.max_episode_tokens (e.g. 1024)",
    ),
    Refusal(
        lambda r, vision: r.routing_replay and r.engine == "vllm",
        lambda cfg: (
            "rollout.routing_replay with rollout.engine: vllm: padless's vLLM engine does not ask vLLM for "
            "the experts it routed each token to (vLLM's enable_return_routed_experts is not wired in or "
            "tested here), so there would be no routes to replay"
        ),
        "use rollout.engine: hf, or rollout.routing_replay: false",
    ),
    Refusal(
        lambda r, vision: r.routing_replay and (r.episodes() or r.max_staleness > 0),
        lambda cfg: (
            "rollout.routing_replay with multi-turn episodes or rollout.max_staleness: routes are recorded "
            "for single completions sampled on-policy only for now"
        ),
        "set rollout.routing_replay: false, or sample single completions on-policy",
    ),
]


def check_sampling(cfg: Any, vision: bool | None = None) -> None:
    """Refuse what :data:`REFUSALS` lists for these settings (``vision``: see :class:`Refusal`)."""
    for refusal in REFUSALS:
        if refusal.when(cfg.rollout, vision):
            raise InputError(f"{refusal.why(cfg)}; fix: {refusal.fix}")


@dataclass
class Parts:
    """What a sampler is built from: ``engine`` draws the tokens, ``policy`` is the trained model (not yet
    prepared), ``images`` its image side (vision-language policies), ``schedule(epoch)`` a rollout's request
    on this rank (None past the run's last)."""

    cfg: Any
    engine: Engine
    tokenizer: Any
    policy: torch.nn.Module
    images: ImageInputs | None
    schedule: Callable[[int], Request | None]


@dataclass(frozen=True)
class Mode:
    """A way of sampling: used when ``applies(cfg)``, built by ``build(parts)``."""

    name: str
    applies: Callable[[Any], bool]
    build: Callable[[Parts], Sampler]


def _episodes(parts: Parts) -> Sampler:
    cfg, policy = parts.cfg, parts.policy
    eos = eos_token_ids(unwrap(inner_engine(as_engine(policy)).model), parts.tokenizer)
    specs = [cfg.data.train] + ([cfg.data.eval] if cfg.data.eval else [])
    runner = make_runner(parts.tokenizer, cfg.rollout, eos, parts.images, specs)
    return EpisodeSampler(parts.engine, cfg.rollout, runner, specs, parts.images)


def _single_turn(parts: Parts) -> Sampler:
    return SingleTurn(parts.engine, parts.cfg.rollout, parts.images)


MODES = [
    Mode("episodes", lambda cfg: cfg.rollout.episodes(), _episodes),  # rollout.environment or tools
    Mode("single_turn", lambda cfg: True, _single_turn),
]


def register_mode(mode: Mode) -> None:
    """Add a sampling mode, asked before the built-in ones whether it applies."""
    MODES.insert(0, mode)


def make_engine(
    cfg: Any, policy: torch.nn.Module, tokenizer: Any, images: ImageInputs | None = None
) -> Engine:
    """The engine ``rollout.engine`` names, for ``policy`` (before it is prepared)."""
    check_sampling(cfg, images is not None)
    if cfg.rollout.routing_replay:
        check_replay(cfg, policy)
    return ENGINES[cfg.rollout.engine](cfg, policy, tokenizer)


def check_replay(cfg: Any, policy: torch.nn.Module) -> None:
    """Routing replay needs a mixture of experts whose routers replay exactly, and packed rows run whole,
    forward and recomputed alike (no gradient checkpointing: a recompute in backward would route anew)."""
    routing.check_replayable(unwrap(inner_engine(as_engine(policy)).model))
    if cfg.model.gradient_checkpointing or cfg.train.batching == "padded" or cfg.train.sequence_parallel > 1:
        raise InputError(
            "rollout.routing_replay replays routes in whole packed rows, forward only; fix: set "
            "model.gradient_checkpointing: false, train.batching: tokens and train.sequence_parallel: 1, or "
            "rollout.routing_replay: false"
        )


def make_sampler(parts: Parts) -> Sampler:
    """The sampler of the first mode that applies; with ``rollout.max_staleness`` k > 0, wrapped in the
    sampler that draws the next k rollouts ahead on a whole copy of the policy (made now, before the policy
    is prepared and maybe sharded)."""
    cfg = parts.cfg
    check_sampling(cfg, parts.images is not None)
    sampler = next(m for m in MODES if m.applies(cfg)).build(parts)
    k = cfg.rollout.max_staleness
    if k == 0:
        return sampler
    whole = copy.deepcopy(unwrap(inner_engine(as_engine(parts.policy)).model)).eval()
    whole.requires_grad_(False)
    behind = SingleTurn(HFEngine(whole, parts.tokenizer, cfg.rollout), cfg.rollout, parts.images)
    return AheadSampler(sampler, behind, whole, k, parts.schedule)
