"""The one home of atomic file writes and of the default cache root.

Every file the project writes for later readers (cache artifacts and indexes, extracted
kernels, built native libraries, memoized factors, traces, baselines) goes through
:func:`atomic_write` or one of its two shorthands: the content is written to a temp file in
the destination's directory, fsynced, renamed into place and the directory fsynced, so a
reader sees the old file or the new one, never a partial one.  Temp names all start with
:data:`TMP_PREFIX`, so one glob sweeps what a writer that died left behind.

:func:`default_cache_root` is ``$PIECEWISE_CACHE_DIR`` or ``~/.cache/piecewise``; the artifact
cache, the native kernels (``kernels/``) and generated test models (``models/``) live under it.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import time
from pathlib import Path
from typing import Callable

ENV_CACHE_DIR = "PIECEWISE_CACHE_DIR"

TMP_PREFIX = ".tmp-"
"""Prefix of temp files; any left over belong to a writer that died (swept by the next)."""

ENVIRONMENT_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.EIO}
)
"""``OSError`` numbers that say the *disk* refused (full, read-only, no permission, quota,
I/O): never evidence that a file already there is corrupt."""


def default_cache_root() -> Path:
    """``$PIECEWISE_CACHE_DIR`` or ``~/.cache/piecewise`` (``~`` expanded)."""
    env = os.environ.get(ENV_CACHE_DIR)
    return Path(env).expanduser() if env else Path("~/.cache/piecewise").expanduser()


def is_environment_error(exc: BaseException) -> bool:
    """True for an ``OSError`` that is the disk's refusal (see :data:`ENVIRONMENT_ERRNOS`)."""
    return isinstance(exc, OSError) and exc.errno in ENVIRONMENT_ERRNOS


def tmp_path(directory: Path, stem: str) -> Path:
    """A fresh temp name in ``directory`` (``.tmp-<stem>-<pid>-<random>``)."""
    return Path(directory) / f"{TMP_PREFIX}{stem}-{os.getpid()}-{secrets.token_hex(4)}"


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


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except IsADirectoryError:  # a writer callback that made a directory
        import shutil

        shutil.rmtree(path, ignore_errors=True)


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Create ``path`` atomically: ``write(tmp)`` must create a file at ``tmp`` (in the same
    directory); it is then fsynced and renamed over ``path``.  If anything raises, ``path`` is
    untouched and the temp file is removed.  Errors from the disk (``ENOSPC``, ``EROFS``...)
    propagate as ``OSError`` naming ``path``."""
    path = Path(path)
    tmp = tmp_path(path.parent, path.name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if e.filename is None:  # name the file the caller asked for
            raise OSError(e.errno, f"{e.strerror or e} (writing {path})", str(path)) from e
        raise
    finally:
        _unlink_quietly(tmp)
    fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_write`)."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    return atomic_write(path, write)


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_write`)."""
    return atomic_write_bytes(path, text.encode(encoding))


# ----------------------------------------------------------------------------- temp sweeping
_TMP_PID = re.compile(rf"^{re.escape(TMP_PREFIX)}.*-(\d+)-[0-9a-f]{{8}}$")
_OLD_TMP_PID = re.compile(r"^\..+\.(\d+)\.tmp$|^\..+\.tmp-(\d+)$")
"""Temp names of earlier versions (``.<name>.<pid>.tmp``, ``.<name>.tmp-<pid>``)."""
STALE_TMP_AGE_S = 3600.0


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, someone else's
        return True
    return True


def sweep_stale_temps(directory: str | Path, *, lock_held: bool = False) -> int:
    """Remove the temp files writers that died left in ``directory``; the number removed.

    A temp file is stale when the caller holds the directory's writer lock (``lock_held``:
    no writer can be running), when the process id in its name no longer exists, or when it
    is older than :data:`STALE_TMP_AGE_S`.  Disk errors are ignored (a read-only directory has
    nothing to sweep that could be removed)."""
    directory = Path(directory)
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    now = time.time()
    for name in names:
        m = _TMP_PID.match(name) or _OLD_TMP_PID.match(name)
        ours = name.startswith(TMP_PREFIX)
        if m is None and not (ours and lock_held):
            continue
        path = directory / name
        pid = int(next(g for g in m.groups() if g is not None)) if m is not None else None
        try:
            stale = lock_held and ours
            stale = stale or (pid is not None and not _pid_alive(pid))
            stale = stale or now - path.stat().st_mtime > STALE_TMP_AGE_S
            if stale:
                _unlink_quietly(path)
                removed += 1
        except OSError:
            continue
    return removed


# ----------------------------------------------------------------------------- content names
_CONTENT_NAME = re.compile(r"^k([0-9a-f]{32})\.so$")


def content_file_name(data: bytes) -> str:
    """``k<first 32 hex digits of sha256>.so``: a file named by its content, so its name is
    its checksum (:func:`content_name_problem` verifies it)."""
    return f"k{hashlib.sha256(data).hexdigest()[:32]}.so"


def content_name_problem(path: str | Path) -> str | None:
    """Why the file at ``path`` (named by :func:`content_file_name`) does not hold the content
    its name promises, or ``None`` when it does (or the name is not a content name)."""
    path = Path(path)
    m = _CONTENT_NAME.match(path.name)
    if m is None:
        return None
    try:
        data = path.read_bytes()
    except OSError as e:
        return f"unreadable ({e})"
    if hashlib.sha256(data).hexdigest()[:32] != m.group(1):
        return "sha256 does not match the name (corrupted)"
    return None


def publish_dir(tmp: str | Path, final: str | Path, *, replace: bool = False) -> bool:
    """Move the finished directory ``tmp`` (made in ``final``'s parent, e.g. by
    ``tempfile.mkdtemp(dir=...)``) to ``final`` in one rename, so no reader sees a half-written
    folder; made readable by all (mkdtemp makes it private).  When ``final`` exists:
    ``replace=False`` leaves it (another writer published first), removes ``tmp`` and returns
    False; ``replace=True`` moves the old folder aside, renames ``tmp`` in, then removes the
    old one.  Returns True when ``tmp`` became ``final``."""
    import shutil

    tmp, final = Path(tmp), Path(final)
    os.chmod(tmp, 0o755)
    old = None
    if replace and final.exists():
        old = tmp_path(final.parent, final.name)
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except OSError:
        if replace or not final.exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    fsync_dir(final.parent)
    return True
