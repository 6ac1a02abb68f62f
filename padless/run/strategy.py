"""Which data-parallel strategy trains — DDP, FSDP2 or DeepSpeed ZeRO-2 / ZeRO-3 — and proof that it is
the one running.

The strategy is what ``accelerate launch`` asked for (its config sets ``ACCELERATE_USE_FSDP`` /
``ACCELERATE_USE_DEEPSPEED`` and the plugin's settings in the environment). On a machine without CUDA
accelerate quietly turns any multi-process run into plain DDP over gloo (``MULTI_CPU``) and drops mixed
precision; padless instead makes the requested strategy real on CPU processes (FSDP2 and DeepSpeed both
run over gloo), so the code users run on GPUs is the code the CPU tests run. After ``prepare`` the
prepared model is inspected: DTensor parameters for FSDP2, a DeepSpeed engine at the requested ZeRO stage,
a DDP wrapper for DDP. Anything else stops the run.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DistributedType

log = logging.getLogger(__name__)

STRATEGIES = ("single", "ddp", "fsdp2", "zero2", "zero3")


class StrategyError(ValueError):
    """The requested data-parallel strategy cannot run as asked."""


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() == "true"


def deepspeed_requested() -> bool:
    """Whether the launcher asked for DeepSpeed (accelerate's environment)."""
    return _env_flag("ACCELERATE_USE_DEEPSPEED")


def requested_strategy() -> str:
    """The strategy the launcher asked for, from accelerate's environment variables."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if deepspeed_requested():
        return "zero"  # the stage is read from the plugin
    if _env_flag("ACCELERATE_USE_FSDP"):
        version = os.environ.get("FSDP_VERSION", "1")
        if version != "2":
            raise StrategyError(
                f"FSDP version {version} was requested; padless runs FSDP2 only (fully_shard): set "
                "`fsdp_version: 2` in the accelerate config (see examples/accelerate/fsdp2.yaml)"
            )
        return "fsdp2"
    return "ddp" if world > 1 else "single"


def _refuse_accelerate_accumulation() -> None:
    """padless accumulates by its own plan (token budgets, variable micro-batches per step); accelerate's
    counter would divide every loss by its own step count and rescale gradients silently."""
    value = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")
    if value not in ("1", "auto"):
        raise StrategyError(
            f"accelerate's gradient_accumulation_steps is {value}: it would divide every gradient by {value} "
            "on top of padless's own accumulation; remove it from the accelerate config / environment and "
            "set train.gradient_accumulation_steps in the padless config instead"
        )


def _deepspeed_plugin(max_grad_norm: float, world: int) -> Any:
    from accelerate import DeepSpeedPlugin

    if _env_flag("ACCELERATE_DEEPSPEED_ZERO3_INIT"):
        raise StrategyError(
            "zero3_init_flag: true was requested; padless loads each model whole on every rank and lets "
            "ZeRO-3 shard it at prepare (its load-time kernel probe runs a real forward): set "
            "zero3_init_flag: false in the accelerate config"
        )
    plugin = DeepSpeedPlugin(zero3_init_flag=False)
    config = plugin.deepspeed_config
    stage = config.get("zero_optimization", {}).get("stage")
    if stage not in (2, 3):
        raise StrategyError(
            f"DeepSpeed ZeRO stage {stage} was requested; padless runs and tests ZeRO-2 and ZeRO-3: set "
            "`zero_stage: 2` or `3` (see examples/accelerate/deepspeed_zero2.yaml)"
        )
    gas = config.get("gradient_accumulation_steps", 1)
    if gas not in (1, "auto"):
        raise StrategyError(
            f"the DeepSpeed config sets gradient_accumulation_steps={gas}: DeepSpeed would step on its own "
            "count; remove it and set train.gradient_accumulation_steps in the padless config"
        )
    clipping = config.get("gradient_clipping", "auto")
    if clipping != "auto" and float(clipping) != float(max_grad_norm):
        raise StrategyError(
            f"the DeepSpeed config clips gradients at {clipping} but train.max_grad_norm is {max_grad_norm}: "
            "remove gradient_clipping from the DeepSpeed config (padless sets it from train.max_grad_norm)"
        )
    # Micro-batches are token budgets, not row counts: DeepSpeed's batch keys only feed its own
    # throughput accounting, so they are set explicitly (accelerate cannot infer them without a DataLoader).
    config.update(
        train_micro_batch_size_per_gpu=1,
        gradient_accumulation_steps=1,
        train_batch_size=world,
        gradient_clipping=float(max_grad_norm),
    )
    if stage == 3:
        # a normal HF checkpoint is exported from gathered 16-bit weights
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    return plugin


def start_accelerator(max_grad_norm: float) -> Accelerator:
    """The accelerator for the launcher's strategy, made real on CPU processes."""
    _refuse_accelerate_accumulation()
    strategy = requested_strategy()
    cuda = torch.cuda.is_available()
    _fresh_state(cuda)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    kwargs: dict[str, Any] = {}
    if strategy == "fsdp2":
        from accelerate import FullyShardedDataParallelPlugin

        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin()
    elif strategy == "zero":
        kwargs["deepspeed_plugin"] = _deepspeed_plugin(max_grad_norm, world)
    requested_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    accelerator = Accelerator(cpu=not cuda, **kwargs)  # cpu=True lets `accelerate launch` use gloo
    if not cuda and strategy in ("fsdp2", "zero"):
        _force_on_cpu(accelerator, strategy, kwargs, requested_precision)
    if strategy == "zero":
        from transformers.integrations import unset_hf_deepspeed_config

        # accelerate registers its DeepSpeed config with transformers whatever zero3_init_flag says, and
        # transformers would then build every model already partitioned (zero.Init): models load whole
        # and are sharded when prepared
        unset_hf_deepspeed_config()
    if accelerator.mixed_precision != requested_precision:
        raise StrategyError(
            f"mixed_precision={requested_precision} was requested but accelerate runs "
            f"{accelerator.mixed_precision} here (accelerate runs multi-process CPU training in fp32 only); "
            "use mixed_precision: 'no' on CPU, or model.dtype to pick the weights' precision"
        )
    return accelerator


def _fresh_state(cuda: bool) -> None:
    """accelerate's state as a fresh process finds it (the process group stays): a second run in one
    process (a notebook, a test session) must not inherit the last run's strategy or precision."""
    AcceleratorState._reset_state()
    GradientState._reset_state()
    if not cuda and PartialState._shared_state.get("distributed_type") in (
        DistributedType.FSDP,
        DistributedType.DEEPSPEED,
    ):
        PartialState().distributed_type = DistributedType.MULTI_CPU  # undo what _force_on_cpu set


def _force_on_cpu(accelerator: Accelerator, strategy: str, plugins: dict[str, Any], precision: str) -> None:
    """Switch accelerate's shared state from ``MULTI_CPU`` to the requested strategy (accelerate only
    selects FSDP / DeepSpeed when it sees a GPU; both run over gloo)."""
    kind = DistributedType.FSDP if strategy == "fsdp2" else DistributedType.DEEPSPEED
    PartialState().distributed_type = kind  # AcceleratorState re-reads it from PartialState's shared state
    state = accelerator.state
    state.distributed_type = kind
    if kind == DistributedType.FSDP:
        state.fsdp_plugin = plugins["fsdp_plugin"]
        return
    import deepspeed

    plugin = plugins["deepspeed_plugin"]
    state.deepspeed_plugins = plugin
    plugin.set_mixed_precision(precision)  # DeepSpeed casts the weights itself: bf16 runs on CPU too
    plugin.select(_from_accelerator_state=True)
    without_shm_kernel()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)


def without_shm_kernel() -> None:
    """Keep DeepSpeed's CPU backend from building its shared-memory all-reduce kernel when it starts: a C++
    compile (about 25 s on 2 cores; again whenever another environment rebuilt the torch-extensions cache
    with other flags) for one caller only, the all-reduce of tensor-parallel inference, which padless never
    runs. Every collective ZeRO runs goes through torch.distributed (gloo) with or without it. DeepSpeed
    keeps which ops can be built in one dict for the process, read when its backend starts."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def verify_strategy(accelerator: Accelerator, model: torch.nn.Module, strategy: str) -> None:
    """Stop unless the prepared ``model`` really runs under ``strategy``."""
    found = strategy_in_use(model)
    if found != strategy:
        raise StrategyError(
            f"{strategy} was requested but the prepared model runs under {found} "
            f"(accelerate reports {accelerator.distributed_type.value}); nothing was trained"
        )
    log.info("data-parallel strategy: %s on %d process(es)", strategy, accelerator.num_processes)


def expected_strategy(accelerator: Accelerator) -> str:
    """The strategy accelerate's state says is running."""
    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        return "fsdp2"
    if kind == DistributedType.DEEPSPEED:
        return f"zero{accelerator.state.deepspeed_plugin.zero_stage}"
    return "single" if kind == DistributedType.NO else "ddp"


def strategy_in_use(model: torch.nn.Module) -> str:
    """What the prepared model actually is: ``fsdp2`` (DTensor parameters), ``zero2`` / ``zero3`` (a
    DeepSpeed engine at that stage), ``ddp`` (a DDP wrapper) or ``single``."""
    from torch.distributed.tensor import DTensor

    if type(model).__name__ == "DeepSpeedEngine":
        return f"zero{model.zero_optimization_stage()}"
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return "ddp"
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return "fsdp2"
    return "single"


def prepare_frozen(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """A frozen engine (reference, reward model) under the trained engine's strategy and precision policy:
    sharded under FSDP2 and ZeRO-3 (never a full copy per rank there), a DeepSpeed inference engine under
    ZeRO-2, autocast-wrapped like the trained model otherwise."""
    model.requires_grad_(False).eval()
    strategy = expected_strategy(accelerator)
    if strategy == "fsdp2":
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        prepared = fsdp2_prepare_model(accelerator, model)
    elif strategy.startswith("zero"):
        import deepspeed

        config = dict(accelerator.state.deepspeed_plugin.deepspeed_config)
        config.pop("optimizer", None)
        config.pop("scheduler", None)
        stage = 3 if strategy == "zero3" else 0  # ZeRO-2 shards optimizer state only: nothing to shard here
        config["zero_optimization"] = {**config.get("zero_optimization", {}), "stage": stage}
        prepared = deepspeed.initialize(model=model, config=config)[0]
        prepared.eval()
    else:
        prepared = accelerator.prepare_model(model, evaluation_mode=True)
    found = strategy_in_use(prepared)
    expected = {"zero2": "zero0", "ddp": "single"}.get(strategy, strategy)
    if found != expected:
        raise StrategyError(f"the frozen model was meant to run under {expected} but runs under {found}")
    return prepared
