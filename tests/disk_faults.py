"""A disk that refuses writes under one directory, simulated in-process.

Tests run as root, so ``chmod a-w`` stops nothing, and a tiny tmpfs cannot be mounted here.
Instead :func:`refuse_writes` monkeypatches the calls every writer in this process goes
through (``open``/``io.open`` in a writing mode, ``os.open`` with write or create flags,
``os.replace``/``rename``/``link``/``mkdir``/``utime``, and, for a read-only disk, ``unlink``/
``rmdir``) to raise ``OSError(errno)`` with the path when the path lies under ``root``.
Reads are untouched.  ``ENOSPC`` models a full disk (removals still work), ``EROFS`` a
read-only one.  The refused paths are recorded in the returned list.
"""

from __future__ import annotations

import builtins
import errno as errno_mod
import io
import os
from pathlib import Path

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def refuse_writes(monkeypatch, root: str | Path, errno: int = errno_mod.EROFS) -> list[str]:
    root_s = os.path.abspath(os.fspath(root))
    refused: list[str] = []

    def under(p) -> bool:
        if isinstance(p, int):
            return False
        try:
            p = os.path.abspath(os.fsdecode(os.fspath(p)))
        except TypeError:
            return False
        return p == root_s or p.startswith(root_s + os.sep)

    def refuse(p):
        refused.append(os.fsdecode(os.fspath(p)))
        raise OSError(errno, os.strerror(errno), os.fsdecode(os.fspath(p)))

    real_open = io.open

    def fake_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and under(file):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)

    real_os_open = os.open

    def fake_os_open(path, flags, *args, **kwargs):
        if flags & _WRITE_FLAGS and under(path):
            refuse(path)
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(io, "open", fake_open)
    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(os, "open", fake_os_open)

    names = ["replace", "rename", "link", "symlink", "mkdir", "utime"]
    if errno != errno_mod.ENOSPC:
        names += ["unlink", "remove", "rmdir"]
    for name in names:
        real = getattr(os, name)

        def fake(*args, _real=real, _name=name, **kwargs):
            paths = args[:2] if _name in ("replace", "rename", "link", "symlink") else args[:1]
            for p in paths:
                if under(p):
                    if _name == "mkdir" and os.path.isdir(p):
                        raise FileExistsError(errno_mod.EEXIST, "File exists", os.fspath(p))
                    refuse(p)
            return _real(*args, **kwargs)

        monkeypatch.setattr(os, name, fake)
    return refused


def tree_state(root: str | Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: relative path -> (size, mtime_ns)."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out
