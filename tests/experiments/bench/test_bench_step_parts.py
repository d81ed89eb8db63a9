"""The profiler-free step accounting (experiments/bench/step_parts.py)."""

from __future__ import annotations

import json
import math

import pytest

from experiments.bench import step_parts


def test_timers_count_calls_and_time_also_on_errors():
    timers = step_parts.Timers()

    def boom():
        raise RuntimeError("x")

    ok = timers.wrap(lambda x: x + 1, "a")
    bad = timers.wrap(boom, "b")
    assert ok(1) == 2 and ok(2) == 3
    with pytest.raises(RuntimeError):
        bad()
    seconds, calls = timers.snapshot()
    assert calls == {"a": 2, "b": 1}
    assert seconds["a"] >= 0 and seconds["b"] >= 0


def test_parts_of_a_real_engine_step(llama_checkpoint, compile_cache_dir, capsys):
    from backends.attention import cpu_paged
    from backends.piecewise import inductor_lean

    attention, named = cpu_paged.paged_attention, inductor_lean.AsyncCompile.cpp_pybinding_named
    layers = json.loads((llama_checkpoint / "config.json").read_text())["num_hidden_layers"]
    rows = step_parts.main(
        ["--model-dir", str(llama_checkpoint), "--dtype", "float32", "--batch", "1", "2"]
        + ["--steps", "3", "--reps", "1", "--prompt-len", "8"]
        + ["--cache-dir", compile_cache_dir]
    )
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        # (per-step ms are differences of two generations: at 3 steps on a machine shared
        # with another test worker they can be anything, even negative; the calls and the
        # totals below are not)
        assert math.isfinite(r["step_ms"])
        # one attention call per layer and step, and the compiled pieces' kernels ran
        assert r["attention"]["calls_per_step"] == layers
        assert r["compiled kernels"]["calls_per_step"] > 0
        assert r["forward"]["calls_per_step"] == 1 and r["LM head"]["calls_per_step"] == 1
        total = r["total_s"]
        inner = total["attention"] + total["compiled kernels"]
        assert 0 < inner < total["forward"]
        assert total["LM head"] > 0 and total["sampler"] > 0
    out = capsys.readouterr().out
    assert "| decode step |" in out and "compiled kernels" in out
    # the instrumentation is gone afterwards
    assert cpu_paged.paged_attention is attention
    assert inductor_lean.AsyncCompile.cpp_pybinding_named is named


def test_a_bf16_step_counts_the_fused_greedy_head_once(llama_checkpoint, compile_cache_dir):
    """bf16: the LM head is the fused greedy kernel (one call a step, its choice read by the
    sampler row); fp32 above: compute_logits, the fused head declining, not counted."""
    rows = step_parts.main(
        ["--model-dir", str(llama_checkpoint), "--dtype", "bfloat16", "--batch", "1"]
        + ["--steps", "3", "--reps", "1", "--prompt-len", "8"]
        + ["--cache-dir", compile_cache_dir]
    )
    (r,) = rows
    assert r["LM head"]["calls_per_step"] == 1 and r["sampler"]["calls_per_step"] == 1
    assert r["total_s"]["LM head"] > 0 and r["total_s"]["sampler"] > 0
