"""The cache under a full or read-only disk, and damaged extracted kernels.

A disk's refusal (``ENOSPC``, ``EROFS``) is simulated by monkeypatching the write calls
under the cache directory (:mod:`tests.disk_faults`: tests run as root, so a read-only chmod
would stop nothing).  What must hold: a warm start from a read-only directory loads and
writes nothing; a cold start that cannot write compiles in memory with one warning naming
the directory; a refused write never drops a valid entry (only checksum/format failures
mean corrupt); every temp-file pattern is swept; ``kernels/*.so`` are verified by content,
re-extracted when damaged and checked by ``cache verify``."""

import ctypes
import errno
import io
import os
import shutil
import warnings
from pathlib import Path

import pytest

from framework import LLM, CompilationConfig
from framework.cache.cli import cmd_verify
from framework.cache.store import ArtifactStore, CacheCorruptionWarning, CacheWriteWarning
from framework.core import native_build
from tests.disk_faults import refuse_writes, tree_state

PROMPTS = [[3, 17, 42, 9, 100, 7], [8, 1, 250]]
FACTORS = {"model": "m", "v": 1}


def _writer(data: bytes):
    def write(path):
        Path(path).write_bytes(data)

    return write


def _no_cache_warnings(record):
    return [
        w for w in record if issubclass(w.category, (CacheWriteWarning, CacheCorruptionWarning))
    ]


# ----------------------------------------------------------------------------- the store alone
def test_enospc_while_storing_keeps_the_valid_entries(tmp_path, monkeypatch):
    store = ArtifactStore.open(tmp_path, FACTORS)
    store.store("a", "ga", _writer(b"artifact a"))
    before = store.entries()

    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.warns(CacheWriteWarning, match=f"cannot write to {store.dir}.*No space left"):
        assert store.store("b", "gb", full) is None
    assert store.entries() == before
    assert store.lookup("a") is not None and store.lookup("b") is None
    assert store.stats.corrupt == 0
    assert not [p for p in store.dir.rglob("*") if p.name.startswith(".tmp-")]


def test_store_on_a_read_only_directory(tmp_path, monkeypatch):
    store = ArtifactStore.open(tmp_path, FACTORS)
    store.store("a", "ga", _writer(b"artifact a"))
    store.store_blob("program", b"graph")
    state = tree_state(tmp_path)
    refuse_writes(monkeypatch, tmp_path, errno.EROFS)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ro = ArtifactStore.open(tmp_path, FACTORS)
        assert ro.lookup("a") == store.dir / "artifacts" / "ga.bin"
        assert ro.load_blob("program") == b"graph"
        with ro.lock():
            assert ro.lookup("a") is not None
    assert not _no_cache_warnings(record)  # a warm read-only start is silent
    with pytest.warns(CacheWriteWarning, match="Read-only file system"):
        assert ro.store("b", "gb", _writer(b"b")) is None
    assert ro.store_blob("other", b"x") is None
    monkeypatch.undo()
    assert tree_state(tmp_path) == state


def test_empty_read_only_directory_opens(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    root.mkdir()
    refuse_writes(monkeypatch, root, errno.EROFS)
    with pytest.warns(CacheWriteWarning, match=str(root)):
        store = ArtifactStore.open(root, FACTORS)
    assert store.lookup("a") is None and store.store("a", "g", _writer(b"x")) is None


def test_every_temp_pattern_of_a_dead_writer_is_swept(tmp_path):
    store = ArtifactStore.open(tmp_path, FACTORS)
    kernels = store.dir / "kernels"
    kernels.mkdir()
    dead = 2**22 + 12345  # above the default pid_max: no such process
    stale = [
        kernels / f".k{'0' * 32}.so.{dead}.tmp",  # an extraction's temp (earlier versions)
        kernels / f".tmp-k{'0' * 32}.so-{dead}-0badf00d",
        store.key_dir / f".tmp-factors.json-{dead}-0badf00d",
        store.dir / f".tmp-index.json-{dead}-0badf00d",
    ]
    live = kernels / f".tmp-kx.so-{os.getpid()}-0badf00d"  # a writer of this process
    for p in [*stale, live]:
        p.write_bytes(b"partial")
    ArtifactStore.open(tmp_path, FACTORS)
    assert [p for p in stale if p.exists()] == []
    assert live.exists()


# ----------------------------------------------------------------------------- end to end
def _build(path, cache, level=1):
    return LLM(
        str(path),
        optimization_level=level,
        cache_dir=str(cache),
        max_num_seqs=2,
        max_model_len=64,
        compilation_config=CompilationConfig(progress_bar=False),
    )


@pytest.fixture(scope="module")
def reference(llama_checkpoint):
    llm = LLM(str(llama_checkpoint), optimization_level=0, max_num_seqs=2, max_model_len=64)
    return llm.generate(PROMPTS, 6, ignore_eos=True)


@pytest.fixture(scope="module")
def warm_cache(llama_checkpoint, tmp_path_factory, reference):
    cache = tmp_path_factory.mktemp("warm") / "cache"
    llm = _build(llama_checkpoint, cache)
    assert llm.generate(PROMPTS, 6, ignore_eos=True) == reference
    _build(llama_checkpoint, cache)  # a warm start extracts the kernels
    assert list(cache.rglob("kernels/k*.so")), "the tiny model has lean kernels to extract"
    return cache


def _copy(warm_cache, tmp_path) -> Path:
    cache = tmp_path / "cache"
    shutil.copytree(warm_cache, cache)
    return cache


def test_warm_start_from_a_read_only_directory_loads_and_writes_nothing(
    llama_checkpoint, warm_cache, reference, tmp_path, monkeypatch
):
    cache = _copy(warm_cache, tmp_path)
    state = tree_state(cache)
    refused = refuse_writes(monkeypatch, cache, errno.EROFS)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        llm = _build(llama_checkpoint, cache)
        assert llm.generate(PROMPTS, 6, ignore_eos=True) == reference
    assert not _no_cache_warnings(record)
    assert llm.stats["compile_compiles"] == 0 and llm.stats["compile_loads"] > 0
    monkeypatch.undo()
    assert tree_state(cache) == state
    assert refused, "the simulation saw the start try the disk (the lock file)"


def test_cold_start_on_a_read_only_directory_compiles_in_memory(
    llama_checkpoint, reference, tmp_path, monkeypatch
):
    cache = tmp_path / "cache"
    cache.mkdir()
    refuse_writes(monkeypatch, cache, errno.EROFS)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        llm = _build(llama_checkpoint, cache)
        assert llm.generate(PROMPTS, 6, ignore_eos=True) == reference
    got = _no_cache_warnings(record)
    assert len(got) == 1 and got[0].category is CacheWriteWarning, [str(w.message) for w in got]
    assert str(cache) in str(got[0].message) and "Read-only file system" in str(got[0].message)
    assert llm.stats["compile_compiles"] > 0
    monkeypatch.undo()
    assert list(cache.rglob("*.bin")) == []


def test_enospc_on_a_warm_start_never_drops_a_valid_entry(
    llama_checkpoint, warm_cache, reference, tmp_path, monkeypatch
):
    cache = _copy(warm_cache, tmp_path)
    for kernels in cache.rglob("kernels"):
        shutil.rmtree(kernels)  # the start must extract them again: a write
    indexes = {p: p.read_bytes() for p in cache.rglob("index.json")}
    artifacts = tree_state(cache)
    refuse_writes(monkeypatch, cache, errno.ENOSPC)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        llm = _build(llama_checkpoint, cache)
        assert llm.generate(PROMPTS, 6, ignore_eos=True) == reference
    got = _no_cache_warnings(record)
    assert [w.category for w in got] == [CacheWriteWarning], [str(w.message) for w in got]
    assert "No space left" in str(got[0].message)
    monkeypatch.undo()
    assert {p: p.read_bytes() for p in cache.rglob("index.json")} == indexes
    assert tree_state(cache) == artifacts
    again = _build(llama_checkpoint, cache)  # space again: everything still loads
    assert again.stats["compile_compiles"] == 0 and again.stats["compile_loads"] > 0


def test_a_damaged_extracted_kernel_is_reported_and_re_extracted(
    llama_checkpoint, warm_cache, reference, tmp_path
):
    cache = _copy(warm_cache, tmp_path)
    kernel = sorted(cache.rglob("kernels/k*.so"))[0]
    good = kernel.read_bytes()
    kernel.write_bytes(os.urandom(len(good)))
    out = io.StringIO()
    assert cmd_verify(cache, out) == 1
    assert f"BAD {kernel}: extracted kernel" in out.getvalue()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        llm = _build(llama_checkpoint, cache)
        assert llm.generate(PROMPTS, 6, ignore_eos=True) == reference
    assert not _no_cache_warnings(record)  # the artifact was fine: nothing dropped
    assert llm.stats["compile_compiles"] == 0
    assert kernel.read_bytes() == good
    assert cmd_verify(cache, io.StringIO()) == 0


# ----------------------------------------------------------------------------- native kernels
def test_native_kernel_cache_that_cannot_be_written_builds_privately(tmp_path, monkeypatch):
    if native_build.compiler() is None:
        pytest.skip("no C++ compiler")
    src = tmp_path / "three.cpp"
    src.write_text('extern "C" int three() { return 3; }\n')
    root = tmp_path / "cache"
    root.mkdir()
    monkeypatch.setenv("PIECEWISE_CACHE_DIR", str(root))
    lib = native_build.NativeLibrary(
        "three", src, portable_env="PIECEWISE_TEST_PORTABLE", declare=lambda lib: None
    )
    refuse_writes(monkeypatch, root, errno.EROFS)
    with pytest.warns(UserWarning, match=f"cannot write the native kernel cache {root}"):
        path = lib.library_path(portable=True)
    assert not str(path).startswith(str(root))
    assert ctypes.CDLL(str(path)).three() == 3


def test_factor_memo_on_a_read_only_directory_computes_without_writing(tmp_path, monkeypatch):
    import sys

    from framework.cache import factor_memo

    value = {"cpp_compiler": "g++ stub", "inductor": {"x": 1}}
    monkeypatch.setattr(factor_memo, "_cpp_compiler_identity", lambda: value["cpp_compiler"])
    monkeypatch.setattr(factor_memo, "inductor_factors", lambda: value["inductor"])
    monkeypatch.delitem(sys.modules, "torch._inductor", raising=False)  # the memoized path
    root = tmp_path / "cache"
    root.mkdir()
    refused = refuse_writes(monkeypatch, root, errno.EROFS)
    assert factor_memo.inductor_side_factors(root) == value
    assert refused  # it tried, was refused, and went on
    monkeypatch.undo()
    assert list(root.iterdir()) == []
