"""The one atomic-write helper and the one default cache root (framework/core/files.py)."""

import errno
import os
import re
from pathlib import Path

import pytest

from framework.cache.store import default_cache_dir
from framework.core import files, native_build
from models.tiny import default_cache_root as models_root

ROOT = Path(__file__).resolve().parents[3]


def test_atomic_write_keeps_the_old_file_when_the_write_fails(tmp_path):
    path = tmp_path / "d" / "f.json"
    files.atomic_write_text(path, "old")

    def full(tmp):
        Path(tmp).write_text("partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as info:
        files.atomic_write(path, full)
    assert info.value.errno == errno.ENOSPC and files.is_environment_error(info.value)
    assert path.read_text() == "old"
    assert os.listdir(path.parent) == ["f.json"]  # no temp file left


def test_publish_dir_is_one_rename_and_keeps_the_first_publisher(tmp_path):
    final = tmp_path / "model"
    for content, replace, published in (("a", False, True), ("b", False, False), ("c", True, True)):
        tmp = tmp_path / f".tmp-{content}"
        tmp.mkdir()
        (tmp / "x").write_text(content)
        assert files.publish_dir(tmp, final, replace=replace) is published
        assert not tmp.exists()
    assert (final / "x").read_text() == "c"
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_one_default_cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("PIECEWISE_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.delenv("PIECEWISE_MODEL_CACHE", raising=False)
    assert files.default_cache_root() == tmp_path / "c"
    assert default_cache_dir() == tmp_path / "c"
    assert native_build.kernel_dir() == tmp_path / "c" / "kernels"
    assert models_root() == tmp_path / "c" / "models"
    monkeypatch.delenv("PIECEWISE_CACHE_DIR")
    assert files.default_cache_root() == Path("~/.cache/piecewise").expanduser()


def test_no_other_module_renames_files_into_place():
    """Renames into place live in framework/core/files.py only (``cache prune`` renames a key
    folder aside to delete it, which is no write)."""
    allowed = {"framework/core/files.py", "framework/cache/cli.py"}
    pattern = re.compile(r"\bos\.(replace|rename)\(|\.rename\(|\.replace\(tmp")
    offenders = []
    for top in ("framework", "backends", "passes", "models", "experiments"):
        for path in (ROOT / top).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            if rel not in allowed and pattern.search(path.read_text()):
                offenders.append(rel)
    assert offenders == []
    cache_roots = [
        str(p.relative_to(ROOT))
        for top in ("framework", "backends", "models", "experiments")
        for p in (ROOT / top).rglob("*.py")
        if re.search(r"[\"']\.cache[\"']|\.cache/piecewise\"\)", p.read_text())
    ]
    assert cache_roots == ["framework/core/files.py"]
