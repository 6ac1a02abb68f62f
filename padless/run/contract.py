"""Resume is a contract: a checkpoint says what it belongs to, and a run resumes it only on those terms.

A checkpoint records the trainer (its recipe), the model (name and architecture), a digest of the data
plan (each step's tokens and loss units, so any change of the data, the batching or the seed shows),
the settings the plan is built from (RL: every rollout, reward and loss setting that changes a number),
the world size, each parameter group's learning rate and ``max_steps``. Resuming:

- another trainer or another architecture is refused;
- a changed data plan is refused (the rest of the run would skip or repeat rows), naming the settings
  that differ, with the fix;
- changed RL settings apply from the next rollout (rollouts sampled ahead are sampled again) and are
  logged; mid-rollout they are refused (the rollout being trained was sampled and scored under the old
  ones);
- a changed ``train.learning_rate`` (or a group's own rate, e.g. ``ppo.value_learning_rate``) is applied
  to its parameter group (the schedule keeps its shape, scaled to the new peak) and logged; a change of
  which groups have a rate of their own is refused (the optimizer state is laid out by group);
- a changed ``max_steps`` / ``num_epochs`` stretches the schedule and is logged; a checkpoint already at
  or past the run's last step is refused (there would be nothing to train).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from padless.data.cache import digest
from padless.errors import InputError

log = logging.getLogger(__name__)

DEFAULT_GROUP = "default"  # the parameter group without a learning rate of its own
PLAN_SETTINGS = (
    "batching",
    "max_tokens_per_batch",
    "batch_size",
    "gradient_accumulation_steps",
    "seed",
    "tree_packing",  # a tree row counts a shared prompt once in the token budget
)
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


def terms(
    recipe: Any, model: Any, cfg: Any, world: int, digest_: str | None, groups: list[dict[str, Any]]
) -> dict[str, Any]:
    """What this run's checkpoints record and what a resumed checkpoint must agree with. ``groups``: the
    optimizer's parameter groups (each with its ``name`` and ``lr``), in order."""
    return {
        "trainer": type(recipe).__name__,
        "model": model_identity(model),
        "plan": {k: getattr(cfg, k, None) for k in PLAN_SETTINGS} | {"world_size": world},
        "plan_digest": digest_,
        "plan_settings": recipe.plan_settings(),
        "learning_rate": cfg.learning_rate,
        "learning_rates": [[g["name"], g["lr"]] for g in groups],
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
    check_trainer(path, saved, current)
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
    applied += _settings_changes(path, saved.get("plan_settings"), current["plan_settings"], mid_epoch)
    applied += _rate_changes(path, saved, current)
    if saved.get("total_steps") not in (None, total):
        applied.append(f"last step {saved['total_steps']} -> {total} (schedule stretched to the new length)")
    return applied


def check_trainer(path: Path, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """The trainer first: a checkpoint of another trainer holds other files (no value model in a GRPO
    one), which is not what is wrong with it."""
    if saved.get("trainer", current["trainer"]) != current["trainer"]:
        was, now = (
            f"padless {t.removesuffix('Recipe').lower()}" for t in (saved["trainer"], current["trainer"])
        )
        raise InputError(
            f"{path} was written by {was} ({saved['trainer']}), this run is {now} ({current['trainer']}): "
            f"a checkpoint resumes only the trainer that wrote it; fix: resume it with {was}, or {NEW_RUN}"
        )


def _settings_changes(
    path: Path, was: dict[str, Any] | None, now: dict[str, Any], mid_epoch: bool
) -> list[str]:
    """The recipe's own plan settings (RL): changes apply from the next rollout; mid-rollout, refused."""
    if was is None:  # written before they were recorded
        return []
    keys = sorted(was.keys() | now.keys())
    changed = {k: (was.get(k), now.get(k)) for k in keys if was.get(k) != now.get(k)}
    if not changed:
        return []
    what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
    if mid_epoch:
        keep = ", ".join(f"{k}={a}" for k, (a, _) in changed.items())
        raise InputError(
            f"{path} was written mid-rollout and the RL settings changed since ({what}): the rest of that "
            f"rollout was sampled and scored under the old ones; fix: resume with {keep}, or resume from a "
            f"checkpoint at a rollout boundary, or {NEW_RUN}"
        )
    return [f"{what}: applies from the next rollout (rollouts sampled ahead are sampled again)"]


def _rate_changes(path: Path, saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Each parameter group's learning rate: a change applies to its group; other groups are refused."""
    was, now = _written_rates(saved, current), current["learning_rates"]
    if [n for n, _ in was] != [n for n, _ in now]:
        names = ", ".join(dict.fromkeys(n for n, _ in was)), ", ".join(dict.fromkeys(n for n, _ in now))
        raise InputError(
            f"{path}: the parameter groups with a learning rate of their own changed (written: {names[0]}; "
            f"now: {names[1]}) and the optimizer state is laid out by group; fix: set the per-group rates "
            f"(e.g. ppo.value_learning_rate) as they were when it was written, or {NEW_RUN}"
        )
    changes = {}
    for (name, a), (_, b) in zip(was, now, strict=True):
        if a != b:
            key = "train.learning_rate" if name == DEFAULT_GROUP else f"the learning rate of {name}*"
            changes[key] = f"{key} {a} -> {b} (schedule rescaled)"
    return list(changes.values())


def _written_rates(saved: dict[str, Any], current: dict[str, Any]) -> list[list[Any]]:
    """Each group's rate when the checkpoint was written; one written before groups were recorded scales
    every group by the change of ``train.learning_rate``."""
    if "learning_rates" in saved:
        return saved["learning_rates"]
    scale = saved["learning_rate"] / current["learning_rate"]
    return [[name, lr * scale] for name, lr in current["learning_rates"]]


def rescale_learning_rates(
    optimizer: Any, scheduler: Any, saved: dict[str, Any], current: dict[str, Any]
) -> None:
    """Scale each parameter group's schedule base rate and rate in use now by its new / saved rate."""
    if not saved:
        return
    was = _written_rates(saved, current)
    ratios = [b / a for (_, a), (_, b) in zip(was, current["learning_rates"], strict=True)]
    scheduler.base_lrs = [lr * r for lr, r in zip(scheduler.base_lrs, ratios, strict=True)]
    for group, ratio in zip(optimizer.param_groups, ratios, strict=True):
        group["lr"] *= ratio
        if "initial_lr" in group:
            group["initial_lr"] *= ratio
