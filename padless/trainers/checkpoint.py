"""Checkpoints written atomically: a temporary directory renamed into place, never a half checkpoint.

Layout of ``checkpoint-N/``: the model in Hugging Face format (safetensors; the adapter only for LoRA)
with its tokenizer, so ``from_pretrained`` and ``padless generate`` load it directly; ``state/`` with
optimizer, scheduler and RNG states from accelerate (model weights are not duplicated there);
``plan.pt`` with the current epoch's planned data when the recipe's plan cannot be recomputed (a rollout
saved mid-way); ``trainer_state.json`` with the step and data position, written last.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from safetensors.torch import load_file

STATE_FILE = "trainer_state.json"
PLAN_FILE = "plan.pt"


@dataclass
class TrainState:
    """Where training stands: enough to continue exactly."""

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    tokens_seen: int = 0


def skip_model_weights_in_state(accelerator: Accelerator) -> None:
    """Keep accelerate's state to optimizer / scheduler / RNG: weights live in the HF-format files."""
    accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: weights.clear())
    accelerator.register_load_state_pre_hook(lambda models, input_dir: models.clear())


def save_checkpoint(
    accelerator: Accelerator,
    model: torch.nn.Module,
    tokenizer: Any,
    state: TrainState,
    output_dir: str | Path,
    plan: Any = None,
) -> Path:
    root = Path(output_dir)
    final = root / f"checkpoint-{state.step}"
    tmp = root / f".tmp-checkpoint-{state.step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if plan is not None:
            torch.save(plan, tmp / PLAN_FILE)
    accelerator.save_state(str(tmp / "state"))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2))
        if final.exists():  # a re-run reached the same step: replace it whole
            trash = root / f".old-checkpoint-{state.step}"
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
    accelerator.wait_for_everyone()
    return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(accelerator: Accelerator, model: torch.nn.Module, path: Path) -> tuple[TrainState, Any]:
    """Restore weights (HF files), optimizer / scheduler / RNG (accelerate state); return the train state
    and the saved plan (``None`` if there is none)."""
    unwrapped = accelerator.unwrap_model(model)
    custom = getattr(unwrapped, "load_hf_weights", None)  # models made of several HF models load themselves
    custom(path) if custom is not None else load_hf_weights(unwrapped, path)
    accelerator.load_state(str(path / "state"))
    plan = torch.load(path / PLAN_FILE, weights_only=True) if (path / PLAN_FILE).exists() else None
    return TrainState(**json.loads((path / STATE_FILE).read_text())), plan


def load_hf_weights(model: torch.nn.Module, path: Path) -> None:
    """Weights written by ``save_pretrained`` (a LoRA adapter, or the full model) back into ``model``."""
    if (path / "adapter_model.safetensors").exists():
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(path / "adapter_model.safetensors"))
        return
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(load_file(file))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = set(_tied_keys(model))
    if unexpected or set(missing) - tied:
        raise RuntimeError(
            f"checkpoint {path} does not match the model: missing {sorted(set(missing) - tied)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}; resume with the model settings it was trained with"
        )


def _tied_keys(model: torch.nn.Module) -> list[str]:
    """Parameter names that share storage with an earlier one (dropped by save_pretrained)."""
    seen: dict[int, str] = {}
    tied = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.append(name)
        else:
            seen[id(param)] = name
    return tied
