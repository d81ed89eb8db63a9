"""`python -m framework.cache ls|verify|prune|explain` on a populated temp cache."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from filelock import FileLock

from framework.cache.cli import main, parse_duration, parse_size
from framework.cache.store import ArtifactStore

ROOT_DIR = Path(__file__).resolve().parents[3]
OLD = {
    "env": {"torch": "2.13.0", "python": "3.11"},
    "source": {"models/llama.py": "aaa"},
    "dtype": "float32",
}
NEW = {
    "env": {"torch": "2.14.0", "python": "3.11"},
    "source": {"models/llama.py": "bbb"},
    "dtype": "float32",
}


def _write(data: bytes):
    return lambda path: path.write_bytes(data)


def _age(path: Path, seconds: float) -> None:
    """Backdate every file and directory under ``path`` (as if last used ``seconds`` ago)."""
    t = time.time() - seconds
    for p in [path, *path.rglob("*")]:
        os.utime(p, (t, t))


@pytest.fixture
def cache(tmp_path):
    root = tmp_path / "cache"
    old = ArtifactStore.open(root, OLD)
    old.store("range_1_512/piece_0/inductor", "g0", _write(b"x" * 4000))
    old.store("range_1_512/piece_1/inductor", "g0", _write(b"x" * 4000))  # shared artifact
    old.store("range_1_512/piece_2/inductor", "g1", _write(b"y" * 4000))
    new = ArtifactStore.open(root, NEW, rank=1, model_tag="draft")
    new.store("range_1_512/piece_0/inductor", "g0", _write(b"z" * 100))
    new.store_blob("traced_program", b"program")
    _age(old.key_dir, 10 * 86400)
    return root, old, new


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_ls_lists_keys_with_counts_sizes_and_ages(cache, capsys):
    root, old, new = cache
    code, out = run(capsys, "ls", root)
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:3]}
    # KEY RANK MODEL ENTRIES ARTIFACTS BLOBS SIZE(2 words) AGE
    assert rows[old.key][1:6] == ["0", "model", "3", "2", "0"]
    assert rows[new.key][1:6] == ["1", "draft", "1", "1", "1"]
    assert rows[old.key][-1] == "10.0d"
    assert out.splitlines()[1].startswith(new.key)  # most recently used first
    assert "2 key(s)" in out


def test_module_entry_point_runs_as_python_dash_m(cache):
    root, old, _ = cache
    proc = subprocess.run(
        [sys.executable, "-m", "framework.cache", "ls", str(root)],
        cwd=ROOT_DIR,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert old.key in proc.stdout


def test_default_dir_comes_from_the_environment(cache, capsys, monkeypatch):
    root, old, _ = cache
    monkeypatch.setenv("PIECEWISE_CACHE_DIR", str(root))
    code, out = run(capsys, "ls")
    assert code == 0 and old.key in out


def test_missing_dir_is_a_clear_error(tmp_path, capsys):
    code, out = run(capsys, "verify", tmp_path / "nope")
    assert code == 2 and "does not exist" in out and "nope" in out


def test_verify_passes_then_names_every_bad_file(cache, capsys):
    root, old, new = cache
    code, out = run(capsys, "verify", root)
    assert code == 0 and out.startswith("OK:")
    artifact = old.dir / "artifacts" / "g1.bin"
    artifact.write_bytes(b"y" * 10)
    (new.dir / "index.json").write_text("{garbage")
    code, out = run(capsys, "verify", root)
    assert code == 1
    assert f"BAD {artifact}:" in out and "truncated" in out
    assert f"BAD {new.dir / 'index.json'}:" in out
    assert "FAILED" in out and "2 bad" in out


def test_verify_flags_factors_that_do_not_match_their_key(cache, capsys):
    root, old, _ = cache
    (old.key_dir / "factors.json").write_text(json.dumps({"tampered": True}))
    code, out = run(capsys, "verify", root)
    assert code == 1 and "do not hash to key" in out


def test_prune_by_age_removes_only_old_keys(cache, capsys):
    root, old, new = cache
    code, out = run(capsys, "prune", root, "--older-than", "7d", "--dry-run")
    assert code == 0 and f"would remove {old.key}" in out and old.key_dir.exists()
    code, out = run(capsys, "prune", root, "--older-than", "7d")
    assert code == 0 and f"removed {old.key}" in out
    assert not old.key_dir.exists() and new.key_dir.exists()
    assert [p.name for p in root.iterdir()] == [new.key]


def test_prune_by_size_removes_least_recently_used_first(cache, capsys):
    root, old, new = cache
    code, out = run(capsys, "prune", root, "--max-size", "2K")
    assert code == 0
    assert not old.key_dir.exists() and new.key_dir.exists()
    code, out = run(capsys, "prune", root, "--max-size", "0")
    assert not new.key_dir.exists() and "removed 1 key(s)" in out


def test_store_recovers_when_its_key_was_pruned_while_open(cache, capsys):
    root, old, _ = cache
    assert run(capsys, "prune", root, "--older-than", "7d")[0] == 0
    with old.lock():
        old.store("range_1_512/piece_0/inductor", "g0", _write(b"again"))
    assert old.lookup("range_1_512/piece_0/inductor").read_bytes() == b"again"
    assert run(capsys, "verify", root)[0] == 0


def test_prune_skips_a_key_in_use(cache, capsys):
    root, old, _ = cache
    with FileLock(str(old.dir / ".lock")):  # as held by a compiling process
        code, out = run(capsys, "prune", root, "--older-than", "1d")
    assert code == 0 and f"skipped {old.key}: in use" in out
    assert old.key_dir.exists()


def test_prune_needs_a_criterion(cache, capsys):
    code, out = run(capsys, "prune", cache[0])
    assert code == 2 and "--older-than" in out


def test_explain_names_differing_factors_with_both_values(cache, capsys):
    root, old, new = cache
    code, out = run(capsys, "explain", root, old.key, new.key[:6])  # unique prefix works
    assert code == 0
    assert "2 factor(s) differ" in out
    assert 'env.torch:\n    A: "2.13.0"\n    B: "2.14.0"' in out
    assert 'source.models/llama.py:\n    A: "aaa"\n    B: "bbb"' in out
    assert "dtype" not in out and "env.python" not in out
    code, out = run(capsys, "explain", root, old.key, old.key)
    assert code == 0 and "all factors are equal" in out


def test_explain_unknown_key_lists_the_available_ones(cache, capsys):
    root, old, new = cache
    code, out = run(capsys, "explain", root, old.key, "feedface")
    assert code == 2 and "no cache key 'feedface'" in out and old.key in out and new.key in out


def test_size_and_duration_parsing():
    assert parse_size("2G") == 2 << 30 and parse_size("500MiB") == 500 << 20
    assert parse_size("4096") == 4096 and parse_size("1.5K") == 1536
    assert parse_duration("7d") == 7 * 86400 and parse_duration("90m") == 5400
    with pytest.raises(Exception, match="unit"):
        parse_duration("7")
