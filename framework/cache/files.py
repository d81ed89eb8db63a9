"""Crash-safe file primitives of the artifact cache: atomic writes (temp file, fsync, rename),
checksums, removal, and one cross-process file lock per lock file per process."""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import threading
from pathlib import Path

from filelock import FileLock

TMP_PREFIX = ".tmp-"
"""Prefix of temp files; any left over belong to a writer that died (swept by the next)."""


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # platforms without directory fds (Windows): rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def tmp_path(directory: Path, stem: str) -> Path:
    return directory / f"{TMP_PREFIX}{stem}-{os.getpid()}-{secrets.token_hex(4)}"


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via temp file + fsync + rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path(path.parent, path.name)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        remove(tmp)
    fsync_dir(path.parent)


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
