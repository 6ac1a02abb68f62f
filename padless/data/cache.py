"""The on-disk store of tokenized sets: one folder per fingerprint, built once, published whole.

A fingerprint covers everything a tokenized set depends on: the data (a file's path, size and modification
time, or a dataset's ``datasets`` fingerprint), the tokenizer (its full ``tokenizer.json``, chat template and
special tokens), the settings that change what is kept or how (max length, format, ...), the source code of
``padless.data`` and the versions of ``transformers``, ``tokenizers`` and ``datasets``. Any change gives a new
folder; nothing is ever updated in place.

The store lives under ``data.cache_dir``, by default ``padless/`` in the ``datasets`` cache
(``$HF_DATASETS_CACHE``, usually ``~/.cache/huggingface/datasets``), where Hugging Face users look for
preprocessed data. A set is built into a hidden temporary folder and renamed into place, so a folder under
its fingerprint's name is always complete; two builders racing for one fingerprint both succeed and one
result is kept.

An entry found damaged when it is opened (a file missing, truncated or not Arrow, its record unreadable) or a
folder under a fingerprint's name without its record (half-built by hand or by another tool) is renamed
aside to ``.damaged-<name>-<pid>`` and rebuilt, and the log says so: it is never fatal and never reused.

With several processes, the main process of each machine builds while the others wait, then every process
memory-maps the result. The others wait by watching the folder rather than in a collective call, because
a build can take longer than a process group's timeout; when the build fails on the data, the builder
leaves its error beside the folder, and every waiting process raises the same one; the builder exits only
once each has read it (or after a bounded wait), since a launcher stops the others when one process exits.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

from padless.data.chat import ChatTemplateError
from padless.errors import DataError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # the folder layout; the code hash below covers what the columns hold
META_FILE = "padless.json"  # written last into a set's folder
POLL_S = 0.5
SEEN_WAIT_S = 10.0  # how long a failed builder waits for the waiting processes to read its error
# Errors a failed build hands to the processes waiting for it (all input errors, raised again as such).
_PORTABLE: dict[str, type[ValueError]] = {
    "DataError": DataError,
    "ChatTemplateError": ChatTemplateError,
    "ValueError": ValueError,
}


def default_root() -> Path:
    import datasets.config

    return Path(datasets.config.HF_DATASETS_CACHE) / "padless"


def digest(value: Any) -> str:
    """A stable 128-bit hex digest of a JSON-able value (keys sorted)."""
    text = json.dumps(value, sort_keys=True, default=str, ensure_ascii=False)
    return xxhash.xxh3_128_hexdigest(text.encode())


def tokenizer_identity(tokenizer: Any) -> str:
    """What decides how a tokenizer tokenizes and renders chats; not where it was loaded from."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a Python-only tokenizer: datasets' own hash of the object
        from datasets.fingerprint import Hasher

        return Hasher.hash(tokenizer)
    parts = {
        "class": type(tokenizer).__name__,
        "backend": backend.to_str(),
        "chat_template": getattr(tokenizer, "chat_template", None),
        "special_tokens": tokenizer.special_tokens_map,
    }
    return digest(parts)


def code_identity() -> str:
    """The source of ``padless.data``: a change to how rows are read or tokenized is a new fingerprint."""
    here = Path(__file__).parent
    return digest({p.name: p.read_text() for p in sorted(here.glob("*.py"))})


def versions() -> dict[str, str]:
    import datasets
    import tokenizers
    import transformers

    return {
        "padless_format": str(FORMAT_VERSION),
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "datasets": datasets.__version__,
    }


def _failure_file(path: Path) -> Path:
    return path.with_name(path.name + ".failed.json")


def _complete(path: Path) -> bool:
    return (path / META_FILE).is_file()


def error_record(error: ValueError, **attrs: Any) -> dict[str, Any]:
    """An input error as JSON-able data (for another process, or a row of a map's output)."""
    name = next((n for n, cls in _PORTABLE.items() if type(error) is cls), "ValueError")
    if isinstance(error, DataError):
        attrs = {k: getattr(error, k) for k in ("source", "index", "field", "reason")} | attrs
    return {"type": name, "message": str(error), "attrs": attrs}


def error_from(record: dict[str, Any]) -> ValueError:
    """The error :func:`error_record` describes, of the same class, message and attributes."""
    cls = _PORTABLE.get(record["type"], ValueError)
    if cls is DataError:
        return DataError(record["message"], **record["attrs"])
    return cls(record["message"])


def _raise_recorded(failure: Path) -> None:
    try:
        recorded = json.loads(failure.read_text())
    except (OSError, ValueError):  # being written or removed: not (yet) a verdict
        return
    with contextlib.suppress(OSError):  # the builder may exit now (it waits a bounded time without it)
        failure.with_name(f"{failure.name}.seen-{os.getpid()}").touch()
    raise error_from(recorded)


def _record_failure(failure: Path, error: ValueError, waiters: int) -> None:
    """Record ``error`` for the ``waiters`` processes waiting on this build and wait (at most
    :data:`SEEN_WAIT_S`) until each has read it: a launcher stops the other processes as soon as one exits
    with an error, so a builder that exited at once would leave them killed mid-wait, with no message."""
    tmp = failure.with_name(f".{failure.name}.{os.getpid()}")
    tmp.write_text(json.dumps(error_record(error)))
    os.replace(tmp, failure)
    deadline = time.monotonic() + SEEN_WAIT_S
    while len(seen := _seen(failure)) < waiters and time.monotonic() < deadline:
        time.sleep(POLL_S / 10)
    for mark in seen:
        mark.unlink(missing_ok=True)


def _seen(failure: Path) -> list[Path]:
    """The marks of the waiting processes that have read ``failure``."""
    return sorted(failure.parent.glob(f"{failure.name}.seen-*"))


class Damaged(Exception):
    """A cache entry that cannot be what its record says (files missing, sizes or rows differ)."""


def files_of(folder: Path) -> dict[str, int]:
    """The entry's files and their sizes (recorded at build time, compared at every open)."""
    return {f.name: f.stat().st_size for f in sorted(folder.iterdir()) if f.is_file() and f.name != META_FILE}


def check_files(path: Path, recorded: dict[str, int]) -> None:
    """Raise :class:`Damaged` unless ``path`` holds exactly the files, of the sizes, that were built."""
    found = files_of(path)
    if found != recorded:
        changed = sorted(set(found) ^ set(recorded) | {k for k in found if recorded.get(k) != found[k]})
        raise Damaged(f"files changed since it was built: {', '.join(changed[:3])}")


def is_damage(error: BaseException) -> str | None:
    """How an entry is damaged, if ``error`` (raised while opening it) means it is; None otherwise (a
    permission, a full disk: those are reported, not repaired)."""
    from padless.faults import category

    kind = category(error)
    if isinstance(error, Damaged):
        return str(error)
    # pyarrow reports bytes that are not Arrow as an OSError without an errno ("Invalid IPC stream")
    unreadable = isinstance(error, OSError) and error.errno is None
    if (
        kind in ("corrupt", "ENOENT", "EISDIR", "ENOTDIR")
        or unreadable
        or isinstance(error, (KeyError, TypeError))
    ):
        return f"{type(error).__name__}: {str(error).splitlines()[0][:150] if str(error) else ''}"
    return None


def set_aside(path: Path, why: str) -> None:
    """Rename a damaged or half-built entry out of the way (hidden; never read again), saying so."""
    aside = path.with_name(f".damaged-{path.name}-{os.getpid()}")
    try:
        os.replace(path, aside)
    except FileNotFoundError:  # another process set it aside first
        return
    except OSError:  # the name is taken by an earlier one: replace that
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(path, aside)
    log.warning(
        "data cache %s is damaged (%s): set aside as %s (safe to delete); rebuilding",
        path,
        why,
        aside,
    )


def publish(path: Path, build: Callable[[Path], None], waiters: int = 0) -> None:
    """Build into a temporary folder next to ``path`` (``build`` writes the set, :data:`META_FILE` last),
    then rename it into place. An input error is raised, recorded first for the ``waiters`` processes
    waiting for the set."""
    path.parent.mkdir(parents=True, exist_ok=True)
    failure = _failure_file(path)
    for stale in (failure, *_seen(failure)):
        stale.unlink(missing_ok=True)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        build(tmp)
        if path.exists() and not _complete(path):
            set_aside(path, f"half-built: no {META_FILE}")
        try:
            os.replace(tmp, path)
        except OSError:  # another builder published this fingerprint first: keep theirs
            if not _complete(path):
                raise
    except ValueError as e:
        if waiters:
            _record_failure(failure, e, waiters)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def wait_for(path: Path, what: str) -> None:
    """Wait for another process to publish ``path``; raise the error it recorded if its build failed."""
    failure = _failure_file(path)
    started = last_said = time.monotonic()
    while not _complete(path):
        if failure.exists():
            _raise_recorded(failure)
        time.sleep(POLL_S)
        if time.monotonic() - last_said > 60:
            last_said = time.monotonic()
            log.info("%s: still waiting for the main process to build it (%.0f s)", what, last_said - started)


def load_or_build(
    path: Path,
    build: Callable[[Path], None],
    what: str,
    builder: bool | None = None,
    waiters: int | None = None,
) -> bool:
    """Make sure the set at ``path`` exists: built by the ``builder`` (default: this machine's main
    process), waited for by the others, who get its error if it fails (``waiters``: how many wait, by
    default the machine's other processes). Returns whether the set was there already (a cache hit)."""
    if _complete(path):
        return True
    if builder is None or waiters is None:
        from accelerate import PartialState

        state = PartialState()
        builder = state.is_local_main_process if builder is None else builder
        # the launcher says how many processes run on this machine; without it, every other process
        local = int(os.environ.get("LOCAL_WORLD_SIZE", state.num_processes))
        waiters = local - 1 if waiters is None else waiters
    if builder:
        publish(path, build, waiters)
    else:
        wait_for(path, what)
    return False
