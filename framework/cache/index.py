"""The format of a cache directory's ``index.json``: entry key -> artifact record (path,
sha256, size), blob records; parsing, and verifying the file behind a record."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from framework.cache.files import file_sha256

INDEX_FORMAT = 1
INDEX_FILE = "index.json"
ARTIFACT_DIR = "artifacts"
BLOB_DIR = "blobs"

SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")
ARTIFACT_REL = re.compile(rf"^{ARTIFACT_DIR}/[A-Za-z0-9_][A-Za-z0-9_.\-]*\.bin$")
BLOB_REL = re.compile(rf"^{BLOB_DIR}/[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


class CacheIndexError(ValueError):
    """An ``index.json`` that does not parse or does not have the expected structure."""


def empty_index() -> dict[str, Any]:
    return {"format": INDEX_FORMAT, "entries": {}, "blobs": {}}


def check_record(record: Any, rel_pattern: re.Pattern, path_field: str) -> str | None:
    if not isinstance(record, dict):
        return "record is not an object"
    rel = record.get(path_field)
    if not isinstance(rel, str) or not rel_pattern.match(rel):
        return f"bad {path_field!r} {rel!r}"
    if not isinstance(record.get("sha256"), str) or len(record["sha256"]) != 64:
        return "missing sha256"
    if not isinstance(record.get("size"), int) or record["size"] < 0:
        return "missing size"
    return None


def read_index(path: str | Path) -> dict[str, Any]:
    """Parse an index file; a missing file is an empty index.

    Raises :class:`CacheIndexError` when the file does not parse or is not a format-1 index.
    Individual malformed records are kept; :func:`record_problem` reports them.
    """
    path = Path(path)
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return empty_index()
    try:
        data = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CacheIndexError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != INDEX_FORMAT:
        raise CacheIndexError(f"{path}: not a format-{INDEX_FORMAT} cache index")
    if not isinstance(data.get("entries"), dict) or not isinstance(data.get("blobs", {}), dict):
        raise CacheIndexError(f"{path}: 'entries'/'blobs' must be objects")
    data.setdefault("blobs", {})
    return data


def record_problem(directory: Path, record: Any, kind: str = "artifact") -> str | None:
    """Why the file behind an index record is unusable, or ``None`` when it verifies."""
    field, pattern = ("artifact", ARTIFACT_REL) if kind == "artifact" else ("path", BLOB_REL)
    problem = check_record(record, pattern, field)
    if problem:
        return problem
    path = directory / record[field]
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "file is missing"
    if size != record["size"]:
        return f"size {size} bytes, index records {record['size']} (truncated or overwritten)"
    if file_sha256(path) != record["sha256"]:
        return "sha256 mismatch (corrupted)"
    return None
