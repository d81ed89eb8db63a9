"""On-disk artifact store for compiled pieces: atomic writes, checksums, dedup, a file lock.

Layout (one *key* per distinct set of cache-key factors, see :mod:`framework.cache.key`)::

    <root>/<key>/factors.json                      the factors that were hashed into <key>
    <root>/<key>/rank_<r>/<model_tag>/index.json   entry key -> artifact record, blob records
    <root>/<key>/rank_<r>/<model_tag>/artifacts/<graph_hash>.bin
    <root>/<key>/rank_<r>/<model_tag>/blobs/<name>
    <root>/<key>/rank_<r>/<model_tag>/.lock

Guarantees:

* Every file is written to a temp name in its final directory, fsynced, checksummed and
  ``os.replace``-d into place; ``index.json`` the same way.  A crash leaves either the old or
  the new file, never a partial one (stale temp files are swept by the next writer).
* The index records each artifact's sha256 and size; :meth:`ArtifactStore.lookup` verifies them.
  Corruption (truncated file, flipped bytes, missing file, unparsable index) is reported with
  :class:`CacheCorruptionWarning` naming the file, the bad entry is dropped and ``None`` comes
  back so the caller recompiles.  Corruption never raises.
* Entries with the same ``graph_hash`` share one artifact file: this is the one dedup
  mechanism. ``lookup(entry, graph_hash)`` links a new entry to an identical piece's artifact
  so it is not compiled again, ``link(entry, graph_hash)`` does only that (a piece the caller
  shares in memory), and ``store`` writes only if no verified artifact has the hash.
* :meth:`ArtifactStore.lock` is a cross-process lock.  Compile *inside* it::

      with store.lock():
          path = store.lookup(entry, graph_hash)
          if path is None:
              compiled = compile_piece(...)
              path = store.store(entry, graph_hash,
                                 lambda tmp: compiled.save(path=str(tmp), format="binary"))

  Several processes starting cold on one directory then serialize per entry: the first
  compiles and stores, the others wait, find the entry and load it — every graph is compiled
  once and the directory ends with one complete set of artifacts.  The lock is re-entrant
  within a process (and shared by every store on the same directory in it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

from filelock import FileLock

from framework.cache.files import (
    atomic_write,
    atomic_write_bytes,
    file_sha256,
    is_environment_error,
    remove,
    shared_file_lock,
    sweep_stale_temps,
)
from framework.cache.index import (
    ARTIFACT_DIR,
    ARTIFACT_REL,
    BLOB_DIR,
    BLOB_REL,
    INDEX_FILE,
    SAFE_NAME,
    CacheIndexError,
    check_record,
    empty_index,
    read_index,
    record_problem,
)
from framework.cache.key import canonical_json, compute_cache_key
from framework.core.files import default_cache_root

__all__ = [  # the index and file names are part of this module's interface (cli, tests)
    "ArtifactStore",
    "CacheCorruptionWarning",
    "CacheIndexError",
    "CacheStats",
    "FACTORS_FILE",
    "INDEX_FILE",
    "LOCK_FILE",
    "atomic_write_bytes",
    "compute_cache_key",
    "default_cache_dir",
    "file_sha256",
    "read_index",
    "record_problem",
]

FACTORS_FILE = "factors.json"
LOCK_FILE = ".lock"
KERNEL_DIR = "kernels"
"""Kernels extracted from artifacts, ``k<sha256>.so`` (named by content), beside ``artifacts/``."""


class CacheCorruptionWarning(UserWarning):
    """A cache file failed verification; it was dropped and will be recompiled."""


class CacheWriteWarning(UserWarning):
    """The cache directory refused a write (full or read-only disk): the store stops writing,
    what is compiled from then on stays in memory, and every entry already there is kept."""


class _StoreLock:
    """The store's cross-process, re-entrant lock (the one :class:`FileLock` per lock file per
    process, so every handle releases what another acquired).  A directory where the lock
    file cannot be created (read-only disk) makes the store read-only instead of failing:
    nothing is written then, so there is nothing to serialize."""

    def __init__(self, store: "ArtifactStore") -> None:
        self.store = store
        self.acquired = False

    def _file_lock(self) -> FileLock:
        self.store.dir.mkdir(parents=True, exist_ok=True)  # recreated if pruned
        return shared_file_lock(self.store.dir / LOCK_FILE)

    def acquire(self, timeout: float = -1) -> "_StoreLock":
        if self.store.writable:
            try:
                self._file_lock().acquire(timeout=timeout)
                self.acquired = True
            except OSError as e:  # warned when a write is needed: a warm start needs none
                self.store.refuse_writes(e, warn=False)
        return self

    def release(self) -> None:
        if self.store.writable or self.acquired:
            lock = shared_file_lock(self.store.dir / LOCK_FILE)
            if lock.is_locked:
                lock.release()
        self.acquired = False

    def __enter__(self) -> "_StoreLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        if self.acquired:
            self.release()


default_cache_dir = default_cache_root
"""``$PIECEWISE_CACHE_DIR`` or ``~/.cache/piecewise`` (defined once, in
:mod:`framework.core.files`)."""


@dataclasses.dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    writes: int = 0
    dedup_reuses: int = 0
    blob_hits: int = 0
    blob_misses: int = 0
    blob_writes: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- the store
class ArtifactStore:
    """Artifacts of one (key, rank, model_tag).  See the module docstring for guarantees.

    ``key`` must be ``compute_cache_key(factors)[0]`` (checked, so a key and the factors that
    explain it can never disagree); :meth:`open` computes it for you.
    """

    def __init__(
        self,
        root: str | Path,
        key: str,
        factors: Mapping[str, Any],
        rank: int = 0,
        model_tag: str = "model",
    ) -> None:
        expected, normalized = compute_cache_key(factors)
        if key != expected:
            raise ValueError(
                f"ArtifactStore: key {key!r} is not the hash of the given factors "
                f"({expected!r}); build it with compute_cache_key(factors)"
            )
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"ArtifactStore: rank must be a non-negative int, got {rank!r}")
        if not SAFE_NAME.match(model_tag):
            raise ValueError(
                f"ArtifactStore: model_tag {model_tag!r} must be a plain file name "
                f"(letters, digits, '_', '-', '.')"
            )
        self.root = Path(root).expanduser()
        self.key = key
        self.factors = normalized
        self.rank = rank
        self.model_tag = model_tag
        self.key_dir = self.root / key
        self.dir = self.key_dir / f"rank_{rank}" / model_tag
        self.stats = CacheStats()
        self._verified: set[tuple] = set()
        self.writable = True
        """False once the directory refused a write (:meth:`refuse_writes`)."""
        self.write_error: str | None = None
        self._warned_unwritable = False
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._write_factors()
        except OSError as e:
            self.refuse_writes(e)
        try:
            os.utime(self.key_dir)  # "last used" for `prune`
        except OSError:
            pass  # a read-only cache still loads; `prune` then sees an older time
        if self.writable:  # what writers that died left (their pid is gone, or old)
            for directory in (self.dir, self.dir / ARTIFACT_DIR, self.dir / BLOB_DIR):
                sweep_stale_temps(directory)
            for directory in (self.dir / KERNEL_DIR, self.key_dir):
                sweep_stale_temps(directory)

    @classmethod
    def open(
        cls, root: str | Path, factors: Mapping[str, Any], rank: int = 0, model_tag: str = "model"
    ) -> "ArtifactStore":
        return cls(root, compute_cache_key(factors)[0], factors, rank, model_tag)

    def __repr__(self) -> str:
        return f"ArtifactStore({str(self.dir)!r})"

    @property
    def index_path(self) -> Path:
        return self.dir / INDEX_FILE

    def lock(self) -> _StoreLock:
        """Cross-process, re-entrant lock on this (key, rank, model_tag) directory (a
        context manager; on a directory that refuses the lock file the store turns
        read-only and the lock is a no-op)."""
        return _StoreLock(self)

    def refuse_writes(self, error: OSError, *, warn: bool = True) -> None:
        """The disk refused a write: stop writing (one :class:`CacheWriteWarning` naming the
        directory and the error, now or, with ``warn=False``, when a write is next needed);
        entries already stored stay and still load.  An error that is not the disk's (a
        bug) is re-raised."""
        if not is_environment_error(error):
            raise error
        if self.writable:
            self.writable = False
            self.write_error = f"{type(error).__name__}: {error}"
        if warn:
            self._warn_unwritable()

    def _warn_unwritable(self) -> None:
        if self._warned_unwritable:
            return
        self._warned_unwritable = True
        warnings.warn(
            f"piecewise cache: cannot write to {self.dir} ({self.write_error}); compiling "
            f"in memory and caching nothing more in this process (stored entries are kept)",
            CacheWriteWarning,
            stacklevel=3,
        )

    # ------------------------------------------------------------------ artifacts
    def lookup(self, entry_key: str, graph_hash: str | None = None) -> Path | None:
        """The verified artifact path for ``entry_key``, or ``None`` (missing or corrupt).

        With ``graph_hash`` (optional), a recorded entry must have that hash to count, and an
        entry not recorded yet is linked to an existing verified artifact of the same graph
        (an identical piece compiled under another entry key), so the caller skips compiling.
        """
        rel = f"{ARTIFACT_DIR}/{graph_hash}.bin" if graph_hash is not None else None
        index = self._load_index()
        record = index["entries"].get(entry_key)
        if self._usable(record, graph_hash):
            self.stats.hits += 1
            return self.dir / record["artifact"]
        if record is None and graph_hash is None:
            self.stats.misses += 1
            return None
        with self.lock():  # re-read: another process may have stored or repaired it meanwhile
            index = self._load_index()
            record = index["entries"].get(entry_key)
            if self._usable(record, graph_hash):
                self.stats.hits += 1
                return self.dir / record["artifact"]
            dirty = False
            if record is not None and (problem := self._problem(record, "artifact")):
                self._drop_artifact(index, entry_key, record, problem)
                dirty = True
            shared = self._find_by_artifact(index, rel) if rel is not None else None
            if shared is not None and (problem := self._problem(shared[1], "artifact")):
                self._drop_artifact(index, shared[0], shared[1], problem)
                shared, dirty = None, True
            if shared is not None:
                self._point_entry(index, entry_key, shared[1])
                self.stats.hits += 1
                return self.dir / rel
            if dirty:
                self._save_index(index)
        self.stats.misses += 1
        return None

    def _usable(self, record: Any, graph_hash: str | None) -> bool:
        if record is None or self._problem(record, "artifact") is not None:
            return False
        return graph_hash is None or record.get("graph_hash") == graph_hash

    def store(self, entry_key: str, graph_hash: str, write: Callable[[Path], None]) -> Path | None:
        """Record ``entry_key`` -> the artifact for ``graph_hash``, writing it if needed.

        ``graph_hash`` must identify everything the artifact depends on beyond the cache key
        (graph, input shapes/compile range, compiler): entries with equal hashes share a file.
        ``write(tmp_path)`` must create a *file* at ``tmp_path``; it runs only when no verified
        artifact for ``graph_hash`` exists.  If it raises, nothing is recorded or left behind.
        A disk that refuses the write (full, read-only) makes the store read-only
        (:meth:`refuse_writes`) and ``None`` comes back: the caller keeps its compiled code in
        memory.
        """
        if not isinstance(entry_key, str) or not entry_key:
            raise ValueError(
                f"ArtifactStore.store: entry_key must be a non-empty string, got {entry_key!r}"
            )
        if not SAFE_NAME.match(graph_hash):
            raise ValueError(
                f"ArtifactStore.store: graph_hash {graph_hash!r} must be a plain "
                f"file name (letters, digits, '_', '-', '.')"
            )
        rel = f"{ARTIFACT_DIR}/{graph_hash}.bin"
        if not self.writable:
            self._warn_unwritable()
            return None
        with self.lock():
            try:
                return self._store_locked(entry_key, graph_hash, rel, write)
            except OSError as e:
                self.refuse_writes(e)
                return None

    def _store_locked(
        self, entry_key: str, graph_hash: str, rel: str, write: Callable[[Path], None]
    ) -> Path | None:
        if not self.writable:
            self._warn_unwritable()
            return None
        index = self._load_index()
        shared = self._find_by_artifact(index, rel)
        if shared is not None and self._problem(shared[1], "artifact") is None:
            record = dict(shared[1])
            self.stats.dedup_reuses += 1
        else:
            if shared is not None:
                self._drop_artifact(
                    index, shared[0], shared[1], self._problem(shared[1], "artifact")
                )
            self._sweep_stale_temps()
            self._write_factors()  # (again, in case `prune` removed the key meanwhile)
            sha, size = self._write_file(self.dir / rel, write)
            record = {
                "artifact": rel,
                "sha256": sha,
                "size": size,
                "created": time.time(),
                "graph_hash": graph_hash,
            }
            self.stats.writes += 1
        self._point_entry(index, entry_key, record, reused=False)
        return self.dir / rel if self.writable else None

    def link(self, entry_key: str, graph_hash: str) -> Path | None:
        """Record ``entry_key`` -> the verified artifact already stored for ``graph_hash`` (an
        identical piece compiled under another entry key). ``None``, recording nothing, when
        there is none (never stored, or found corrupt and dropped): the caller compiles."""
        rel = f"{ARTIFACT_DIR}/{graph_hash}.bin"
        with self.lock():
            index = self._load_index()
            shared = self._find_by_artifact(index, rel)
            if shared is not None and (problem := self._problem(shared[1], "artifact")):
                self._drop_artifact(index, shared[0], shared[1], problem)
                self._save_index(index)
                return None
            if shared is None:
                return None
            self._point_entry(index, entry_key, shared[1])
        return self.dir / rel

    def _point_entry(self, index: dict, entry_key: str, record: dict, reused: bool = True) -> None:
        """(Under the lock) ``entry_key`` -> ``record``; the artifact the entry named before is
        removed if nothing else names it. ``reused``: the record is another entry's (dedup)."""
        previous = index["entries"].get(entry_key)
        index["entries"][entry_key] = dict(record)
        if isinstance(previous, dict) and previous.get("artifact") != record["artifact"]:
            self._unlink_if_unreferenced(index, previous.get("artifact"))
        self._save_index(index)
        if reused:
            self.stats.dedup_reuses += 1

    def discard(self, entry_key: str, reason: str) -> None:
        """Drop an entry whose artifact verified but would not load (e.g. the loader raised),
        with a warning naming the file; entries sharing the artifact go too."""
        with self.lock():
            index = self._load_index()
            record = index["entries"].get(entry_key)
            if record is not None:
                self._drop_artifact(index, entry_key, record, reason)
                self._save_index(index)

    def entries(self) -> dict[str, dict]:
        """A copy of the index's entry records (entry key -> record)."""
        return json.loads(json.dumps(self._load_index()["entries"]))

    # ------------------------------------------------------------------ blobs
    def store_blob(self, name: str, data: bytes) -> Path | None:
        """Atomically save auxiliary bytes (e.g. a serialized traced program) under ``name``."""
        if not SAFE_NAME.match(name):
            raise ValueError(f"ArtifactStore.store_blob: name {name!r} must be a plain file name")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(
                f"ArtifactStore.store_blob({name!r}): data must be bytes, got {type(data).__name__}"
            )
        data = bytes(data)
        rel = f"{BLOB_DIR}/{name}"
        if not self.writable:
            self._warn_unwritable()
            return None
        with self.lock():
            index = self._load_index()
            self._sweep_stale_temps()
            try:
                atomic_write_bytes(self.dir / rel, data)
            except OSError as e:
                self.refuse_writes(e)
                return None
            index["blobs"][name] = {
                "path": rel,
                "sha256": hashlib.sha256(data).hexdigest(),
                "size": len(data),
                "created": time.time(),
            }
            self._save_index(index)
            self.stats.blob_writes += 1
        return self.dir / rel

    def load_blob(self, name: str) -> bytes | None:
        """The bytes stored under ``name`` if present and intact, else ``None``."""
        record = self._load_index()["blobs"].get(name)
        data = None
        problem = check_record(record, BLOB_REL, "path") if record is not None else None
        if record is not None and problem is None:
            try:
                data = (self.dir / record["path"]).read_bytes()
            except FileNotFoundError:
                problem = "file is missing"
            else:
                if len(data) != record["size"]:
                    problem = (
                        f"size {len(data)} bytes, index records {record['size']} "
                        f"(truncated or overwritten)"
                    )
                elif hashlib.sha256(data).hexdigest() != record["sha256"]:
                    problem = "sha256 mismatch (corrupted)"
        if record is not None and problem is None:
            self.stats.blob_hits += 1
            return data
        if record is not None:
            with self.lock():
                index = self._load_index()
                if index["blobs"].get(name) == record:
                    where = record.get("path", name) if isinstance(record, dict) else name
                    self._warn(self.dir / str(where), problem)
                    self.stats.corrupt += 1
                    del index["blobs"][name]
                    if isinstance(record, dict) and BLOB_REL.match(str(record.get("path"))):
                        remove(self.dir / record["path"])
                    self._save_index(index)
        self.stats.blob_misses += 1
        return None

    # ------------------------------------------------------------------ internals
    def _warn(self, path: Path, problem: str | None, stacklevel: int = 3) -> None:
        warnings.warn(
            f"piecewise cache: {path}: {problem}; dropping it (will recompile)",
            CacheCorruptionWarning,
            stacklevel=stacklevel,
        )

    def _write_factors(self) -> None:
        path = self.key_dir / FACTORS_FILE
        text = canonical_json(self.factors)
        try:
            if path.read_text() == text:
                return
        except (FileNotFoundError, UnicodeDecodeError):
            pass
        atomic_write_bytes(path, text.encode())

    def _load_index(self) -> dict[str, Any]:
        try:
            return read_index(self.index_path)
        except CacheIndexError as e:
            with self.lock():
                try:  # another process may already have replaced it
                    return read_index(self.index_path)
                except CacheIndexError:
                    pass
                warnings.warn(
                    f"piecewise cache: {e}; discarding the index and its artifacts "
                    f"(will recompile)",
                    CacheCorruptionWarning,
                    stacklevel=3,
                )
                self.stats.corrupt += 1
                # Nothing vouches for the files the index described any more.
                for sub in (ARTIFACT_DIR, BLOB_DIR):
                    remove(self.dir / sub)
                remove(self.index_path)
                self._verified.clear()
            return empty_index()

    def _save_index(self, index: dict[str, Any]) -> None:
        if not self.writable:
            self._warn_unwritable()
            return
        try:
            atomic_write_bytes(
                self.index_path, json.dumps(index, sort_keys=True, indent=1).encode()
            )
        except OSError as e:
            self.refuse_writes(e)

    def _problem(self, record: Any, kind: str) -> str | None:
        """record_problem, memoized per (file identity, checksum) within this process."""
        field = "artifact" if kind == "artifact" else "path"
        if check_record(record, ARTIFACT_REL if kind == "artifact" else BLOB_REL, field):
            return record_problem(self.dir, record, kind)
        try:
            st = (self.dir / record[field]).stat()
        except FileNotFoundError:
            return "file is missing"
        identity = (record[field], st.st_ino, st.st_size, st.st_mtime_ns, record["sha256"])
        if identity in self._verified:
            return None
        problem = record_problem(self.dir, record, kind)
        if problem is None:
            self._verified.add(identity)
        return problem

    @staticmethod
    def _find_by_artifact(index: dict, rel: str) -> tuple[str, dict] | None:
        for entry_key, record in index["entries"].items():
            if isinstance(record, dict) and record.get("artifact") == rel:
                return entry_key, record
        return None

    def _drop_artifact(self, index: dict, entry_key: str, record: Any, problem: str | None) -> None:
        """Remove a bad artifact and every entry that shares it (they are all bad)."""
        rel = record.get("artifact") if isinstance(record, dict) else None
        self._warn(self.dir / str(rel or INDEX_FILE), f"entry {entry_key!r}: {problem}", 4)
        self.stats.corrupt += 1
        index["entries"].pop(entry_key, None)
        if rel is None or not ARTIFACT_REL.match(rel):
            return
        for other in [
            k
            for k, r in index["entries"].items()
            if isinstance(r, dict) and r.get("artifact") == rel
        ]:
            del index["entries"][other]
        remove(self.dir / rel)

    def _unlink_if_unreferenced(self, index: dict, rel: Any) -> None:
        if not isinstance(rel, str) or not ARTIFACT_REL.match(rel):
            return
        if self._find_by_artifact(index, rel) is None:
            remove(self.dir / rel)

    def _sweep_stale_temps(self) -> None:
        """Temp files only exist while their writer holds the lock, which we now hold: any
        left over belong to a process that died mid-write.  Extracted kernels (written
        without the lock) and ``factors.json`` temps go when their writer is gone."""
        for directory in (self.dir, self.dir / ARTIFACT_DIR, self.dir / BLOB_DIR):
            sweep_stale_temps(directory, lock_held=True)
        for directory in (self.dir / KERNEL_DIR, self.key_dir):
            sweep_stale_temps(directory)

    @staticmethod
    def _write_file(final: Path, write: Callable[[Path], None]) -> tuple[str, int]:
        digest: list = []

        def write_and_hash(tmp: Path) -> None:
            write(tmp)
            if not tmp.is_file():
                raise RuntimeError(
                    f"ArtifactStore: the write callback did not create a file at {tmp} "
                    f"(directory-style artifacts are not supported; save in a single-file "
                    f"format such as standalone_compile's format='binary')"
                )
            digest.extend((file_sha256(tmp), tmp.stat().st_size))

        atomic_write(final, write_and_hash)
        return digest[0], digest[1]
