"""Resume is a contract: a checkpoint says what it belongs to, and a run resumes it only on those terms.

A checkpoint records the trainer (its recipe), the model (name and architecture), a digest of the data
plan (each step's tokens and loss units, so any change of the data, the batching or the seed shows),
the settings the plan is built from, the world size, the learning rate and ``max_steps``. Resuming:

- another trainer or another architecture is refused;
- a changed data plan is refused (the rest of the run would skip or repeat rows), naming the settings
  that differ, with the fix;
- a changed ``train.learning_rate`` is applied (the schedule keeps its shape, scaled to the new peak) and
  logged; a changed ``max_steps`` / ``num_epochs`` stretches the schedule and is logged; a checkpoint
  already at or past the run's last step is refused (there would be nothing to train).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from padless.data.cache import digest
from padless.errors import InputError

log = logging.getLogger(__name__)

PLAN_SETTINGS = ("batching", "max_tokens_per_batch", "batch_size", "gradient_accumulation_steps", "seed")
NEW_RUN = (
    "start a new run from it instead (model.name=<that checkpoint>, another train.output_dir, "
    "train.resume_from_checkpoint=null)"
)


def plan_digest(steps: list[Any]) -> str:
    """What an epoch's plan is, step by step: real tokens and loss units of each step (all ranks)."""
    return digest([[s.tokens, round(float(s.normaliser), 6)] for s in steps])


def model_identity(model: Any) -> dict[str, Any]:
    """The trained model's name and the parts of its config that make it another model."""
    config = getattr(model, "config", None)
    keys = ("model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers")
    shape = {k: getattr(config, k, None) for k in keys} if config is not None else {}
    return {"name": getattr(config, "_name_or_path", ""), "shape": shape}


def terms(recipe: Any, model: Any, cfg: Any, world: int, digest_: str | None) -> dict[str, Any]:
    """What this run's checkpoints record and what a resumed checkpoint must agree with."""
    return {
        "trainer": type(recipe).__name__,
        "model": model_identity(model),
        "plan": {k: getattr(cfg, k, None) for k in PLAN_SETTINGS} | {"world_size": world},
        "plan_digest": digest_,
        "learning_rate": cfg.learning_rate,
        "total_steps": None,  # filled by the loop
    }


def check(
    path: Path, saved: dict[str, Any], current: dict[str, Any], step: int, total: int, mid_epoch: bool
) -> list[str]:
    """Raise :class:`InputError` if ``path`` cannot be resumed by this run; return the changes that apply
    (to log). ``saved`` is the checkpoint's terms (empty for a checkpoint written before they existed); a
    changed plan applies at an epoch boundary and is refused mid-epoch."""
    if step >= total:
        raise InputError(
            f"{path} is at step {step} and this run ends at step {total}: there is nothing left to train; "
            f"fix: raise train.max_steps (or train.num_epochs) beyond {step}, or use the checkpoint as it is"
        )
    if not saved:
        log.warning("%s records no resume terms (written by an older padless): they are not checked", path)
        return []
    if saved["trainer"] != current["trainer"]:
        raise InputError(
            f"{path} was written by {saved['trainer']}, this run is {current['trainer']}: a checkpoint "
            f"resumes only the trainer that wrote it; fix: run the command that wrote it, or {NEW_RUN}"
        )
    was, now = saved["model"], current["model"]
    if was["shape"] != now["shape"]:
        differs = {k: (v, now["shape"].get(k)) for k, v in was["shape"].items() if now["shape"].get(k) != v}
        raise InputError(
            f"{path} was written for model {was['name']} ({differs}), this run trains {now['name']}; fix: "
            f"resume with model.name={was['name']}, or {NEW_RUN}"
        )
    if was["name"] != now["name"]:
        log.warning(
            "%s was written for %s; resuming it with %s (same architecture)", path, was["name"], now["name"]
        )
    plan_was, plan_now = saved["plan"], current["plan"]
    changed = {k: (plan_was.get(k), v) for k, v in plan_now.items() if plan_was.get(k) != v}
    other_rows = (
        saved["plan_digest"] and current["plan_digest"] and saved["plan_digest"] != current["plan_digest"]
    )
    applied = []
    if (changed or other_rows) and not mid_epoch:
        applied.append(f"data plan changed ({', '.join(changed) or 'the data'}): applies from the next epoch")
    elif changed or other_rows:
        what = (
            ", ".join(f"{k} {a} -> {b}" for k, a, b in ((k, *v) for k, v in changed.items()))
            if changed
            else "the training data (same settings, other rows or lengths)"
        )
        keep = ", ".join(f"train.{k}={a}" for k, (a, _) in changed.items() if k != "world_size")
        fix = f"resume with {keep or 'the data it was trained on'}" + (
            f" on {plan_was['world_size']} data-parallel rank(s)" if "world_size" in changed else ""
        )
        raise InputError(
            f"{path}: the data plan changed since it was written ({what}); continuing mid-run would skip or "
            f"repeat rows; fix: {fix}, or {NEW_RUN}"
        )
    if saved["learning_rate"] != current["learning_rate"]:
        applied.append(
            f"train.learning_rate {saved['learning_rate']} -> {current['learning_rate']} (schedule rescaled)"
        )
    if saved.get("total_steps") not in (None, total):
        applied.append(f"last step {saved['total_steps']} -> {total} (schedule stretched to the new length)")
    return applied


def rescale_learning_rate(optimizer: Any, scheduler: Any, ratio: float) -> None:
    """Scale the schedule's base rates (every parameter group alike) and the rates in use now."""
    scheduler.base_lrs = [lr * ratio for lr in scheduler.base_lrs]
    for group in optimizer.param_groups:
        group["lr"] *= ratio
        if "initial_lr" in group:
            group["initial_lr"] *= ratio
