"""What every trainer does before its first step: accelerator, seeds, the topology, tokenizer, model (and
its image side), LoRA, saved config."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from padless.config.loading import precedence_notes, to_dict
from padless.config.schema import ModelSettings
from padless.data.images import ImageInputs
from padless.data.sources import image_inputs
from padless.errors import InputError
from padless.forward import hybrid, ranks
from padless.forward.engine import EngineSettings, ModelEngine
from padless.forward.routers import SPLIT_ROWS, RouterLoss
from padless.proof.load import Task, load_model, load_tokenizer, pad_token_id, resolve_dtype
from padless.run import rundir
from padless.run.logs import describe_run, setup_logging
from padless.run.reporting import remember_config
from padless.run.strategy import expected_strategy, prepare_frozen, start_accelerator

log = logging.getLogger(__name__)


@dataclass
class Session:
    accelerator: Accelerator
    tokenizer: Any
    model: torch.nn.Module  # the trained Hugging Face model (a PEFT wrapper with LoRA), not yet prepared
    model_cfg: ModelSettings
    settings: EngineSettings  # what every engine of this run runs with (kernel pin, logits budget, topology)
    images: ImageInputs | None  # the model's image side (its processor): vision-language models only

    def companion(
        self, name: str | None = None, task: Task = "causal-lm", trainable: bool = False
    ) -> torch.nn.Module:
        """A reference or value model on the policy's backend, dtype and device; frozen unless trainable."""
        model = load_model(
            name or self.model_cfg.name,
            task=task,
            attn_implementation=self.model_cfg.attn_implementation,
            dtype=next(self.model.parameters()).dtype,
            device=self.accelerator.device,
            seed=self.model_cfg.seed,
            training=trainable,
            trust_remote_code=self.model_cfg.trust_remote_code,
            pad_id=pad_token_id(self.tokenizer),
            varlen_kernel=self.settings.varlen_kernel,
            settings=self.settings,
        )
        return model if trainable else model.requires_grad_(False)

    def engine(self, value: torch.nn.Module | None = None) -> ModelEngine:
        """The trained model (with ``value`` beside it: PPO) as the engine the loop trains."""
        return ModelEngine(self.model, value, self.settings)

    def frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` as a prepared frozen engine (reference, reward model): sharded like the trained one."""
        return prepare_frozen(self.accelerator, ModelEngine(model, settings=self.settings))


def _tree_packing(train: Any, shared_prompts: bool) -> str:
    """``train.tree_packing``: off where rows are padded (no packed row to lay out as a tree); ``auto`` is
    off where the task's sequences share no prompt by construction (``shared_prompts`` false: SFT), for
    what its examples share is a chat template's header, too little for a tree row to pay (``on`` still
    asks for it: a long system prompt every example holds)."""
    if train.batching == "padded":
        return "off"
    if train.tree_packing == "auto" and not shared_prompts:
        log.info(
            "tree packing off (auto): this task's examples share no prompt by construction; set "
            "train.tree_packing: on to compute a system prompt they all hold once"
        )
        return "off"
    return train.tree_packing


def resolve_model_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is bf16 on CUDA (where kernels are fast in it) and fp32 on CPU (exact)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return resolve_dtype(name)


def start_session(
    model_cfg: ModelSettings,
    seed: int,
    output_dir: str,
    config: Any,
    task: Task = "causal-lm",
    shared_prompts: bool = True,
) -> Session:
    """Load the policy (or scorer) on its proven backend, apply LoRA / checkpointing, save the config.
    ``shared_prompts``: whether the task packs sequences that share a prompt (pairs, groups), which
    ``train.tree_packing: auto`` computes once (:func:`_tree_packing`)."""
    accelerator = start_accelerator(config.train.max_grad_norm)
    setup_logging(config.train.log_level, accelerator.is_main_process)
    rundir.claim(accelerator, config.train)  # the folder is this run's (or it stops here); ends in end_run
    rundir.log_to_file(output_dir, accelerator.is_main_process)
    set_seed(seed)
    topology = ranks.start(config.train.sequence_parallel)  # handed down with every engine of this run
    settings = EngineSettings(
        model_cfg.varlen_kernel,
        config.train.logits_memory_mb,
        topology,
        _tree_packing(config.train, shared_prompts),
        model_cfg.router_aux_loss_coef,
    )
    dtype = resolve_model_dtype(model_cfg.dtype, accelerator.device)
    tokenizer = load_tokenizer(model_cfg.name, model_cfg.trust_remote_code)
    model = load_trainable(model_cfg, accelerator.device, dtype, task, pad_token_id(tokenizer), settings)
    problem = hybrid.sharded_problem(model, expected_strategy(accelerator), accelerator.num_processes)
    if problem:
        raise InputError(problem)
    router = RouterLoss.of(model, model_cfg.router_aux_loss_coef)  # an override on a dense model: refused
    if router is not None:
        if router.coef and config.train.sequence_parallel > 1:
            raise InputError(SPLIT_ROWS)
        log.info(router.describe(model_cfg.name, model_cfg.router_aux_loss_coef))
    log.info(describe_run(accelerator, model, model_cfg.name, model_cfg.dtype))
    for note in precedence_notes(config):  # keys another key overrides by design (max_steps, warmup_steps)
        log.info(note)
    if accelerator.is_main_process:
        rundir.save_run_config(config, Path(output_dir))
        remember_config(to_dict(config), output_dir)  # the trackers record it
    images = image_inputs(model_cfg.name, model)
    return Session(accelerator, tokenizer, model, model_cfg, settings, images)


def load_trainable(
    model_cfg: ModelSettings,
    device: torch.device,
    dtype: torch.dtype,
    task: Task,
    pad_id: int | None,
    settings: EngineSettings,
) -> torch.nn.Module:
    model = load_model(
        model_cfg.name,
        task=task,
        attn_implementation=model_cfg.attn_implementation,
        dtype=dtype,
        device=device,
        seed=model_cfg.seed,
        training=True,
        trust_remote_code=model_cfg.trust_remote_code,
        pad_id=pad_id,
        varlen_kernel=settings.varlen_kernel,
        settings=settings,
    )
    if model_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if model_cfg.lora is not None:
        from peft import LoraConfig, get_peft_model

        lora = model_cfg.lora
        config = LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=lora.target_modules,
            task_type="CAUSAL_LM" if task == "causal-lm" else "SEQ_CLS",
        )
        try:
            model = get_peft_model(model, config)
        except ValueError as e:  # no module matches, or one matches that adapters cannot go into
            raise InputError(lora_problem(model, lora.target_modules, e)) from None
    return model


def lora_problem(model: torch.nn.Module, targets: list[str] | str, error: Exception) -> str:
    """Why peft refused ``model.lora.target_modules``, with the names of the model's linear layers."""
    names = sorted(
        {name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        - {"lm_head", "score"}
    )
    said = (str(error).strip().splitlines() or [type(error).__name__])[0].rstrip("( ")
    regex = isinstance(targets, str) and targets != "all-linear"
    how = (
        " (a single string is a regular expression matched against whole module paths such as "
        "model.layers.0.self_attn.q_proj; a list matches the last part of a name)"
        if regex
        else ""
    )
    return (
        f"model.lora.target_modules={targets!r}: peft puts no adapter there (peft: {said}){how}; the "
        f"model's linear layers are named {', '.join(names)}; fix: list some of them, e.g. "
        f"[{', '.join(names[:2])}], or use all-linear"
    )
