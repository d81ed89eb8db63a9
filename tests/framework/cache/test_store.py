"""ArtifactStore: layout, atomic writes, dedup, corruption handling, blobs, concurrent writers."""

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from framework.cache.store import (
    ArtifactStore,
    CacheCorruptionWarning,
    compute_cache_key,
    record_problem,
)

FACTORS = {"env": {"torch": "x"}, "compilation_config": "abc", "dtype": "float32"}
ROOT_DIR = Path(__file__).resolve().parents[3]


def _writer(data: bytes, calls: list | None = None):
    def write(path: Path) -> None:
        if calls is not None:
            calls.append(path)
        path.write_bytes(data)

    return write


@pytest.fixture
def store(tmp_path):
    return ArtifactStore.open(tmp_path / "cache", FACTORS, rank=1, model_tag="tiny")


def _files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def test_layout_index_and_factors(store, tmp_path):
    key, normalized = compute_cache_key(FACTORS)
    path = store.store("range_1_512/piece_0/inductor", "g0", _writer(b"artifact-0"))
    model_dir = tmp_path / "cache" / key / "rank_1" / "tiny"
    assert path == model_dir / "artifacts" / "g0.bin"
    assert path.read_bytes() == b"artifact-0"
    assert json.loads((tmp_path / "cache" / key / "factors.json").read_text()) == normalized
    index = json.loads((model_dir / "index.json").read_text())
    record = index["entries"]["range_1_512/piece_0/inductor"]
    assert record["artifact"] == "artifacts/g0.bin" and record["graph_hash"] == "g0"
    assert record["size"] == len(b"artifact-0") and len(record["sha256"]) == 64
    assert abs(record["created"] - time.time()) < 60
    assert store.lookup("range_1_512/piece_0/inductor") == path
    assert store.lookup("range_1_512/piece_1/inductor") is None
    assert (store.stats.hits, store.stats.misses, store.stats.writes) == (1, 1, 1)


def test_key_must_match_factors(tmp_path):
    with pytest.raises(ValueError, match="not the hash of the given factors"):
        ArtifactStore(tmp_path, "0123456789abcdef", FACTORS)
    with pytest.raises(ValueError, match="model_tag"):
        ArtifactStore.open(tmp_path, FACTORS, model_tag="../evil")


def test_failing_write_leaves_no_partial_file_and_no_entry(store):
    def write(path: Path) -> None:
        path.write_bytes(b"half an artif")
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError, match="compiler crashed"):
        store.store("e", "g0", write)
    assert _files(store.dir / "artifacts") == []
    assert store.entries() == {}
    assert store.lookup("e") is None


def test_write_that_creates_no_file_is_a_clear_error(store):
    with pytest.raises(RuntimeError, match="did not create a file"):
        store.store("e", "g0", lambda path: path.mkdir())
    assert _files(store.dir / "artifacts") == [] and store.entries() == {}


def test_identical_pieces_share_one_artifact(store):
    calls = []
    for piece in range(3):
        store.store(f"range_1_8/piece_{piece}/inductor", "same", _writer(b"A", calls))
    store.store("range_1_8/piece_3/inductor", "other", _writer(b"B", calls))
    assert len(calls) == 2
    assert _files(store.dir / "artifacts") == ["other.bin", "same.bin"]
    assert store.stats.dedup_reuses == 2 and store.stats.writes == 2
    assert {r["artifact"] for r in store.entries().values()} == {
        "artifacts/same.bin",
        "artifacts/other.bin",
    }


def test_lookup_with_graph_hash_links_identical_pieces_without_compiling(store):
    path = store.store("range_1_8/piece_0/inductor", "g", _writer(b"A"))
    assert store.lookup("range_1_8/piece_1/inductor", "g") == path
    assert set(store.entries()) == {"range_1_8/piece_0/inductor", "range_1_8/piece_1/inductor"}
    assert store.lookup("range_1_8/piece_2/inductor", "h") is None
    # an entry recorded for another graph does not count
    assert store.lookup("range_1_8/piece_0/inductor", "h") is None
    assert (store.stats.hits, store.stats.misses, store.stats.dedup_reuses) == (1, 2, 1)
    assert _files(store.dir / "artifacts") == ["g.bin"]


def test_link_points_an_entry_at_a_stored_artifact_and_never_writes(store):
    path = store.store("range_1_8/piece_0/inductor", "g", _writer(b"A"))
    assert store.link("range_1_8/piece_1/inductor", "g") == path
    assert store.entries()["range_1_8/piece_1/inductor"]["artifact"] == "artifacts/g.bin"
    assert store.link("range_1_8/piece_2/inductor", "nothing_stored") is None
    assert "range_1_8/piece_2/inductor" not in store.entries()
    assert (store.stats.writes, store.stats.dedup_reuses) == (1, 1)
    path.write_bytes(b"corrupt")  # a corrupt artifact is dropped, not linked
    with pytest.warns(CacheCorruptionWarning):
        assert store.link("range_1_8/piece_3/inductor", "g") is None
    assert store.entries() == {}


def test_restoring_an_entry_with_a_new_graph_drops_the_orphan(store):
    store.store("e", "old", _writer(b"1"))
    store.store("e", "new", _writer(b"2"))
    assert _files(store.dir / "artifacts") == ["new.bin"]
    assert store.lookup("e").read_bytes() == b"2"


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_artifact_warns_by_name_and_recompiles(store, damage):
    path = store.store("piece_0", "g", _writer(b"0123456789"))
    store.store("piece_1", "g", _writer(b"0123456789"))  # shares the file
    assert store.lookup("piece_0") == path  # verified (and memoized) before the damage
    if damage == "truncate":
        path.write_bytes(b"01234")
    elif damage == "flip":
        path.write_bytes(b"0123456780")
    else:
        path.unlink()
    with pytest.warns(CacheCorruptionWarning, match=str(path)):
        assert store.lookup("piece_0") is None
    assert store.entries() == {}  # the sharing entry is bad too
    assert not path.exists()
    assert store.stats.corrupt == 1
    # the caller recompiles; the store accepts the new artifact
    calls = []
    store.store("piece_0", "g", _writer(b"0123456789", calls))
    assert calls and store.lookup("piece_0").read_bytes() == b"0123456789"


@pytest.mark.parametrize("garbage", [b"{not json", b"\xff\xfe", b'{"format": 1}', b"[]", b""])
def test_garbage_index_warns_by_name_and_recompiles(store, garbage):
    store.store("e", "g", _writer(b"x"))
    store.index_path.write_bytes(garbage)
    with pytest.warns(CacheCorruptionWarning, match=str(store.index_path)):
        assert store.lookup("e") is None
    assert _files(store.dir / "artifacts") == []
    store.store("e", "g", _writer(b"x"))
    assert store.lookup("e").read_bytes() == b"x"


def test_discard_drops_an_entry_that_would_not_load(store):
    path = store.store("e", "g", _writer(b"x"))
    store.store("e2", "g", _writer(b"x"))
    with pytest.warns(CacheCorruptionWarning, match=f"{path}.*load failed: boom"):
        store.discard("e", "load failed: boom")
    assert store.entries() == {} and not path.exists()
    store.discard("never-stored", "no-op")


def test_malformed_record_never_touches_files_outside(store, tmp_path):
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me")
    index = {
        "format": 1,
        "blobs": {},
        "entries": {"e": {"artifact": "../../../../precious.txt", "sha256": "0" * 64, "size": 7}},
    }
    store.index_path.write_text(json.dumps(index))
    with pytest.warns(CacheCorruptionWarning, match="bad 'artifact'"):
        assert store.lookup("e") is None
    assert outside.read_text() == "keep me"
    assert store.entries() == {}


def test_blobs_roundtrip_and_corruption(store):
    assert store.load_blob("traced_program") is None
    path = store.store_blob("traced_program", b"serialized graph")
    assert store.load_blob("traced_program") == b"serialized graph"
    path.write_bytes(b"serialized grap")
    with pytest.warns(CacheCorruptionWarning, match=str(path)):
        assert store.load_blob("traced_program") is None
    assert not path.exists()
    assert store.load_blob("traced_program") is None
    assert (store.stats.blob_hits, store.stats.blob_misses, store.stats.corrupt) == (1, 3, 1)
    with pytest.raises(ValueError, match="plain file name"):
        store.store_blob("../x", b"")


def test_lock_is_reentrant_and_shared_by_stores_on_one_dir(store, tmp_path):
    twin = ArtifactStore.open(tmp_path / "cache", FACTORS, rank=1, model_tag="tiny")
    with store.lock():
        # two independent flocks on one file would block here: fail (Timeout) instead of hanging
        twin.lock().acquire(timeout=5)
        twin.store("e", "g", _writer(b"x"))
        twin.lock().release()
        assert store.lookup("e") is not None
    # another thread must wait for the holder
    order = []
    with store.lock():
        t = threading.Thread(
            target=lambda: (twin.lock().acquire(), order.append("thread"), twin.lock().release())
        )
        t.start()
        time.sleep(0.2)
        order.append("main")
    t.join(5)
    assert order == ["main", "thread"]


def test_stale_temp_files_of_dead_writers_are_swept(store):
    store.store("e", "g", _writer(b"x"))
    stale = store.dir / "artifacts" / ".tmp-g2.bin-99999-dead"
    stale.write_bytes(b"partial")
    store.store("e2", "g2", _writer(b"y"))
    assert _files(store.dir / "artifacts") == ["g.bin", "g2.bin"]


_CONCURRENT_WORKER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from framework.cache.store import ArtifactStore
    root, factors, start, outer_lock, report = sys.argv[1:6]
    store = ArtifactStore.open(root, json.loads(factors))
    compiled, written = [], []
    def compile_piece(graph_hash):
        time.sleep(0.1)  # a slow compile: the other processes arrive meanwhile
        compiled.append(graph_hash)
        return graph_hash.encode() * 1000
    def saver(graph_hash, artifact):
        def write(path):
            with open(path, "wb") as f:
                f.write(artifact)
                f.flush()
                time.sleep(0.05)  # a slow save: a reader must never see it half-written
                f.write(b"end")
            written.append(graph_hash)
        return write
    while time.time() < float(start):
        time.sleep(0.005)
    loaded = {}
    for piece in range(6):
        entry, graph_hash = f"range_1_64/piece_{piece}/inductor", f"g{piece % 3}"
        if outer_lock == "1":  # the intended use: compile inside the lock
            with store.lock():
                path = store.lookup(entry, graph_hash) or store.store(
                    entry, graph_hash, saver(graph_hash, compile_piece(graph_hash)))
        else:  # no outer lock: everyone compiles, store() still dedups the writes
            path = store.lookup(entry, graph_hash) or store.store(
                entry, graph_hash, saver(graph_hash, compile_piece(graph_hash)))
        loaded[entry] = Path(path).read_bytes() == graph_hash.encode() * 1000 + b"end"
    Path(report).write_text(json.dumps(
        {"compiled": compiled, "written": written, "loaded": loaded}))
""")


@pytest.mark.parametrize("outer_lock", [True, False], ids=["compile_in_lock", "store_only"])
def test_three_concurrent_cold_processes_end_with_one_complete_set(tmp_path, outer_lock):
    root = tmp_path / "cache"
    start = time.time() + 1.0  # all three begin together, after their imports
    env = dict(os.environ, PYTHONPATH=str(ROOT_DIR))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _CONCURRENT_WORKER,
                str(root),
                json.dumps(FACTORS),
                str(start),
                "1" if outer_lock else "0",
                str(tmp_path / f"report{i}.json"),
            ],
            cwd=ROOT_DIR,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    reports = [json.loads((tmp_path / f"report{i}.json").read_text()) for i in range(3)]
    assert all(all(r["loaded"].values()) and len(r["loaded"]) == 6 for r in reports)
    store = ArtifactStore.open(root, FACTORS)
    entries = store.entries()
    assert sorted(entries) == [f"range_1_64/piece_{i}/inductor" for i in range(6)]
    for record in entries.values():
        assert record_problem(store.dir, record) is None
    assert _files(store.dir) == [
        ".lock",
        "artifacts/g0.bin",
        "artifacts/g1.bin",
        "artifacts/g2.bin",
        "index.json",
    ]
    assert sum(len(r["written"]) for r in reports) == 3  # one artifact write per graph
    compiles = sum(len(r["compiled"]) for r in reports)
    if outer_lock:
        assert compiles == 3  # every graph compiled exactly once across the three processes
    else:
        assert compiles >= 3


def test_inductor_standalone_artifact_roundtrip(tmp_path):
    """The backend's real use: save a standalone_compile artifact through the store, load it."""
    import torch

    def f(x):
        return torch.relu(x) * 2 + 1

    gm = torch.fx.symbolic_trace(f)
    x = torch.randn(4, 8)
    store = ArtifactStore.open(tmp_path, FACTORS)
    with store.lock():
        assert store.lookup("e", "g") is None
        compiled = torch._inductor.standalone_compile(gm, [x], dynamic_shapes="from_example_inputs")
        path = store.store("e", "g", lambda tmp: compiled.save(path=str(tmp), format="binary"))
    assert store.lookup("e", "g") == path
    loaded = torch._inductor.CompiledArtifact.load(path=str(path), format="binary")
    torch.testing.assert_close(loaded(x)[0], f(x))
