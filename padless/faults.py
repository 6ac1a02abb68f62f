"""File operations by category: one place turns what the OS or a file library raised into one line.

Every place padless reads or writes a file (the data cache, checkpoints, the run folder, metrics, logs)
runs the operation inside :func:`doing`, which names what padless was doing ("writing checkpoint 5",
"reading the data cache"). Whatever went wrong is sorted by category, not by call site: no space,
read-only file system, permission, not found, not a directory, a directory, name too long, I/O error,
or a corrupt file (Arrow, safetensors, JSON, text encoding). The message names the path, the category,
what padless was doing, and the fix for that category (with the setting that chooses the place, when
there is one). The exit code follows who fixes it: a full disk or an I/O error is the machine's (1), a
path or a permission is the user's (2).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

USAGE, FAULT = 2, 1  # the exit codes of padless.errors (imported here without a cycle)

# errno -> (what happened, how to fix it, exit code); ``{for_setting}`` is " for <setting>" or ""
_CATEGORIES: dict[int, tuple[str, str, int]] = {
    errno.ENOSPC: (
        "no space left on the device",
        "free space on that disk, or use another disk{for_setting}",
        FAULT,
    ),
    errno.EDQUOT: (
        "disk quota exceeded",
        "free space within your quota, or use another disk{for_setting}",
        FAULT,
    ),
    errno.EROFS: ("the file system is read-only", "use a writable location{for_setting}", USAGE),
    errno.EACCES: (
        "permission denied",
        "give this user access to it, or use another location{for_setting}",
        USAGE,
    ),
    errno.EPERM: (
        "operation not permitted",
        "give this user access to it, or use another location{for_setting}",
        USAGE,
    ),
    errno.ENOENT: (
        "no such file or directory",
        "check the path{for_setting} (was it moved or deleted?)",
        USAGE,
    ),
    errno.ENOTDIR: (
        "a part of the path is a file, not a folder",
        "rename or remove that file, or use another location{for_setting}",
        USAGE,
    ),
    errno.EISDIR: (
        "a folder where a file was expected",
        "remove that folder, or use another path{for_setting}",
        USAGE,
    ),
    errno.ENAMETOOLONG: (
        "the name is too long for the file system",
        "use a shorter path{for_setting}",
        USAGE,
    ),
    errno.EEXIST: ("already exists", "remove it, or use another location{for_setting}", USAGE),
    errno.ENOTEMPTY: ("the folder is not empty", "empty it, or use another location{for_setting}", USAGE),
    errno.ELOOP: (
        "a symbolic link that leads nowhere (a loop, or its target is missing)",
        "remove the link, or point it at a real folder{for_setting}",
        USAGE,
    ),
    errno.EIO: (
        "input/output error (the disk or network file system failed)",
        "check the disk, then retry",
        FAULT,
    ),
    errno.EMFILE: ("too many open files", "raise the limit (ulimit -n) or lower data.num_proc", FAULT),
}


class FileFault(Exception):
    """A file operation failed. ``code`` is the exit code (2: the user fixes a path or a permission; 1: the
    machine failed: a full disk, an I/O error); ``category`` is ``corrupt`` or an errno name."""

    def __init__(self, message: str, code: int, category: str, path: str | None = None):
        super().__init__(message)
        self.code, self.category, self.path = code, category, path


class ChangedFile(ValueError):
    """A file is not what was written: its size or hash differs from the record kept when it was written
    (a checkpoint's files), though its format may be whole."""


def _corrupt_types() -> tuple[type[BaseException], ...]:
    """Errors meaning "the bytes are not what the format says": JSON, text, Arrow, safetensors, or not what
    was written (:class:`ChangedFile`)."""
    types: list[type[BaseException]] = [json.JSONDecodeError, UnicodeDecodeError, EOFError, ChangedFile]
    with contextlib.suppress(ImportError):
        import pyarrow as pa

        types += [pa.ArrowInvalid, pa.ArrowSerializationError]
    with contextlib.suppress(ImportError):
        from safetensors import SafetensorError

        types.append(SafetensorError)
    return tuple(types)


def _errno(error: BaseException) -> int | None:
    """The OS error behind ``error``: its own errno, or one a library wrapped in its message (safetensors:
    "No space left on device (os error 28)", pyarrow: "[errno 28] No space left on device")."""
    if isinstance(error, OSError) and error.errno is not None:
        return error.errno
    found = re.search(r"\(os error (\d+)\)|\[errno (\d+)\]|Os \{ code: (\d+)", str(error), re.IGNORECASE)
    return int(next(g for g in found.groups() if g)) if found else None


def category(error: BaseException) -> str | None:
    """``corrupt``, an errno name such as ``ENOSPC``, or None when ``error`` is not about a file."""
    if isinstance(error, FileFault):
        return error.category
    code = _errno(error)
    if code in _CATEGORIES:
        return errno.errorcode[code]
    if isinstance(error, _corrupt_types()):
        return "corrupt"
    return None


def translate(
    error: BaseException,
    what: str,
    path: str | os.PathLike[str] | None = None,
    setting: str | None = None,
    corrupt_fix: str | None = None,
) -> FileFault | None:
    """``error`` as one line (path, category, what padless was doing, fix), or None if it is not a file
    error (a bug or an input error keeps its own message)."""
    if isinstance(error, FileFault):
        return error
    kind = category(error)
    if kind is None:
        return None
    for_setting = f" for {setting}" if setting else ""
    filename = getattr(error, "filename", None) if isinstance(error, OSError) else None
    shown = str(filename or path or "?")
    if kind == "corrupt":
        detail = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        fix = corrupt_fix or "delete it (or restore it from a copy) and run again"
        message = (
            f"{shown}: corrupt or truncated file ({type(error).__name__}: {detail}) while {what}; fix: {fix}"
        )
        return FileFault(message, USAGE, kind, shown)
    code_of = _errno(error)
    if code_of in (errno.EEXIST, errno.ENOENT) and os.path.islink(shown) and not os.path.exists(shown):
        code_of = errno.ELOOP  # the name is taken by a link that leads nowhere: say that, not "exists"
    elif code_of == errno.EEXIST and os.path.isfile(shown):
        code_of = errno.ENOTDIR  # a folder was to be made where a file is (mkdir's "exists")
    happened, fix, code = _CATEGORIES[code_of]  # type: ignore[index]
    message = f"{shown}: {happened} while {what}; fix: {fix.format(for_setting=for_setting)}"
    return FileFault(message, code, kind, shown)


@contextlib.contextmanager
def doing(
    what: str,
    path: str | os.PathLike[str] | None = None,
    setting: str | None = None,
    corrupt_fix: str | None = None,
) -> Iterator[None]:
    """Run a file operation; a file error inside becomes a :class:`FileFault` saying ``what`` was done."""
    try:
        yield
    except FileFault:
        raise
    except Exception as e:
        fault = translate(e, what, path, setting, corrupt_fix)
        if fault is None:
            raise
        raise fault from e


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: a reader never sees half a file,
    and a failed write (a full disk) leaves the old file and no temporary behind."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
