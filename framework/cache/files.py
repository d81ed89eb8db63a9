"""File primitives of the artifact cache: checksums, removal, and one cross-process file lock
per lock file per process.  Atomic writes live in :mod:`framework.core.files` (re-exported
here for the cache's modules)."""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from pathlib import Path

from filelock import FileLock

from framework.core.files import (  # noqa: F401  (re-exported)
    TMP_PREFIX,
    atomic_write,
    atomic_write_bytes,
    atomic_write_text,
    content_name_problem,
    fsync_dir,
    is_environment_error,
    sweep_stale_temps,
    tmp_path,
)


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:  # a read-only or failing disk: the file stays, harmlessly
            if not is_environment_error(e):
                raise


_PROCESS_LOCKS: dict[str, FileLock] = {}
_PROCESS_LOCKS_GUARD = threading.Lock()


def shared_file_lock(path: Path) -> FileLock:
    """One FileLock object per lock file per process, so two stores opened on the same
    directory in one process re-enter instead of deadlocking on each other's flock."""
    key = os.path.realpath(path)
    with _PROCESS_LOCKS_GUARD:
        lock = _PROCESS_LOCKS.get(key)
        if lock is None:
            lock = _PROCESS_LOCKS[key] = FileLock(key)
        return lock
