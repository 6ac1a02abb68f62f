"""A checkpoint is checked against the run's model before anything is loaded from it.

Resuming a checkpoint written by another model, other LoRA settings or a killed copy would otherwise end
in a shape error deep inside a load, or worse, succeed silently (an adapter whose tensor names match
nothing loads zero tensors and training continues from scratch). Here every weight file's header is read
(sizes checked against the file, nothing unpickled) and its tensor names and shapes are compared with
the model's, so the message names the checkpoint, what differs, and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from padless.data.sources import ADAPTER_WEIGHTS, check_safetensors, check_weights
from padless.errors import InputError
from padless.forward.engine import inner_engine
from padless.forward.vision import model_keys
from padless.run.rundir import STATE_FILE

STATE_KEYS = ("step", "epoch", "step_in_epoch", "tokens_seen")
EARLIER = "resume from an earlier checkpoint (train.resume_from_checkpoint=<its path>)"
FIX = (
    "resume with the model settings that wrote it (model.name, model.lora), or start fresh with "
    "train.resume_from_checkpoint=null in another train.output_dir"
)


def verify_checkpoint(path: Path, model: torch.nn.Module) -> None:
    """Raise :class:`InputError` unless ``path`` has a readable train state and weights that fit ``model``,
    the prepared engine (a :class:`~padless.forward.engine.ModelEngine`, possibly wrapped)."""
    files = _verify_state(path / STATE_FILE)
    listed = {str(path / f) for f in files} if files else None
    engine = inner_engine(model)
    for name, where in (("model", path), ("value", path / "value")):  # the layout export_model writes
        part = getattr(engine, name)
        if part is not None:
            _verify_weights(part, where, path, listed)
    missing = [f for f in files if not (path / f).is_file()]
    if missing:
        raise InputError(
            f"checkpoint {path}: {len(missing)} of the files it lists are missing (e.g. {missing[0]}); "
            f"fix: {EARLIER}"
        )


def _verify_state(file: Path) -> list[str]:
    """Check the train state; return the checkpoint's list of files ([] when it predates the list)."""
    try:
        state = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{file}: unreadable train state ({e}); fix: {EARLIER}") from None
    bad = [k for k in STATE_KEYS if not isinstance(state.get(k) if isinstance(state, dict) else None, int)]
    if bad:
        raise InputError(f"{file}: the train state lacks whole-number {', '.join(bad)}; fix: {EARLIER}")
    return state.get("files", [])


def _shapes(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Full shapes, also of ZeRO-3 partitioned parameters (which keep theirs in ``ds_shape``)."""
    return {k: tuple(getattr(v, "ds_shape", v.shape)) for k, v in state.items()}


def _tied(model: torch.nn.Module) -> set[str]:
    """Names of parameters sharing storage with an earlier one: save_pretrained writes them once."""
    seen: set[int] = set()
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
        seen.add(id(param))
    return tied


def _verify_weights(model: torch.nn.Module, folder: Path, checkpoint: Path, listed: set[str] | None) -> None:
    adapter = folder / ADAPTER_WEIGHTS
    lora = hasattr(model, "peft_config")
    if adapter.exists() != lora:
        has, needs = ("a LoRA adapter", "has none") if lora is False else ("full weights", "is a LoRA model")
        raise InputError(
            f"checkpoint {checkpoint} holds {has} but this run's model {needs}; fix: set model.lora as in "
            "the run that wrote it, or start fresh with train.resume_from_checkpoint=null"
        )
    if lora:
        from peft import get_peft_model_state_dict

        found = {k: tuple(v["shape"]) for k, v in check_safetensors(adapter).items()}
        expected = _shapes(get_peft_model_state_dict(model, state_dict=model.state_dict(keep_vars=True)))
        optional: set[str] = set()
    else:
        check_weights(folder, f"checkpoint {checkpoint}")  # names pickle-only and missing weights
        found = {}
        for file in sorted(folder.glob("*.safetensors")):
            if listed is not None and str(file) not in listed:
                continue  # not part of the checkpoint: never loaded
            found.update({k: tuple(v["shape"]) for k, v in check_safetensors(file).items()})
        found = model_keys(model, found)  # the names save_pretrained changed (vision-language models)
        expected = _shapes(model.state_dict(keep_vars=True))
        optional = _tied(model)
    missing = sorted(set(expected) - set(found) - optional)
    unexpected = sorted(set(found) - set(expected))
    reshaped = sorted(k for k in set(found) & set(expected) if found[k] != expected[k])
    if missing or unexpected or reshaped:
        problems = []
        if missing:
            problems.append(f"{len(missing)} of the model's tensors missing (e.g. {missing[0]})")
        if unexpected:
            problems.append(f"{len(unexpected)} tensors the model does not have (e.g. {unexpected[0]})")
        if reshaped:
            k = reshaped[0]
            problems.append(
                f"{len(reshaped)} with other shapes (e.g. {k}: {list(found[k])} in the file, "
                f"{list(expected[k])} in the model)"
            )
        raise InputError(
            f"checkpoint {checkpoint} does not fit this run's model: {'; '.join(problems)}; fix: {FIX}"
        )
