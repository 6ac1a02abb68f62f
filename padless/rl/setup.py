"""What an RL run starts from: the session, the prompts, the sampling engine, the scorer (reward functions
and reward model) and the frozen reference, built once by :func:`start_rl` for a rollout recipe."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from padless.data.images import ImageInputs
from padless.data.prompts import PromptLayout
from padless.data.sources import require_scoring_model
from padless.data.tokenized import load_set
from padless.forward import ranks
from padless.forward.ranks import Topology
from padless.forward.vision import require_same_inputs
from padless.proof.load import disable_dropout, load_model, load_tokenizer, pad_token_id
from padless.rl.generate import Engine
from padless.rl.rewards import RewardComposer
from padless.rl.sampling import check_sampling, make_engine
from padless.rl.scoring import Scorer
from padless.run.reporting import report_data
from padless.run.session import Session, start_session

log = logging.getLogger(__name__)


@dataclass
class RolloutSetup:
    """What a rollout recipe is built from. ``policy``: the trained engine (the recipe samples through its
    prepared form once bound); ``ref_model``: a prepared frozen reference, None for a LoRA policy (its
    adapters switched off) or when the recipe uses none; ``images``: a vision-language policy's image side,
    so each sample keeps its prompt's images in every pass; ``scorer``: by default one with neither reward
    functions nor a reward model (environment reward and penalties only); ``topology``: the run's (the
    session's), by which prompts are shared out, also before an engine is bound (one process's by
    default)."""

    prompts: Any  # a sequence of PromptExample (an on-disk ExampleSet)
    cfg: Any
    tokenizer: Any
    policy: torch.nn.Module
    engine: Engine
    device: torch.device
    scorer: Scorer = None  # type: ignore[assignment]
    eval_prompts: Any = field(default_factory=list)
    ref_model: torch.nn.Module | None = None
    images: ImageInputs | None = None
    topology: Topology = field(default_factory=ranks.start)

    def __post_init__(self) -> None:
        if self.scorer is None:
            self.scorer = Scorer(self.cfg, self.tokenizer)
        self.eval_prompts = self.eval_prompts or []


def without_dropout(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """RL models train without dropout (said in the log when some was on)."""
    if changed := disable_dropout(model):
        log.info("%s: %d dropout layers set to 0 (log-prob ratios compare like with like)", name, changed)
    return model


def start_rl(cfg: Any, reference: bool) -> tuple[Session, RolloutSetup]:
    """The session and everything a rollout recipe is built from: prompts, engine, scorer, and (if
    ``reference``, and the policy has no LoRA adapters to switch off) a frozen reference copy. Sampling
    settings padless refuses together are refused before any model loads."""
    check_sampling(cfg)
    session = start_session(cfg.model, cfg.train.seed, cfg.train.output_dir, cfg)
    without_dropout(session.model, "policy")
    tokenizer, device, data = session.tokenizer, session.accelerator.device, cfg.data
    images = session.images

    def prompts(spec: str, role: str) -> Any:
        layout = PromptLayout(
            max_prompt_length=data.max_prompt_length,
            chat_template=data.chat_template,
            skip_bad_rows=data.skip_bad_rows,
        )
        examples, stats = load_set(
            spec, layout, tokenizer, images=images, cache_dir=data.cache_dir, num_proc=data.num_proc
        )
        report_data(stats, role, spec, cfg.train.output_dir)
        return examples

    reward_model = None
    if cfg.reward.model:
        require_scoring_model(cfg.reward.model)
        trust = cfg.model.trust_remote_code
        pad_id = pad_token_id(load_tokenizer(cfg.reward.model, trust))  # where its scores are read
        scorer = load_model(
            cfg.reward.model,
            task="score",
            device=device,
            pad_id=pad_id,
            trust_remote_code=trust,
            varlen_kernel=session.settings.varlen_kernel,
        )
        require_same_inputs(session.model, scorer, f"reward.model {cfg.reward.model}")
        reward_model = session.frozen(scorer)
    train = prompts(data.train, "train")
    engine = make_engine(cfg, session.model, tokenizer, images)
    functions = RewardComposer(cfg.reward.functions, cfg.reward.weights) if cfg.reward.functions else None
    return session, RolloutSetup(
        prompts=train,
        cfg=cfg,
        tokenizer=tokenizer,
        policy=session.model,
        engine=engine,
        device=device,
        scorer=Scorer(cfg, tokenizer, functions, reward_model),
        eval_prompts=prompts(data.eval, "eval") if data.eval else None,
        ref_model=session.frozen(session.companion()) if reference and cfg.model.lora is None else None,
        images=images,
        topology=session.settings.topology,
    )
