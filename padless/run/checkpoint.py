"""Checkpoints written atomically, in formats that hold data only: nothing in a checkpoint is unpickled.

Layout of ``checkpoint-N/``:

- the model in Hugging Face format (safetensors; the adapter only for LoRA; a PPO value model in
  ``value/``) with its tokenizer, so ``from_pretrained`` and ``padless generate`` load it directly. Under
  FSDP2 and ZeRO-3 it is gathered to rank 0 once (never a full copy per rank);
- ``state/``: per rank, the optimizer state as it lives on that rank (FSDP2 and ZeRO shards, not
  gathered) in ``optimizer-<rank>.safetensors`` with its structure in ``optimizer-<rank>.json``, the RNG
  states in ``rng-<rank>.safetensors`` / ``.json``, and the learning-rate schedule in ``scheduler.json``;
- ``state/recipe-<rank>.json``: what each rank's recipe keeps for the run to continue on the same data
  (:meth:`padless.run.loop.Recipe.state`): a rollout trained half-way, rollouts sampled ahead with
  ``rollout.max_staleness``; absent when there is nothing;
- ``trainer_state.json`` with the step, data position, strategy and world size, the resume terms (see
  :mod:`padless.run.contract`) and the list of the checkpoint's files, written last. A checkpoint
  loads exactly the files it lists: a stray ``*.safetensors`` dropped beside them is never read.

The checkpoint is built in a temporary directory and renamed into place: a killed run never leaves a
half checkpoint; a failed write (a full disk) removes the temporary folder and says which category
of failure it was (see :mod:`padless.faults`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from safetensors.torch import load_file, save_file

from padless.errors import InputError
from padless.faults import ChangedFile, doing
from padless.forward.engine import inner_engine
from padless.forward.vision import model_keys
from padless.run.rundir import STATE_FILE, own

log = logging.getLogger(__name__)


def recipe_file(path: Path, rank: int) -> Path:
    """Where checkpoint ``path`` keeps rank ``rank``'s recipe state."""
    return path / "state" / f"recipe-{rank}.json"


@dataclass
class TrainState:
    """Where training stands: enough to continue exactly."""

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    tokens_seen: int = 0
    strategy: str = "single"
    world_size: int = 1
    terms: dict[str, Any] = field(default_factory=dict)  # what the checkpoint belongs to (contract.py)
    files: list[str] = field(default_factory=list)  # the checkpoint's files, relative; [] before they were
    digests: dict[str, list[Any]] = field(default_factory=dict)  # file -> [size, sha256] when written


def file_digest(file: Path) -> list[Any]:
    """A file's size and sha256, as a checkpoint records them."""
    sha = hashlib.sha256()
    with file.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            sha.update(chunk)
    return [file.stat().st_size, sha.hexdigest()]


def _checksum(record: dict[str, Any]) -> str:
    """The sha256 of a ``trainer_state.json`` record without its checksum: an edit of the record shows."""
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def verify_files(path: Path) -> None:
    """Every file checkpoint ``path`` lists has the size and sha256 it was written with, and its
    ``trainer_state.json`` its checksum: a file changed in a well-formed way (a plan with half its samples,
    a queue of rollouts replaced by ``[]``) is refused as surely as a truncated one, naming it. A
    checkpoint without the record (an older padless) is said in the log and checked by format only."""
    record = json.loads((path / STATE_FILE).read_text())
    checksum = record.pop("checksum", None) if isinstance(record, dict) else None
    if checksum is None:
        log.warning("%s records no file digests (an older padless wrote it): formats are checked only", path)
        return
    if checksum != _checksum(record):
        raise ChangedFile(f"{STATE_FILE} was changed after the checkpoint was written (its checksum differs)")
    for name, (size, sha) in record.get("digests", {}).items():
        file = path / name
        if not file.is_file():
            raise ChangedFile(f"{name} is missing (the checkpoint lists it)")
        found = file_digest(file)
        if found != [size, sha]:
            how = f"{found[0]} bytes, {size} then" if found[0] != size else "same size, other bytes"
            raise ChangedFile(f"{name} was changed after the checkpoint was written ({how})")


# ----------------------------------------------------------------------------------------------------------
# Nested state (dicts / lists of numbers, strings and tensors) <-> safetensors + JSON
# ----------------------------------------------------------------------------------------------------------


def _flatten(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON skeleton of ``tree``; its tensors go into ``tensors`` (a DTensor as its local shard)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, torch.Tensor):
        key = str(len(tensors))
        local = tree.to_local() if isinstance(tree, DTensor) else tree
        tensors[key] = local.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(tree, dict):
        return {"__dict__": [[_flatten(k, tensors), _flatten(v, tensors)] for k, v in tree.items()]}
    if isinstance(tree, (list, tuple)):
        return {"__list__": [_flatten(v, tensors) for v in tree], "tuple": isinstance(tree, tuple)}
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    raise TypeError(f"cannot store a {type(tree).__name__} in a checkpoint (only numbers, strings, tensors)")


def _unflatten(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, dict) and "__tensor__" in node:
        return tensors[node["__tensor__"]]
    if isinstance(node, dict) and "__dict__" in node:
        return {_unflatten(k, tensors): _unflatten(v, tensors) for k, v in node["__dict__"]}
    if isinstance(node, dict) and "__list__" in node:
        items = [_unflatten(v, tensors) for v in node["__list__"]]
        return tuple(items) if node["tuple"] else items
    return node


def save_tree(tree: Any, path: Path) -> None:
    """``path.json`` (structure) + ``path.safetensors`` (tensors)."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _flatten(tree, tensors)
    save_file(tensors, str(path.with_suffix(".safetensors")))
    path.with_suffix(".json").write_text(json.dumps(skeleton))


def load_tree(path: Path) -> Any:
    with reading(path.with_suffix(".safetensors")):
        tensors = load_file(str(path.with_suffix(".safetensors")))
    with reading(path.with_suffix(".json")):
        return _unflatten(json.loads(path.with_suffix(".json").read_text()), tensors)


def reading(file: Path) -> Any:
    """Read one file of a checkpoint: a failure names the file, the checkpoint and the fix."""
    checkpoint = next((p for p in file.parents if p.name.startswith("checkpoint-")), file.parent)
    fix = (
        f"resume from an earlier checkpoint (train.resume_from_checkpoint=<its path>) or delete {checkpoint}"
    )
    return doing(f"reading checkpoint {checkpoint}", file, corrupt_fix=fix)


# ----------------------------------------------------------------------------------------------------------
# Optimizer, RNG and schedule
# ----------------------------------------------------------------------------------------------------------


def _deepspeed_optimizer(optimizer: Any) -> Any | None:
    """The ZeRO optimizer inside accelerate's wrapper, or None when DeepSpeed is not in use."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return inner if type(inner).__module__.startswith("deepspeed.") else None


def optimizer_state(optimizer: Any) -> Any:
    """This rank's optimizer state: under ZeRO the base optimizer's state over its flat partitions plus
    the fp32 master partitions; otherwise the optimizer's own state dict (FSDP2: DTensor shards)."""
    zero = _deepspeed_optimizer(optimizer)
    if zero is None:
        return optimizer.state_dict()
    if hasattr(zero, "single_partition_of_fp32_groups"):  # ZeRO-1 / 2
        return {"base": zero.optimizer.state_dict(), "fp32": list(zero.single_partition_of_fp32_groups)}
    from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT

    state = zero._rigid_state_dict()  # ZeRO-3 attaches its partitions to the base optimizer only here
    return {"base": state[OPTIMIZER_STATE_DICT], "fp32": list(state[FP32_FLAT_GROUPS])}


def restore_optimizer(optimizer: Any, path: Path) -> None:
    zero = _deepspeed_optimizer(optimizer)
    saved = load_tree(path)
    if zero is None:
        optimizer.load_state_dict(_reshard(saved, optimizer))
    elif hasattr(zero, "single_partition_of_fp32_groups"):  # ZeRO-1 / 2: weights come from the HF export
        zero.optimizer.load_state_dict(saved["base"])
        for current, fp32 in zip(zero.single_partition_of_fp32_groups, saved["fp32"], strict=True):
            current.data.copy_(fp32)
    else:  # ZeRO-3: the partitioned weights are rebuilt from the fp32 partitions
        from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, LOSS_SCALER, OPTIMIZER_STATE_DICT

        zero._rigid_load_state_dict(
            {
                LOSS_SCALER: zero.loss_scaler,
                "dynamic_loss_scale": zero.dynamic_loss_scale,
                "overflow": False,
                OPTIMIZER_STATE_DICT: saved["base"],
                FP32_FLAT_GROUPS: saved["fp32"],
            }
        )


def _reshard(saved: dict[str, Any], optimizer: Any) -> dict[str, Any]:
    """Per-parameter state saved as local shards goes back onto its parameter's FSDP2 layout."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, entry in saved["state"].items():
        param = params[index]
        if isinstance(param, DTensor):
            for key, value in entry.items():
                if value.dim() > 0:  # moments have the parameter's shape; ``step`` is a scalar
                    entry[key] = DTensor.from_local(
                        value.to(param.device),
                        param.device_mesh,
                        param.placements,
                        shape=param.shape,
                        stride=param.stride(),
                    )
    return saved


def rng_state() -> dict[str, Any]:
    numpy = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [numpy[0], torch.from_numpy(numpy[1].astype(np.int64)), *numpy[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------------------------------------
# Save and load
# ----------------------------------------------------------------------------------------------------------


def export_model(accelerator: Accelerator, model: torch.nn.Module, tokenizer: Any, path: Path) -> None:
    """The engine's model(s) in Hugging Face format under ``path`` (gathered to rank 0 when sharded)."""
    engine = inner_engine(model)
    full = accelerator.get_state_dict(model)  # every rank takes part; rank 0 receives the full weights
    if not accelerator.is_main_process:
        return
    for name, where in (("model", path), ("value", path / "value")):
        part = getattr(engine, name)
        if part is None:
            continue
        prefix, tied = f"{name}.", set(_tied_keys(part))  # a gathered state dict holds tied copies apart
        weights = {k.removeprefix(prefix): v for k, v in full.items() if k.startswith(prefix)}
        weights = {k: v for k, v in weights.items() if k not in tied}
        part.save_pretrained(where, state_dict=weights, safe_serialization=True)
    tokenizer.save_pretrained(path)


def save_checkpoint(
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    tokenizer: Any,
    state: TrainState,
    output_dir: str | Path,
    recipe: Any = None,
) -> Path:
    """``recipe``: this rank's recipe state (JSON data), None when there is none."""
    root = Path(output_dir)
    tmp = root / f".tmp-checkpoint-{state.step}"
    with doing(f"writing checkpoint {state.step}", tmp, setting="train.output_dir"):
        try:
            return _save(accelerator, model, optimizer, scheduler, tokenizer, state, root, recipe)
        except BaseException:
            if accelerator.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)  # a failed or interrupted write leaves nothing
            raise


def _save(
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    tokenizer: Any,
    state: TrainState,
    root: Path,
    recipe: Any,
) -> Path:
    final = root / f"checkpoint-{state.step}"
    tmp = root / f".tmp-checkpoint-{state.step}"
    rank = accelerator.process_index
    if accelerator.is_main_process:
        own(root, final.name)
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "state").mkdir(parents=True)
    accelerator.wait_for_everyone()
    export_model(accelerator, model, tokenizer, tmp)
    save_tree(optimizer_state(optimizer), tmp / "state" / f"optimizer-{rank}")
    save_tree(rng_state(), tmp / "state" / f"rng-{rank}")
    if recipe is not None:
        recipe_file(tmp, rank).write_text(json.dumps(recipe))
    if accelerator.is_main_process:
        (tmp / "state" / "scheduler.json").write_text(json.dumps(scheduler.state_dict()))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        state.files = sorted(str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file())
        state.digests = {name: file_digest(tmp / name) for name in state.files}
        record = asdict(state)
        (tmp / STATE_FILE).write_text(json.dumps({**record, "checksum": _checksum(record)}, indent=2))
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


def load_checkpoint(
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    path: Path,
    strategy: str,
) -> TrainState:
    """Restore weights, optimizer, schedule and RNG; return the train state. Sharded state resumes only on
    the strategy and world size that wrote it."""
    fix = f"resume from an earlier checkpoint (train.resume_from_checkpoint=<its path>) or delete {path}"
    with doing(f"reading checkpoint {path}", path, corrupt_fix=fix):
        verify_files(path)
        return _load(accelerator, model, optimizer, scheduler, path, strategy)


def read_state(path: Path) -> TrainState:
    """The train state of checkpoint ``path`` (fields a newer padless added keep their defaults)."""
    saved = json.loads((path / STATE_FILE).read_text())
    known = set(TrainState.__dataclass_fields__)
    return TrainState(**{k: v for k, v in saved.items() if k in known})


def written_terms(path: Path) -> dict[str, Any]:
    """The resume terms checkpoint ``path`` records, read before it is verified (to name another trainer
    rather than the files it lacks); empty when unreadable, which verification then reports."""
    try:
        terms = json.loads((path / STATE_FILE).read_text()).get("terms")
    except (OSError, ValueError, AttributeError):
        return {}
    return terms if isinstance(terms, dict) else {}


def read_recipe_state(path: Path, rank: int) -> Any | None:
    """Rank ``rank``'s recipe state in checkpoint ``path`` (None: there is none)."""
    file = recipe_file(path, rank)
    if not file.exists():
        return None
    with reading(file):
        return json.loads(file.read_text())


def _load(
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    path: Path,
    strategy: str,
) -> TrainState:
    state = read_state(path)
    world = accelerator.num_processes
    sharded = {"fsdp2", "zero2", "zero3"}
    if {state.strategy, strategy} & sharded and (state.strategy, state.world_size) != (strategy, world):
        raise InputError(
            f"{path} was written by {state.strategy} on {state.world_size} process(es); this run is "
            f"{strategy} on {world}: optimizer shards only fit the layout that wrote them. Resume with "
            f"the same accelerate config and process count, or start a new run from {path} as the model"
        )
    rank = accelerator.process_index
    own = path / "state" / f"optimizer-{rank}.json"
    source = rank if own.exists() else 0  # DDP / single state is the same on every rank
    load_weights(accelerator, model, path, set(state.files) or None)
    restore_optimizer(optimizer, path / "state" / f"optimizer-{source}")
    with reading(path / "state" / "scheduler.json"):
        scheduler.load_state_dict(json.loads((path / "state" / "scheduler.json").read_text()))
    restore_rng(load_tree(path / "state" / f"rng-{source}"))
    return state


def load_weights(
    accelerator: Accelerator, model: torch.nn.Module, path: Path, files: set[str] | None = None
) -> None:
    """HF-format weights of ``path`` back into the prepared engine (under ZeRO-3 the weights come back
    with the optimizer's fp32 partitions instead: its parameters are partitions of flat buffers). With
    ``files`` (the checkpoint's list, relative to ``path``), only those are read."""
    engine = inner_engine(model)
    if type(model).__name__ == "DeepSpeedEngine" and model.zero_optimization_stage() == 3:
        return
    for name, where in (("model", path), ("value", path / "value")):
        part = getattr(engine, name)
        if part is not None:
            listed = None if files is None else {str(path / f) for f in files}
            load_hf_weights(part, where, listed)


def load_hf_weights(model: torch.nn.Module, path: Path, listed: set[str] | None = None) -> None:
    """Weights written by ``save_pretrained`` (a LoRA adapter, or the full model) back into ``model``;
    sharded (FSDP2) parameters are filled from the full tensors. ``listed``: the only files to read."""
    if (path / "adapter_model.safetensors").exists():
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(path / "adapter_model.safetensors"))
        return
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        if listed is None or str(file) in listed:
            weights.update(load_file(file))
    weights = model_keys(model, weights)  # the names save_pretrained changed (vision-language models)
    expected = dict(model.state_dict())
    tied = set(_tied_keys(model))
    missing = sorted(set(expected) - set(weights) - tied)
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise InputError(
            f"checkpoint {path} does not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}; resume with the model settings it was trained with"
        )
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))


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
