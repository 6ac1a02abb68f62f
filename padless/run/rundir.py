"""A run folder belongs to one run: claimed with a lock, never silently reused, cleaned up by renaming.

- A run starts only in an empty (or new) ``train.output_dir``; a folder holding anything else is refused
  unless the run resumes from it (``train.resume_from_checkpoint``) or ``train.overwrite_output_dir: true``
  asks to delete what padless wrote there before: what its manifest lists, never a file by its name
  alone (the user's own ``config.yaml`` stays).
- The manifest, ``padless-manifest.json``: a run folder may hold the user's own files (the config the run
  was started from, notes, data), and a name alone does not say who wrote a file, so every writer of the
  folder (the saved config, metrics, TensorBoard, the loss plot, the log, checkpoints, predictions,
  set-aside branches) records the entry's name there (:func:`own`) before it writes it.
- Resuming from a checkpoint older than the folder's newest is a branch: once the resume is accepted, the
  newer checkpoints and a copy of the metrics and TensorBoard logs so far are moved into
  ``superseded-<time>/``, never deleted.
- ``run.lock`` (pid, host, start time) refuses a second run into the same folder while the first one
  lives; a lock whose process is gone (same host) is taken over, and said so in the log.
- ``resume_from_checkpoint: latest`` needs a checkpoint and says so when there is none; ``auto`` resumes
  from the newest checkpoint when there is one and starts fresh otherwise, and logs which it did.
- Old checkpoints are renamed to ``.old-checkpoint-N`` before they are deleted, so a kill mid-delete
  never leaves a half checkpoint that looks whole; leftovers are swept at the next start.

Only the main process touches the folder; its verdict is broadcast, so every rank stops with the same
message instead of waiting forever for the one that stopped.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Any

from padless.errors import InputError
from padless.faults import FileFault, doing, write_atomic
from padless.run.logs import LOG_FILE, write_to

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
MANIFEST = "padless-manifest.json"
# written last into a checkpoint (:mod:`padless.run.checkpoint`): present means complete
STATE_FILE = "trainer_state.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_LEFTOVER = re.compile(r"^\.(tmp|old)-checkpoint-\d+$")
# Names only a padless run writes: a folder holding them without a manifest was written by an older padless.
_RUN_NAMES = re.compile(r"^(checkpoint-\d+|metrics\.jsonl|tensorboard|predictions-step\d+\.jsonl)$")
_held: dict[Path, Path] = {}  # run folder -> its lock file, for the locks this process holds


def owned(folder: str | os.PathLike[str]) -> set[str]:
    """Names of the entries padless wrote into ``folder`` (empty without a manifest)."""
    path = Path(folder) / MANIFEST
    if not path.exists():
        return set()
    with doing("reading the run folder's manifest", path, corrupt_fix=f"delete {path} and the run files"):
        names = json.loads(path.read_text())
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{path}: not a list of file names; fix: delete it and the run files it listed")
    return set(names)


def own(folder: str | os.PathLike[str], *names: str) -> None:
    """Record that padless writes ``names`` (top-level entries of ``folder``)."""
    known = owned(folder)
    if set(names) <= known:
        return
    path = Path(folder) / MANIFEST
    with doing("writing the run folder's manifest", path, setting="train.output_dir"):
        write_atomic(path, json.dumps(sorted(known | set(names)), indent=1))


def checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints (with ``trainer_state.json``), oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _CHECKPOINT.match(p.name)) and (p / STATE_FILE).exists()
    ]
    return [p for _, p in sorted(found)]


def resume_checkpoint(output_dir: str | Path, spec: str | None) -> Path | None:
    """The checkpoint ``train.resume_from_checkpoint`` names: None, ``latest`` (must exist), ``auto``
    (newest if any) or a path to a complete checkpoint."""
    if spec is None:
        return None
    if spec in ("latest", "auto"):
        found = checkpoints(output_dir)
        if found:
            return found[-1]
        if spec == "auto":
            return None
        raise InputError(
            f"train.resume_from_checkpoint=latest, but {output_dir} holds no complete checkpoint "
            f"(checkpoint-N with {STATE_FILE}); fix: set it to auto (resume when there is one, start fresh "
            "otherwise) or to null to start fresh"
        )
    path = Path(spec)
    if not (path / STATE_FILE).exists():
        found = ", ".join(str(p) for p in checkpoints(output_dir)) or "none found"
        raise InputError(
            f"train.resume_from_checkpoint={spec!r} is not a complete padless checkpoint (no {STATE_FILE} "
            f"in it); fix: use latest, auto, or one of: {found}"
        )
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _lock_holder(lock: Path) -> dict[str, Any]:
    try:
        holder = json.loads(lock.read_text())
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}  # unreadable or half-written: treated as held by an unknown process


def _acquire(root: Path) -> Path:
    lock = root / LOCK_FILE
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": datetime.datetime.now().isoformat()}
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _lock_holder(lock)
            pid, host = holder.get("pid"), holder.get("host")
            # our own pid: a run of this process that ended without releasing (runs in one process are
            # sequential), so nothing is using the folder
            stale = host == me["host"] and isinstance(pid, int) and (pid == me["pid"] or not _pid_alive(pid))
            if not stale:
                who = f"pid {pid} on {host}, started {holder.get('started')}" if holder else "unknown process"
                raise InputError(
                    f"train.output_dir {root} is in use by another padless run ({who}; lock file {lock}); "
                    "fix: wait for that run to finish, choose another train.output_dir, or, if that "
                    f"process is gone, delete {lock}"
                ) from None
            try:  # a rename succeeds for one claimant only: two runs cannot both take over
                os.replace(lock, lock.with_name(f"{LOCK_FILE}.stale-{me['pid']}"))
            except FileNotFoundError:
                continue
            lock.with_name(f"{LOCK_FILE}.stale-{me['pid']}").unlink(missing_ok=True)
            if pid != me["pid"]:
                log.warning("took over %s from pid %s, which is no longer running", lock, pid)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        _held[root] = lock
        return lock
    raise InputError(f"could not take the lock {lock}: other runs keep claiming it; fix: retry")


def _check_contents(root: Path, resume: Path | None, spec: str | None, overwrite: bool) -> None:
    """Refuse a used folder unless the run resumes from it or overwrite asked to delete its run files."""
    entries = sorted(p for p in root.iterdir() if p.name != LOCK_FILE)
    resuming_here = resume is not None and resume.resolve().parent == root
    if resuming_here or not entries:
        return
    mine = owned(root) | {MANIFEST}
    padless_wrote = [p for p in entries if p.name in mine or _LEFTOVER.match(p.name)]
    if spec == "auto" and len(padless_wrote) == len(entries):
        overwrite = True  # a run that died before its first checkpoint: nothing there to keep
    if not overwrite:
        shown = ", ".join(p.name for p in entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise InputError(
            f"train.output_dir {root} is not empty ({shown}); a new run would mix with or destroy what is "
            "there. Fix: resume that run with train.resume_from_checkpoint=latest (or auto), start it over "
            "with train.overwrite_output_dir=true (deletes its checkpoints and logs), or choose another "
            "train.output_dir"
        )
    unlisted = [p.name for p in entries if p not in padless_wrote and _RUN_NAMES.match(p.name)]
    if unlisted:
        raise InputError(
            f"train.overwrite_output_dir: {root} holds {', '.join(unlisted[:4])} but no {MANIFEST} saying "
            "padless wrote them (an older padless, or your own files): padless deletes only what it recorded "
            "writing; fix: delete them yourself, or choose another train.output_dir"
        )
    for path in padless_wrote:
        _remove(path)
    kept = len(entries) - len(padless_wrote)
    log.warning(
        "overwrite: deleted %d entries of an earlier run in %s%s",
        len(padless_wrote),
        root,
        f" (kept {kept} that padless did not write)" if kept else "",
    )


def _remove(path: Path) -> None:
    """Rename, then delete: a kill in between leaves a hidden leftover, never a half-deleted checkpoint."""
    if path.is_dir():
        trash = path.with_name(f".old-{path.name.lstrip('.')}-{os.getpid()}")
        os.replace(path, trash)
        shutil.rmtree(trash)
    else:
        path.unlink()


def _sweep(root: Path) -> None:
    """Delete what a killed run left half-written or half-deleted (hidden, never picked as a checkpoint)."""
    for path in root.iterdir():
        if _LEFTOVER.match(path.name) or path.name.startswith((".old-checkpoint-", f"{LOCK_FILE}.stale-")):
            log.info("removing %s, left by an interrupted run", path)
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def claim(accelerator: Any, train: Any) -> Path | None:
    """Take ``train.output_dir`` for this run and return the checkpoint to resume from (or None).

    Every rank calls this; the main process checks and locks, and all ranks raise its error if any.
    """
    error, code, resume = None, None, None
    if accelerator.is_main_process:
        try:
            resume = _claim(Path(train.output_dir), train.resume_from_checkpoint, train.overwrite_output_dir)
        except InputError as e:
            error = str(e)
        except FileFault as e:
            error, code = str(e), e.code
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        error, code, resume = broadcast_object_list([error, code, resume])
    if error is not None:
        raise InputError(error) if code is None else FileFault(error, code, "run folder")
    return resume


def _claim(root: Path, spec: str | None, overwrite: bool) -> Path | None:
    with doing("creating the run folder", root, setting="train.output_dir"):
        if root.exists() and not root.is_dir():
            raise InputError(
                f"train.output_dir {root} is a file; fix: choose a folder path for train.output_dir"
            )
        root.mkdir(parents=True, exist_ok=True)
        root = root.resolve()
        _acquire(root)
    try:
        with doing("preparing the run folder", root, setting="train.output_dir"):
            resume = resume_checkpoint(root, spec)
            _check_contents(root, resume, spec, overwrite)
            _sweep(root)
    except BaseException:
        release(root)
        raise
    if resume is not None:
        log.info("resuming from %s (resume_from_checkpoint=%s)", resume, spec)
    elif spec == "auto":
        log.info("resume_from_checkpoint=auto: no checkpoint in %s, starting fresh", root)
    return resume


def branch(output_dir: str | Path, resume: Path) -> None:
    """Resuming an older checkpoint: move the newer ones, and a copy of the metrics and TensorBoard logs
    written so far, into ``superseded-<time>/`` (the resumed run rewrites history from its checkpoint on).

    Called once the checkpoint's contract has accepted the resume, so a refused resume changes nothing."""
    root, resume = Path(output_dir).resolve(), resume.resolve()
    if resume.parent != root:
        return
    step = int(_CHECKPOINT.match(resume.name).group(1))  # type: ignore[union-attr]
    newer = [c for c in checkpoints(root) if int(c.name.split("-")[1]) > step]
    if not newer:
        return
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    aside = root / f"superseded-{stamp}-after-step-{step}"
    own(root, aside.name)
    aside.mkdir()
    for name in ("metrics.jsonl", "tensorboard"):
        source = root / name
        if source.is_dir():
            shutil.copytree(source, aside / name)
        elif source.exists():
            shutil.copy2(source, aside / name)
    for checkpoint in newer:
        os.replace(checkpoint, aside / checkpoint.name)
    log.warning(
        "resuming from %s while %s are newer: moved them, with a copy of the metrics so far, to %s (nothing "
        "deleted); this run continues from step %d",
        resume.name,
        ", ".join(c.name for c in newer),
        aside,
        step,
    )


def save_run_config(config: Any, root: Path) -> Path:
    """The resolved config as ``config.yaml``; if the user's own file has that name (the one the run was
    started from), it is kept and the resolved config goes to ``padless-config.yaml`` instead."""
    from padless.config.loading import save_config

    name = "config.yaml"
    if (root / name).exists() and name not in owned(root):
        name = "padless-config.yaml"
        log.info("%s is your own file: kept; the resolved config is in %s", root / "config.yaml", name)
    own(root, name)
    with doing("writing the resolved config", root / name, setting="train.output_dir"):
        return save_config(config, root / name)


def log_to_file(output_dir: str | Path | None, main_process: bool = True) -> None:
    """Append the ``padless`` logger's records to ``<output_dir>/log.txt`` (main process; listed in the
    manifest), replacing any earlier run's file; ``None`` closes the file."""
    if output_dir is None or not main_process:
        write_to(None)
        return
    own(output_dir, LOG_FILE)
    write_to(Path(output_dir) / LOG_FILE)


def release(output_dir: str | Path) -> None:
    """Give the folder's lock back (a no-op when this process does not hold it)."""
    lock = _held.pop(Path(output_dir).resolve(), None)
    if lock is not None and _lock_holder(lock).get("pid") == os.getpid():
        lock.unlink(missing_ok=True)


def end_run(output_dir: str | Path) -> None:
    """What a run gives back when it ends: its folder's lock and its log file (so the next run or command
    in this process starts from the defaults)."""
    release(output_dir)
    log_to_file(None)


def end_all_runs() -> None:
    """End every run this process started (after a failure, the command line calls this)."""
    for root in list(_held):
        release(root)
    log_to_file(None)


atexit.register(end_all_runs)


def rotate_checkpoints(output_dir: str | Path, keep: int) -> None:
    """Delete the oldest checkpoints beyond ``keep`` (0 keeps all), each renamed away first."""
    if keep <= 0:
        return
    for old in checkpoints(output_dir)[:-keep]:
        _remove(old)
