"""The artifact cache through the whole stack: warm start in a fresh process, corrupted
artifacts and index, several processes starting cold on one directory."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = [[3, 17, 42, 9, 100], [8, 1, 250]]

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time, warnings
    warnings.simplefilter("always")
    from framework import LLM, CompilationConfig
    path, cache, level, barrier, parties = sys.argv[1:6]
    cc = json.loads(sys.argv[6])
    if barrier:   # start together: wait until every party has arrived
        open(os.path.join(barrier, f"ready-{os.getpid()}"), "w").close()
        deadline = time.time() + 300
        while len(os.listdir(barrier)) < int(parties):
            assert time.time() < deadline, "barrier: the other processes never arrived"
            time.sleep(0.01)
    enter = time.time()
    with warnings.catch_warnings(record=True) as caught:
        llm = LLM(path, optimization_level=int(level), cache_dir=cache, max_num_seqs=2,
                  max_model_len=64,
                  compilation_config=CompilationConfig(progress_bar=False, **cc))
    leave = time.time()
    out = llm.generate(%r, 8, ignore_eos=True)
    s = llm.stats
    print("RESULT" + json.dumps({"out": out, "compiles": s["compile_compiles"],
        "loads": s["compile_loads"], "traces": s["dynamo_traces"],
        "pieces": s["compile_num_pieces"], "unique": s["compile_unique_graphs"],
        "shared": s["compile_shared"], "enter": enter, "leave": leave,
        "warnings": [str(w.message) for w in caught]}))
"""
    % (PROMPTS,)
)


def run_job(path, cache, level=1, background=False, barrier=None, parties=0, cc=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-c",
        SCRIPT,
        str(path),
        str(cache),
        str(level),
        str(barrier or ""),
        str(parties),
        json.dumps(cc or {}),
    ]
    if background:
        return subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    return parse(proc.returncode, proc.stdout, proc.stderr)


def parse(rc, stdout, stderr):
    assert rc == 0, stderr[-3000:]
    line = next(l for l in stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


@pytest.fixture(scope="module")
def reference(llama_checkpoint):
    from framework import LLM

    llm = LLM(str(llama_checkpoint), optimization_level=0, max_num_seqs=2, max_model_len=64)
    return llm.generate(PROMPTS, 8, ignore_eos=True)


@pytest.fixture(scope="module")
def cold_start(llama_checkpoint, tmp_path_factory):
    """``(cache, result)``: one cold start in a fresh process into an empty cache.  The tests
    that start from its artifacts work on a copy (:func:`copy_of`)."""
    cache = tmp_path_factory.mktemp("cold-cache")
    return cache, run_job(llama_checkpoint, cache)


def copy_of(cache: Path, dst: Path) -> Path:
    shutil.copytree(cache, dst)
    return dst


def artifacts(cache):
    return sorted(Path(cache).glob("*/rank_0/*/artifacts/*"))


def test_warm_start_in_fresh_process_loads_everything(
    llama_checkpoint, reference, cold_start, tmp_path
):
    cold_cache, cold = cold_start
    assert cold["out"] == reference
    assert cold["compiles"] > 0 and cold["traces"] == 1
    warm = run_job(llama_checkpoint, copy_of(cold_cache, tmp_path / "cache"))
    assert warm["out"] == reference
    assert warm["compiles"] == 0
    assert warm["loads"] == cold["compiles"]
    assert warm["traces"] == 0, "warm start should rebuild the program without Dynamo"


def test_corrupt_artifact_and_index_are_recompiled(
    llama_checkpoint, reference, cold_start, tmp_path
):
    cold_cache, cold = cold_start
    cache = copy_of(cold_cache, tmp_path / "cache")
    victim = artifacts(cache)[0]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    warm = run_job(llama_checkpoint, cache)
    assert warm["out"] == reference
    assert warm["compiles"] >= 1
    assert any(victim.name in w for w in warm["warnings"]), warm["warnings"]
    index = next(cache.glob("*/rank_0/*/index.json"))
    index.write_text("{ not json")
    again = run_job(llama_checkpoint, cache)
    assert again["out"] == reference
    assert any("index.json" in w for w in again["warnings"]), again["warnings"]
    assert cold["pieces"] == again["pieces"]


def test_concurrent_cold_starts_share_one_artifact_set(llama_checkpoint, reference, tmp_path):
    barrier, cache = tmp_path / "barrier", tmp_path / "cache"
    barrier.mkdir()
    procs = [
        run_job(llama_checkpoint, cache, background=True, barrier=barrier, parties=3)
        for _ in range(3)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        results.append(parse(p.returncode, out, err))
    # the three were inside LLM(...) at the same time (else this tests nothing)
    assert max(r["enter"] for r in results) < min(r["leave"] for r in results), results
    assert all(r["out"] == reference for r in results)
    assert sum(r["compiles"] for r in results) == max(r["compiles"] for r in results), (
        "exactly one process should compile; the others load"
    )
    from framework.cache.store import read_index

    index_files = list(cache.glob("*/rank_0/*/index.json"))
    assert len(index_files) == 1
    index = read_index(index_files[0])
    referenced = {e["artifact"] for e in index["entries"].values()}
    on_disk = {str(p.relative_to(index_files[0].parent)) for p in artifacts(cache)}
    assert referenced == on_disk
    assert not list(cache.rglob("*.tmp*"))


def test_eight_layers_compile_three_pieces_and_share_six(tmp_path):
    """9 pieces (8 attention splits): first, middle and last are distinct graphs, the six
    other middle pieces are identical and share the middle artifact; the warm start in a
    fresh process loads the 3 artifacts and compiles nothing."""
    from checkpoints import build_family_checkpoint

    model = build_family_checkpoint(tmp_path / "eight", "llama", num_hidden_layers=8)
    cc = {"compile_sizes": []}  # one token range: one compile per distinct graph
    cold = run_job(model, tmp_path / "cache", cc=cc)
    assert (cold["pieces"], cold["unique"], cold["shared"]) == (9, 3, 6), cold
    assert cold["compiles"] == 3 and cold["loads"] == 0
    warm = run_job(model, tmp_path / "cache", cc=cc)
    assert (warm["compiles"], warm["loads"], warm["traces"]) == (0, 3, 0), warm
    assert warm["out"] == cold["out"]
    assert len(artifacts(tmp_path / "cache")) == 3


def test_artifact_that_verifies_but_fails_to_load_is_replaced(
    llama_checkpoint, reference, tmp_path, monkeypatch
):
    from backends.piecewise.compiler import InductorStandalone
    from framework import LLM, CompilationConfig

    def build():
        return LLM(
            str(llama_checkpoint),
            optimization_level=1,
            cache_dir=str(tmp_path),
            max_num_seqs=2,
            max_model_len=64,
            compilation_config=CompilationConfig(progress_bar=False),
        )

    build()

    def broken_load(self, path):
        raise RuntimeError("simulated loader failure")

    monkeypatch.setattr(InductorStandalone, "load", broken_load)
    with pytest.warns(UserWarning, match="failed to load"):
        llm = build()
    assert llm.generate(PROMPTS, 8, ignore_eos=True) == reference
    assert llm.stats["compile_compiles"] > 0
    monkeypatch.undo()
    assert set(artifacts(tmp_path)), "the recompiled artifacts are stored again"
    again = build()
    assert again.stats["compile_compiles"] == 0 and again.stats["compile_loads"] > 0
