"""The run folder's manifest: the names of what padless wrote there, so only those are ever deleted.

A run folder may hold the user's own files (the ``config.yaml`` the run was started from, notes, data);
a name alone does not say who wrote a file. Every writer of the run folder (the saved config, metrics,
TensorBoard, the loss plot, the log, checkpoints, predictions, set-aside branches) records the entry's
name in ``padless-manifest.json`` before it writes it; ``overwrite_output_dir`` deletes what the manifest
lists and nothing else.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from padless.faults import doing, write_atomic

MANIFEST = "padless-manifest.json"


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
