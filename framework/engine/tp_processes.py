"""The operating-system side of spawned tensor-parallel ranks: what outlives a Python object
and must be cleaned up on every exit path.

* :class:`StderrTail`: a worker's stderr, forwarded as it comes, its last bytes kept for the
  error message when the worker dies;
* the rendezvous files (``piecewise-tp-*`` in the temp directory, one per spawned group):
  :func:`new_store_file` makes one, :func:`remove_store_file` removes it; the ones left are
  removed at interpreter exit and on SIGTERM, whose handler (chained before the previous one,
  installed once, main thread only) also terminates the live workers.

The registries here mirror process-wide resources (temp files, the SIGTERM handler), so
they are process-wide too; :mod:`framework.engine.parallel` owns the groups.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import tempfile
import threading
from typing import Any, Callable, Iterable, Iterator

STDERR_TAIL_BYTES = 8192


class StderrTail:
    """A spawned worker's stderr: forwarded to this process's stderr as it comes, and its
    last bytes kept for the error message when the worker dies."""

    def __init__(self, rank: int):
        self.rank = rank
        self._read, self._write = os.pipe()
        self._buf = bytearray()
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._pump, name=f"piecewise-tp-stderr{rank}", daemon=True
        )

    @contextlib.contextmanager
    def as_stderr(self) -> Iterator[None]:
        """Make the pipe fd 2 while the worker starts (the child inherits it)."""
        saved = os.dup(2)
        try:
            os.dup2(self._write, 2)
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(self._write)

    def start(self) -> None:
        self._thread.start()

    def _pump(self) -> None:
        try:
            while True:
                data = os.read(self._read, 65536)
                if not data:
                    break
                with self._lock:
                    self._buf += data
                    del self._buf[:-STDERR_TAIL_BYTES]
                try:
                    os.write(2, data)
                except OSError:
                    pass
        finally:
            os.close(self._read)

    def text(self, wait_s: float = 1.0) -> str:
        """The tail so far (waiting up to ``wait_s`` for the pipe's end)."""
        self._thread.join(timeout=wait_s)
        with self._lock:
            return self._buf.decode(errors="replace")


# ---------------------------------------------------------------- the rendezvous files
_STORE_FILES: set[str] = set()
"""Rendezvous files of this process's groups (removed at teardown, exit and SIGTERM)."""
_PREVIOUS_SIGTERM: list[Any] = []
_LIVE_WORKERS: list[Callable[[], Iterable[Any]]] = []
"""What SIGTERM terminates: the worker processes of the live groups (set with the handler)."""


def new_store_file(live_workers: Callable[[], Iterable[Any]]) -> str:
    """A fresh rendezvous path (not created: ``FileStore`` creates it, and a stale file would
    hold old keys), removed on every exit path; ``live_workers`` lists the processes SIGTERM
    must stop."""
    fd, path = tempfile.mkstemp(prefix="piecewise-tp-")
    os.close(fd)
    os.unlink(path)
    _STORE_FILES.add(path)
    _install_sigterm_cleanup(live_workers)
    return path


def remove_store_file(path: str) -> None:
    _STORE_FILES.discard(path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _on_sigterm(signum, frame) -> None:
    """Remove the rendezvous files and stop the workers, then do what SIGTERM did before."""
    for live in _LIVE_WORKERS:
        for p in list(live()):
            with contextlib.suppress(Exception):
                p.terminate()
    for path in list(_STORE_FILES):
        remove_store_file(path)
    previous = _PREVIOUS_SIGTERM[0] if _PREVIOUS_SIGTERM else signal.SIG_DFL
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signal.SIGTERM, previous)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm_cleanup(live_workers: Callable[[], Iterable[Any]]) -> None:
    """Chain :func:`_on_sigterm` before the current SIGTERM handler (once; main thread only:
    elsewhere the files are still removed on every other exit path)."""
    if not _LIVE_WORKERS:
        _LIVE_WORKERS.append(live_workers)
    if _PREVIOUS_SIGTERM or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is None:  # a handler set outside Python: leave it alone
        return
    signal.signal(signal.SIGTERM, _on_sigterm)
    _PREVIOUS_SIGTERM.append(previous)


atexit.register(lambda: [remove_store_file(p) for p in list(_STORE_FILES)])
