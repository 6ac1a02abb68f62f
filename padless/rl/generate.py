"""Generation: the one place padding exists. Prompts are left-padded here, whatever the tokenizer says.

Decoding needs a KV cache, which packed attention kernels do not take: for ``varlen`` and
``flex_attention`` models, decoding runs on ``sdpa`` (said in the log, restored afterwards). Completions
come back as plain token lists, cut after the first EOS, ready to be packed again.

RL samples through an :class:`Engine`: :class:`HFEngine` runs ``generate`` on the policy itself;
:class:`padless.rl.vllm_engine.VLLMEngine` runs vLLM with the policy's weights copied in before each rollout.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import LogitsProcessorList

from padless.errors import DIVERGENCE_FIX, DivergenceError
from padless.forward import routing
from padless.forward.attention import attention_in_use, hf_name
from padless.forward.engine import as_engine, inner_engine, unwrap
from padless.forward.packing import concat_vision
from padless.forward.vision import image_token_types, placeholder_ids, uses_mrope
from padless.proof.load import pad_token_id
from padless.rl.sample import EpisodeStats
from padless.run.strategy import strategy_in_use

log = logging.getLogger(__name__)
DECODE_BACKEND = {"varlen": "sdpa", "flex_attention": "sdpa"}


@dataclass
class Completion:
    """One sampled completion.

    ``logprobs``: one per completion token (per model token, for an episode), the log-prob of the sampled
    token under the distribution it was sampled from, ``log_softmax(logits / temperature)``, *before* any
    top-p (or top-k) renormalisation, so it compares with the trainer's ``logps`` at the same temperature;
    None where the engine gives none (greedy decoding).
    """

    prompt_ids: list[int]
    completion_ids: list[int]  # up to and including the first EOS
    finished: bool  # False when max_new_tokens ran out before an EOS
    logprobs: list[float] | None = None
    # a multi-turn episode (padless.rl.episodes): which completion tokens the model wrote (the rest are the
    # environment's), the text reward functions read (the last model turn) and the episode's statistics
    model_mask: list[bool] | None = None
    text: str | None = None
    episode: EpisodeStats | None = None
    # a vision-language policy's episode: the image inputs of all its images (the prompt's, then those its
    # environment showed) and the images the environment showed (PIL)
    vision: dict[str, torch.Tensor] | None = None
    env_images: list[Any] | None = None
    # a mixture of experts' routes while sampling (rollout.routing_replay): [prompt + completion tokens,
    # routers, k], -1 where a token was never fed (the last one)
    routes: torch.Tensor | None = None


def left_pad(
    prompts: list[list[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, L]`` input ids and attention mask, prompts right-aligned so new tokens follow real ones."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty: generation needs at least one prompt token")
        ids[i, width - len(p) :] = torch.tensor(p, device=device)
        mask[i, width - len(p) :] = 1
    return ids, mask


@contextlib.contextmanager
def decoding_attention(model: torch.nn.Module) -> Iterator[None]:
    """Switch a packed-only backend to its decoding kernel for the duration of ``generate``."""
    inner = unwrap(model)
    backend = attention_in_use(inner)
    decode = DECODE_BACKEND.get(backend)
    if decode is None:
        yield
        return
    if not getattr(inner, "padless_decode_said", False):  # once per model, not once per rollout
        log.info("decoding with %s: the %s backend runs whole sequences, keeps no KV cache", decode, backend)
        inner.padless_decode_said = True
    inner.set_attn_implementation(decode)
    try:
        yield
    finally:
        inner.set_attn_implementation(hf_name(backend))


def cut_at_eos(tokens: list[int], eos_ids: set[int], pad_id: int) -> tuple[list[int], bool]:
    """Tokens up to and including the first EOS; trailing padding from ``generate`` dropped."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[: i + 1], True
    while tokens and tokens[-1] == pad_id and pad_id not in eos_ids:
        tokens = tokens[:-1]
    return tokens, False


def row_seed(seed: int, sample: int) -> int:
    """The seed of a prompt's ``sample``-th completion: a function of the prompt's seed alone."""
    return (seed * 1_000_003 + sample) % 2**63


class SeededSampler:
    """A logits processor that samples each row with its own ``torch.Generator`` and hands ``generate``
    scores whose only finite entry is the chosen token, so ``generate`` runs greedy and batched while every
    row's tokens depend only on its seed (never on its batch, rank or neighbours).

    Each row draws one uniform per step and picks by inverse CDF over ``softmax(logits / temperature)``,
    without the ``forbidden`` tokens and after top-p filtering; it records the chosen token's
    ``log_softmax(logits / temperature)`` (before either) for :class:`Completion`'s ``logprobs``.
    ``forbidden``: a vision-language model's image / video placeholders, whose pixels a sampled one would
    lack (the next turn's forward and the training forward would stop on the count).
    """

    def __init__(
        self,
        seeds: list[int],
        temperature: float,
        top_p: float,
        device: torch.device,
        forbidden: tuple[int, ...] = (),
    ):
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        self.temperature, self.top_p, self.forbidden = temperature, top_p, list(forbidden)
        self.logprobs: list[torch.Tensor] = []  # per step, [rows]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logps = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        probs = logps.exp()
        if self.forbidden:
            probs[:, self.forbidden] = 0.0
            probs = probs / probs.sum(-1, keepdim=True)
        if self.top_p < 1.0:  # keep the smallest set of most likely tokens whose mass reaches top_p
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
            sorted_probs = sorted_probs.masked_fill(before >= self.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        cdf = probs.cumsum(-1)
        u = torch.cat([torch.rand(1, generator=g, device=scores.device) for g in self.generators])
        tokens = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).clamp_(
            max=scores.shape[-1] - 1
        )
        self.logprobs.append(logps.gather(-1, tokens).squeeze(-1))
        chosen = torch.full_like(scores, float("-inf"))
        return chosen.scatter_(-1, tokens, 0.0)

    def row_logprobs(self) -> list[list[float]]:
        """Per row, the recorded log-prob of every step's token."""
        if not self.logprobs:
            return [[] for _ in self.generators]
        return torch.stack(self.logprobs, dim=1).tolist()


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    tokenizer,
    prompts: list[list[int]],
    *,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_p: float = 1.0,
    do_sample: bool = False,
    batch_size: int = 8,
    num_return_sequences: int = 1,
    vision: list[dict[str, torch.Tensor] | None] | None = None,
    seeds: list[int] | None = None,
    routes: bool = False,
) -> list[Completion]:
    """Complete each prompt (``num_return_sequences`` times, consecutive in the result).

    With ``seeds`` (one per prompt) sampling runs through :class:`SeededSampler`: sample ``k`` of prompt
    ``i`` is drawn from ``row_seed(seeds[i], k)`` alone, so batching changes nothing, and each completion
    carries its tokens' log-probs; ``batch_size`` still counts prompts.

    ``model`` is a (prepared) engine or a plain model; decoding runs inside the engine's forward, so sharded
    weights are gathered for it, and under FSDP2 / ZeRO-3 every rank keeps stepping until all are done
    (``synced_gpus``): ranks must call this with the same number of prompts. ``vision[i]`` holds prompt
    ``i``'s image inputs (vision-language models): they go with its batch. With ``routes`` (a mixture of
    experts), each completion carries the experts each of its tokens was routed to
    (:mod:`padless.forward.routing`).
    """
    engine = as_engine(model)
    inner = unwrap(inner_engine(engine).model)
    synced = strategy_in_use(engine) in ("fsdp2", "zero3")
    device = _device(engine)
    pad_id = pad_token_id(tokenizer)
    eos_ids = eos_token_ids(inner, tokenizer)
    # Exactly the policy's distribution (at this temperature / top_p): a checkpoint's generation_config
    # (Qwen ships top_k 20 and repetition_penalty 1.05) must not reshape what RL samples and scores.
    sampling: dict[str, Any] = {"temperature": temperature, "top_p": top_p, "top_k": 0} if do_sample else {}
    row_seeds = None
    if seeds is not None:  # SeededSampler draws per row; generate takes its one finite score greedily
        if len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(seeds)} seeds for {len(prompts)} prompts; give one per prompt")
        n, num_return_sequences = num_return_sequences, 1  # greedy generate repeats nothing: rows do
        row_seeds = [row_seed(s, k) for s in seeds for k in range(n)]
        prompts = [p for p in prompts for _ in range(n)]
        vision = None if vision is None else [v for v in vision for _ in range(n)]
        batch_size *= n
        sampling = {"do_sample": False}
    sampling["repetition_penalty"] = 1.0
    results: list[Completion] = []
    was_training = inner.training
    inner.eval()
    try:
        with decoding_attention(inner):
            for start in range(0, len(prompts), batch_size):
                chunk = prompts[start : start + batch_size]
                ids, mask = left_pad(chunk, pad_id, device)
                extra: dict[str, Any] = {}
                if vision is not None:
                    extra = image_inputs(inner, ids, vision[start : start + batch_size])
                sampler = None
                if row_seeds is not None:
                    sampler = SeededSampler(
                        row_seeds[start : start + batch_size],
                        temperature,
                        top_p,
                        device,
                        placeholder_ids(inner.config),
                    )
                    extra["logits_processor"] = LogitsProcessorList([sampler])
                with sampling_guard(), routing.recording(inner) if routes else nullcontext() as recorded:
                    out = engine(
                        generate=dict(
                            input_ids=ids,
                            attention_mask=mask,
                            **extra,
                            max_new_tokens=max_new_tokens,
                            num_return_sequences=num_return_sequences,
                            pad_token_id=pad_id,
                            eos_token_id=sorted(eos_ids),
                            use_cache=True,
                            synced_gpus=synced,
                            **{"do_sample": do_sample, **sampling},
                            # a MoE config's output_router_logits: true makes each cached decoding step
                            # compute a router loss against the whole mask (transformers fails on it);
                            # sampling needs no router loss
                            **(
                                {"output_router_logits": False}
                                if hasattr(inner.config, "output_router_logits")
                                else {}
                            ),
                        )
                    )
                logprobs = sampler.row_logprobs() if sampler is not None else None
                for j, row in enumerate(out[:, ids.shape[1] :].tolist()):
                    tokens, finished = cut_at_eos(row, eos_ids, pad_id)
                    lp = None if logprobs is None else logprobs[j][: len(tokens)]
                    prompt = chunk[j // num_return_sequences]
                    completion = Completion(prompt, tokens, finished, lp)
                    if recorded is not None:
                        completion.routes = row_routes(recorded, j, len(prompt), ids.shape[1], len(tokens))
                    results.append(completion)
    finally:
        inner.train(was_training)
    return results


def row_routes(
    recorded: routing.RoutingRecorder, row: int, prompt: int, width: int, new: int
) -> torch.Tensor:
    """Row ``row``'s routes ``[prompt + new, routers, k]`` from a ``generate`` call's router calls: the first
    call ran the left-padded prompts (``width`` positions a row), each later one the token sampled before
    it; the last token was never fed (-1)."""
    per_router = []
    for calls in recorded.calls:
        prefill = calls[0].view(-1, width, calls[0].shape[-1])[row, width - prompt :]
        fed = [step[row] for step in calls[1:new]]
        unfed = prefill.new_full((new - len(fed), prefill.shape[-1]), -1)
        per_router.append(torch.cat([prefill, *(f[None] for f in fed), unfed]))
    return torch.stack(per_router, dim=1).cpu()


@contextlib.contextmanager
def sampling_guard() -> Iterator[None]:
    """A policy whose probabilities are no longer finite (weights blown up by too high a learning rate)
    stops the run naming what happened, instead of torch's "probability tensor contains inf"."""
    try:
        yield
    except RuntimeError as e:
        if "probability tensor contains" not in str(e):
            raise
        raise DivergenceError(
            "the policy's next-token probabilities are not finite (inf, NaN or negative) while sampling a "
            f"rollout: its weights diverged. Fix: {DIVERGENCE_FIX}"
        ) from None


def image_inputs(
    model: torch.nn.Module, ids: torch.Tensor, vision: list[dict[str, torch.Tensor] | None]
) -> dict[str, torch.Tensor]:
    """A left-padded batch's image kwargs: every prompt's images in order, and for M-RoPE models the token
    types ``generate`` needs to compute each row's positions (it skips the padding by the mask)."""
    device = ids.device
    images = {k: v.to(device) for k, v in (concat_vision(vision) or {}).items()}
    if uses_mrope(model.config):
        images["mm_token_type_ids"] = image_token_types(ids, model.config)
    return images


def _device(engine: torch.nn.Module) -> torch.device:
    """Where inputs go (a sharded parameter's device is its shard's)."""
    return getattr(engine, "device", None) or next(engine.parameters()).device


class Engine(Protocol):
    def sync_weights(self) -> None:
        """Make sampling use the policy's current weights (called before every rollout)."""

    def complete(
        self,
        prompts: list[list[int]],
        n: int,
        seeds: list[int],
        greedy: bool = False,
        vision: list[dict[str, torch.Tensor] | None] | None = None,
    ) -> list[Completion]:
        """``n`` completions per prompt, a prompt's samples consecutive, each prompt's sampling seeded by
        its own seed (so what a prompt gets never depends on the rank or batch it was sampled in);
        ``vision[i]``: prompt ``i``'s image inputs (vision-language policies)."""


def eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    """Every token that ends a completion: the generation config's EOS ids, else the tokenizer's."""
    eos = unwrap(model).generation_config.eos_token_id or tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


class HFEngine:
    """``generate`` on the policy itself: always in sync, no second copy of the weights."""

    def __init__(self, policy: torch.nn.Module, tokenizer: Any, rollout: Any):
        self.policy, self.tokenizer, self.rollout = policy, tokenizer, rollout

    def sync_weights(self) -> None:
        """Nothing to copy: the policy samples itself."""

    def complete(
        self,
        prompts: list[list[int]],
        n: int,
        seeds: list[int],
        greedy: bool = False,
        vision: list[dict[str, torch.Tensor] | None] | None = None,
    ) -> list[Completion]:
        """Batched ``generate`` calls of ``generation_batch_size // n`` prompts; sampling through
        :class:`SeededSampler` (each completion a function of its prompt's seed, with its log-probs)."""
        r = self.rollout
        batch = max(1, r.generation_batch_size // n)
        return generate(
            self.policy,
            self.tokenizer,
            prompts,
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            batch_size=batch,
            vision=vision,
            num_return_sequences=1 if greedy else n,
            seeds=None if greedy else seeds,
            routes=r.routing_replay,
        )
