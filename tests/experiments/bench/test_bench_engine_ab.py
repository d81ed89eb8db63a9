"""In-engine A/B of an engine internal (experiments/bench/engine_ab.py), on the test
checkpoint: both forms run, time decode calls only, produce the same tokens, and the engine
is left as it was."""

from __future__ import annotations

import json

import pytest

from experiments.bench import engine_ab
from framework.core import huge_pages as hp

ARGS = ["--dtype", "float32", "--batch", "1", "2", "--steps", "3", "--rounds", "2"]
ARGS += ["--prompt-len", "8"]


def _rows(llama_checkpoint, compile_cache_dir, ab: str) -> list[dict]:
    return engine_ab.main(
        ["--ab", ab, "--model-dir", str(llama_checkpoint), "--cache-dir", compile_cache_dir] + ARGS
    )


def test_split_calls_times_each_decode_forward_of_both_graphs(
    llama_checkpoint, compile_cache_dir, capsys
):
    from backends.piecewise import backend

    inline = backend.inline_splitting_ops
    rows = _rows(llama_checkpoint, compile_cache_dir, "split_calls")
    assert [(r["batch"], r["form"]) for r in rows] == [
        (1, "submodules"),
        (1, "inlined"),
        (2, "submodules"),
        (2, "inlined"),
    ]
    for r in rows:
        # 3 + 8 new tokens after a 2-token warm-up: 10 decode steps a generation, 2 rounds;
        # the prefill's forward is not among them
        assert r["calls"] == 2 * 10, r
        assert r["same_tokens"] and r["median_us"] > 0
    assert rows[0]["ratio"] == 1.0
    assert "| b2 | inlined |" in capsys.readouterr().out
    assert backend.inline_splitting_ops is inline  # the build-time switch is undone


def test_kv_pages_times_each_decode_attention_call(llama_checkpoint, compile_cache_dir):
    if hp.thp_mode() not in ("madvise", "always"):
        pytest.skip(f"transparent huge pages are {hp.thp_mode()}")
    from backends.attention import cpu_paged

    attention = cpu_paged.paged_attention
    layers = json.loads((llama_checkpoint / "config.json").read_text())["num_hidden_layers"]
    rows = _rows(llama_checkpoint, compile_cache_dir, "kv_pages")
    assert [r["form"] for r in rows[:2]] == ["4 KB pages", "2 MB pages"]
    for r in rows:
        assert r["calls"] == 2 * 10 * layers, r  # one call per layer and decode step
        assert r["same_tokens"]
    assert cpu_paged.paged_attention is attention


def _spy_libraries(seen: list):
    """Wrap ``cpu_paged.paged_attention`` to record the ``library`` of each call (None: the
    op); returns the original."""
    from backends.attention import cpu_paged

    original = cpu_paged.paged_attention

    def spy(*args, library=None, **kwargs):
        seen.append(library)
        return original(*args, library=library, **kwargs)

    cpu_paged.paged_attention = spy
    return original


def test_attention_rev_swaps_the_kernel_build_the_backend_calls(
    llama_checkpoint, compile_cache_dir, tmp_path
):
    """A baseline source whose scale is 1% off: the two forms call different builds through
    ctypes (other tokens are possible, other timings certain), every decode attention call is
    timed, and the backend calls the op again afterwards."""
    from backends.attention import cpu_paged
    from backends.attention.cpu_paged_build import LIBRARY

    marker = "hq, hkv, d, scale, window};"
    other = tmp_path / "cpu_paged_attention.cpp"
    other.write_text(
        LIBRARY.source.read_text().replace(marker, "hq, hkv, d, scale * 1.01f, window};")
    )
    forward = cpu_paged.CpuPagedAttention.__dict__["forward"]
    seen: list = []
    original = _spy_libraries(seen)
    try:
        rows = engine_ab.main(
            ["--ab", "attention_rev", "--baseline", str(other), "--model-dir",
             str(llama_checkpoint), "--cache-dir", compile_cache_dir] + ARGS
        )  # fmt: skip
    finally:
        cpu_paged.paged_attention = original
    layers = json.loads((llama_checkpoint / "config.json").read_text())["num_hidden_layers"]
    assert [r["form"] for r in rows[:2]] == [f"baseline {other}", "current"]
    for r in rows:
        assert r["calls"] == 2 * 10 * layers, r
    builds = {id(lib) for lib in seen if lib is not None}  # (None: the engine's warm-up)
    assert len(builds) == 2  # both builds ran, through ctypes
    assert LIBRARY.load(None) in seen
    assert cpu_paged.CpuPagedAttention.__dict__["forward"] is forward


def test_attention_call_times_the_python_body_against_the_cpp_kernel(
    llama_checkpoint, compile_cache_dir
):
    """Both forms run every decode attention call (the ctypes build, then the op), with the
    same tokens: the glue changes, never the kernel's bits."""
    from backends.attention import cpu_paged
    from backends.attention.cpu_paged_build import LIBRARY, load_op

    if not load_op():
        pytest.skip("the op library does not build here")
    forward = cpu_paged.CpuPagedAttention.__dict__["forward"]
    seen: list = []
    original = _spy_libraries(seen)
    try:
        rows = _rows(llama_checkpoint, compile_cache_dir, "attention_call")
    finally:
        cpu_paged.paged_attention = original
    layers = json.loads((llama_checkpoint / "config.json").read_text())["num_hidden_layers"]
    assert [r["form"] for r in rows[:2]] == ["Python body, ctypes", "C++ op kernel"]
    for r in rows:
        assert r["calls"] == 2 * 10 * layers, r
        assert r["same_tokens"], r
    assert set(map(id, seen)) == {id(None), id(LIBRARY.load(None))}
    assert cpu_paged.CpuPagedAttention.__dict__["forward"] is forward


def test_greedy_head_times_each_head_and_choice_with_the_same_tokens(
    llama_checkpoint, compile_cache_dir
):
    """bf16: both forms run (the head then the sampler, the fused greedy head), each timing
    every LM head + token choice, with the same tokens; the runner is left fused."""
    from passes import native_ops

    if not native_ops.load():
        pytest.skip("the C++ op library does not build here")
    args = ["--ab", "greedy_head", "--model-dir", str(llama_checkpoint)]
    args += ["--cache-dir", compile_cache_dir] + ARGS
    args[args.index("float32")] = "bfloat16"
    rows = engine_ab.main(args)
    assert [r["form"] for r in rows[:2]] == ["head, then sampler", "greedy head"]
    for r in rows:
        # 11 generated tokens a generation (the prefill's choice included), 2 rounds
        assert r["calls"] == 2 * 11, r
        assert r["same_tokens"] and r["step_ms"] > 0


def test_attention_forms_time_every_call_where_forwards_would_replay(
    llama_checkpoint, compile_cache_dir
):
    """bf16 O2, where a decode forward would replay as one recording and call no Python
    attention: the attention forms run their engine with forward replay off, so every decode
    step's layers are timed (one call each) -- and the engine's forward replay is back on
    only for its own form."""
    layers = json.loads((llama_checkpoint / "config.json").read_text())["num_hidden_layers"]
    args = ["--ab", "attention_call", "--model-dir", str(llama_checkpoint)]
    args += ["--cache-dir", compile_cache_dir, "--dtype", "bfloat16"] + ARGS[2:]
    for r in engine_ab.main(args):
        assert r["calls"] == 2 * 10 * layers, r
        assert r["same_tokens"]
    args[1] = "forward_replay"
    rows = engine_ab.main(args)
    assert [r["form"] for r in rows[:2]] == ["pieces replayed", "forward replayed"]
    assert all(r["same_tokens"] and r["calls"] == 2 * 10 for r in rows)
