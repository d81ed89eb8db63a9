"""``python -m framework.cache ls|verify|prune|explain [DIR]`` — inspect and maintain the cache.

* ``ls``       one row per (key, rank, model tag): entries, unique artifacts, blobs, size, age.
* ``verify``   re-checksum every artifact, blob and extracted kernel (``kernels/k<sha>.so``,
               named by its content), check every index and ``factors.json``;
               exit code 1 and one line per bad file when anything fails.
* ``prune``    remove whole key directories, least recently used first, ``--older-than 7d``
               and/or ``--max-size 2G``; keys whose lock is held by a running process are
               skipped.
* ``explain``  which cache-key factors differ between two keys (dotted names, both values).

``DIR`` defaults to ``$PIECEWISE_CACHE_DIR`` or ``~/.cache/piecewise``.  Exit code 2 for usage
errors (missing directory, unknown key).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import secrets
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from filelock import FileLock, Timeout

from framework.cache.files import content_name_problem
from framework.cache.key import compute_cache_key, flatten_factors
from framework.cache.store import (
    FACTORS_FILE,
    INDEX_FILE,
    KERNEL_DIR,
    LOCK_FILE,
    CacheIndexError,
    default_cache_dir,
    read_index,
    record_problem,
)

_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_TIME_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_PRUNE_PREFIX = ".pruning-"


class UsageError(Exception):
    """Bad arguments or a missing directory/key: printed without a traceback, exit code 2."""


# ----------------------------------------------------------------------------- parsing helpers
def parse_size(text: str) -> int:
    """``2G``, ``500M``, ``10KiB``, ``1.5GB``, ``4096`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise UsageError(f"--max-size {text!r}: expected a size like 500M or 2G")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


def parse_duration(text: str) -> float:
    """``7d``, ``12h``, ``30m``, ``45s``, ``2w`` -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if not m:
        raise UsageError(f"--older-than {text!r}: expected a number with a unit s/m/h/d/w, e.g. 7d")
    return float(m.group(1)) * _TIME_UNITS[m.group(2)]


def format_size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def format_age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.1f}{unit}"
    return f"{seconds:.0f}s"


# ----------------------------------------------------------------------------- scanning
@dataclasses.dataclass
class ModelDir:
    path: Path
    rank: str
    model_tag: str
    entries: int | None  # None when the index does not parse
    artifacts: int
    blobs: int
    size: int
    index_error: str | None


@dataclasses.dataclass
class KeyDir:
    path: Path
    key: str
    last_used: float
    size: int
    models: list[ModelDir]


def _tree_stats(path: Path) -> tuple[int, float]:
    """(total bytes, newest mtime) of everything under ``path``, including ``path`` itself."""
    total, newest = 0, path.stat().st_mtime
    for dirpath, _, files in os.walk(path):
        newest = max(newest, os.stat(dirpath).st_mtime)
        for name in files:
            try:
                st = os.stat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            total += st.st_size
            newest = max(newest, st.st_mtime)
    return total, newest


def _model_dirs(key_path: Path) -> list[Path]:
    return sorted(
        p for rank in key_path.glob("rank_*") if rank.is_dir() for p in rank.iterdir() if p.is_dir()
    )


def scan_key(key_path: Path) -> KeyDir:
    models = []
    for model_path in _model_dirs(key_path):
        size, _ = _tree_stats(model_path)
        try:
            index = read_index(model_path / INDEX_FILE)
            entries = index["entries"]
            artifacts = {r.get("artifact") for r in entries.values() if isinstance(r, dict)}
            models.append(
                ModelDir(
                    model_path,
                    model_path.parent.name.removeprefix("rank_"),
                    model_path.name,
                    len(entries),
                    len(artifacts),
                    len(index["blobs"]),
                    size,
                    None,
                )
            )
        except CacheIndexError as e:
            models.append(
                ModelDir(
                    model_path,
                    model_path.parent.name.removeprefix("rank_"),
                    model_path.name,
                    None,
                    0,
                    0,
                    size,
                    str(e),
                )
            )
    size, newest = _tree_stats(key_path)
    return KeyDir(key_path, key_path.name, newest, size, models)


def scan_cache(root: Path) -> list[KeyDir]:
    """Every key directory under ``root`` (a directory holding ``factors.json`` or ranks)."""
    keys = []
    for path in sorted(root.iterdir()):
        if not path.is_dir() or path.name.startswith("."):
            continue
        if (path / FACTORS_FILE).exists() or any(path.glob("rank_*")):
            keys.append(scan_key(path))
    return keys


def _require_dir(root: Path) -> Path:
    if not root.exists():
        raise UsageError(
            f"cache directory {root} does not exist (nothing cached yet?); pass "
            f"DIR or set $PIECEWISE_CACHE_DIR"
        )
    if not root.is_dir():
        raise UsageError(f"{root} is not a directory")
    return root


def resolve_key(root: Path, key: str) -> Path:
    """A key directory by full key or unique prefix; a clear error listing the keys otherwise."""
    candidates = [k.key for k in scan_cache(root)]
    exact = [k for k in candidates if k == key]
    matches = exact or [k for k in candidates if k.startswith(key)]
    if len(matches) == 1:
        return root / matches[0]
    if not matches:
        listing = ", ".join(candidates) if candidates else "none"
        raise UsageError(f"no cache key {key!r} in {root}; keys there: {listing}")
    raise UsageError(f"cache key prefix {key!r} is ambiguous in {root}: {', '.join(matches)}")


# ----------------------------------------------------------------------------- commands
def cmd_ls(root: Path, out=None) -> int:
    out = out or sys.stdout
    keys = scan_cache(_require_dir(root))
    if not keys:
        print(f"{root}: empty cache", file=out)
        return 0
    now = time.time()
    header = ("KEY", "RANK", "MODEL", "ENTRIES", "ARTIFACTS", "BLOBS", "SIZE", "AGE")
    rows = []
    for k in sorted(keys, key=lambda k: k.last_used, reverse=True):
        age = format_age(now - k.last_used)
        if not k.models:
            rows.append((k.key, "-", "-", "0", "0", "0", format_size(k.size), age))
        for m in k.models:
            entries = "?" if m.entries is None else str(m.entries)
            rows.append(
                (
                    k.key,
                    m.rank,
                    m.model_tag,
                    entries,
                    str(m.artifacts),
                    str(m.blobs),
                    format_size(m.size),
                    age,
                )
            )
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip(), file=out)
    total = sum(k.size for k in keys)
    print(f"{len(keys)} key(s), {format_size(total)} in {root}", file=out)
    for k in keys:
        for m in k.models:
            if m.index_error:
                print(f"warning: {m.index_error}", file=out)
    return 0


def verify_key(key_path: Path) -> tuple[list[str], int]:
    """(problems as 'path: why' lines, number of files verified) for one key directory."""
    problems, checked = [], 0
    factors_path = key_path / FACTORS_FILE
    try:
        factors = json.loads(factors_path.read_text())
        if compute_cache_key(factors)[0] != key_path.name:
            problems.append(f"{factors_path}: factors do not hash to key {key_path.name}")
        checked += 1
    except FileNotFoundError:
        problems.append(f"{factors_path}: missing")
    except (ValueError, TypeError, UnicodeDecodeError) as e:
        problems.append(f"{factors_path}: does not parse ({e})")
    for model_path in _model_dirs(key_path):
        try:
            index = read_index(model_path / INDEX_FILE)
        except CacheIndexError as e:
            problems.append(str(e))
            continue
        seen: dict[str, str | None] = {}
        for kind, records, field in (
            ("artifact", index["entries"], "artifact"),
            ("blob", index["blobs"], "path"),
        ):
            for name, record in records.items():
                rel = record.get(field) if isinstance(record, dict) else None
                if rel not in seen or rel is None:
                    seen[rel] = record_problem(model_path, record, kind)
                    checked += 1
                if seen[rel] is not None:
                    where = model_path / rel if isinstance(rel, str) else model_path / INDEX_FILE
                    problems.append(f"{where}: {kind} {name!r}: {seen[rel]}")
        for kernel in sorted((model_path / KERNEL_DIR).glob("k*.so")):
            checked += 1
            if problem := content_name_problem(kernel):
                problems.append(f"{kernel}: extracted kernel: {problem}")
    return problems, checked


def cmd_verify(root: Path, out=None) -> int:
    out = out or sys.stdout
    keys = scan_cache(_require_dir(root))
    problems, checked = [], 0
    for k in keys:
        p, n = verify_key(k.path)
        problems += p
        checked += n
    for line in problems:
        print(f"BAD {line}", file=out)
    status = "FAILED" if problems else "OK"
    print(
        f"{status}: {checked} file(s) checked in {len(keys)} key(s), {len(problems)} bad", file=out
    )
    return 1 if problems else 0


def _lock_key_dir(key_path: Path) -> list[FileLock] | None:
    """Try every (rank, model) lock without waiting; None if one is held (key in use)."""
    held = []
    for model_path in _model_dirs(key_path):
        lock = FileLock(str(model_path / LOCK_FILE), timeout=0)
        try:
            lock.acquire()
        except Timeout:
            for other in held:
                other.release()
            return None
        held.append(lock)
    return held


def _remove_key_dir(root: Path, key: KeyDir) -> bool:
    locks = _lock_key_dir(key.path)
    if locks is None:
        return False
    try:
        # Rename first (atomic): a process opening this key from now on starts a fresh dir
        # instead of seeing a half-deleted one.
        doomed = root / f"{_PRUNE_PREFIX}{key.key}-{secrets.token_hex(4)}"
        os.replace(key.path, doomed)
    finally:
        for lock in locks:
            lock.release()
    shutil.rmtree(doomed, ignore_errors=True)
    return True


def cmd_prune(
    root: Path, older_than: str | None, max_size: str | None, dry_run: bool = False, out=None
) -> int:
    out = out or sys.stdout
    if older_than is None and max_size is None:
        raise UsageError("prune: give --older-than (e.g. 7d) and/or --max-size (e.g. 2G)")
    max_age = parse_duration(older_than) if older_than is not None else None
    limit = parse_size(max_size) if max_size is not None else None
    _require_dir(root)
    for leftover in root.glob(f"{_PRUNE_PREFIX}*"):  # an interrupted earlier prune
        if not dry_run:
            shutil.rmtree(leftover, ignore_errors=True)
    keys = sorted(scan_cache(root), key=lambda k: k.last_used)  # least recently used first
    now = time.time()
    total = sum(k.size for k in keys)
    doomed = []
    for k in keys:
        too_old = max_age is not None and now - k.last_used > max_age
        too_big = limit is not None and total > limit
        if too_old or too_big:
            doomed.append((k, "older than " + older_than if too_old else "over " + max_size))
            total -= k.size
    removed_bytes, removed = 0, 0
    for k, why in doomed:
        age = format_age(now - k.last_used)
        if dry_run:
            print(f"would remove {k.key} ({format_size(k.size)}, used {age} ago; {why})", file=out)
            continue
        if _remove_key_dir(root, k):
            removed += 1
            removed_bytes += k.size
            print(f"removed {k.key} ({format_size(k.size)}, used {age} ago; {why})", file=out)
        else:
            print(f"skipped {k.key}: in use by a running process (its lock is held)", file=out)
    verb = "would remove" if dry_run else "removed"
    count = len(doomed) if dry_run else removed
    size = sum(k.size for k, _ in doomed) if dry_run else removed_bytes
    print(
        f"{verb} {count} key(s), {format_size(size)}; {len(keys) - count} key(s) kept in {root}",
        file=out,
    )
    return 0


def _load_factors(key_path: Path) -> dict[str, Any]:
    path = key_path / FACTORS_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{path} is missing: cannot explain key {key_path.name}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise UsageError(f"{path} does not parse ({e})") from None


_ABSENT = object()


def explain_factors(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(dotted name, value in a, value in b) for every differing leaf factor."""
    flat_a, flat_b = flatten_factors(a), flatten_factors(b)
    return [
        (name, flat_a.get(name, _ABSENT), flat_b.get(name, _ABSENT))
        for name in sorted(set(flat_a) | set(flat_b))
        if flat_a.get(name, _ABSENT) != flat_b.get(name, _ABSENT)
    ]


def cmd_explain(root: Path, key_a: str, key_b: str, out=None) -> int:
    out = out or sys.stdout
    _require_dir(root)
    path_a, path_b = resolve_key(root, key_a), resolve_key(root, key_b)
    diffs = explain_factors(_load_factors(path_a), _load_factors(path_b))
    if not diffs:
        print(f"{path_a.name} and {path_b.name}: all factors are equal", file=out)
        return 0

    def show(v: Any) -> str:
        return "(absent)" if v is _ABSENT else json.dumps(v)

    print(
        f"{len(diffs)} factor(s) differ between {path_a.name} (A) and {path_b.name} (B):", file=out
    )
    for name, va, vb in diffs:
        print(
            f"  {name}{_explain_note(name, va, vb)}:\n    A: {show(va)}\n    B: {show(vb)}",
            file=out,
        )
    return 0


PASS_UUID_PREFIX = "passes.uuid."
"""Dotted prefix of a pass's uuid in the factors (``PassManager.cache_factors``)."""


def _explain_note(name: str, va: Any, vb: Any) -> str:
    """What a differing factor means, where the name alone does not say it."""
    if not name.startswith(PASS_UUID_PREFIX):
        return ""
    pass_name = name[len(PASS_UUID_PREFIX) :]
    if va is _ABSENT or vb is _ABSENT:
        return f" (pass {pass_name!r} runs only in {'B' if va is _ABSENT else 'A'})"
    return f" (pass {pass_name!r}: its code or its config differs)"


# ----------------------------------------------------------------------------- entry point
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m framework.cache",
        description="Inspect and maintain the piecewise on-disk artifact cache. DIR defaults to "
        "$PIECEWISE_CACHE_DIR or ~/.cache/piecewise.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ls", help="list keys with entries, artifacts, sizes and ages")
    p.add_argument("dir", nargs="?")
    p = sub.add_parser("verify", help="re-checksum every file; exit 1 if any is bad")
    p.add_argument("dir", nargs="?")
    p = sub.add_parser("prune", help="remove least recently used keys by age and/or size")
    p.add_argument("dir", nargs="?")
    p.add_argument("--older-than", help="remove keys unused for longer than this (e.g. 7d)")
    p.add_argument("--max-size", help="then remove oldest keys until the total fits (e.g. 2G)")
    p.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    p = sub.add_parser("explain", help="which cache-key factors differ between two keys")
    p.add_argument(
        "args",
        nargs="+",
        metavar="[DIR] KEY_A KEY_B",
        help="two keys (or unique prefixes), optionally preceded by DIR",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "explain":
            if len(args.args) not in (2, 3):
                raise UsageError("explain: expected [DIR] KEY_A KEY_B")
            root = Path(args.args[0]) if len(args.args) == 3 else default_cache_dir()
            return cmd_explain(root.expanduser(), *args.args[-2:])
        root = Path(args.dir).expanduser() if args.dir else default_cache_dir()
        if args.command == "ls":
            return cmd_ls(root)
        if args.command == "verify":
            return cmd_verify(root)
        return cmd_prune(root, args.older_than, args.max_size, args.dry_run)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
