"""The matmul-rate probe and the compute floor the verify bench divides by: the probe reports
the best of its rows, a 16-bit step takes the faster of its dtype and float32, bad arguments
are refused, and a tiny model's weight count is its linears and LM head from its config (the
embedding table left out)."""

import pytest
import torch

from experiments.bench import compute, verify_step
from framework import LLM


def test_matmul_peak_is_the_best_of_its_rows():
    shapes = ((8, 64, 128), (32, 128, 64))
    got = compute.matmul_peak(torch.float32, shapes=shapes, repeats=2)
    assert [r["shape"] for r in got["rows"]] == [list(s) for s in shapes]
    assert got["best_gflops"] == max(r["best_gflops"] for r in got["rows"]) > 0
    assert got["dtype"] == "float32" and got["threads"] == torch.get_num_threads()
    assert compute.matmul_peak("bfloat16", shapes=shapes[:1], repeats=1)["dtype"] == "bfloat16"


def test_a_16_bit_step_counts_on_the_faster_of_its_dtype_and_float32(monkeypatch):
    """Where torch's bf16 mm is a reference loop (an AVX2 CPU) the floor comes from fp32, which
    computes the same products exactly, and bf16 stops at its screen; where bf16 is faster
    (AMX) from bf16; an fp32 step times fp32 alone."""
    rates = {"bfloat16": 1.3, "float32": 150.0}
    timed = []

    def fake_peak(dtype, shapes=compute.SHAPES, repeats=5):
        name = str(dtype).removeprefix("torch.")
        timed.append((name, tuple(shapes)))
        return {"best_gflops": rates[name], "dtype": name, "threads": 2, "rows": []}

    monkeypatch.setattr(compute, "matmul_peak", fake_peak)
    got = compute.step_matmul_peak("bfloat16")
    assert (got["dtype"], got["best_gflops"]) == ("float32", 150.0)
    assert got["candidates"] == {"bfloat16": 1.3, "float32": 150.0}
    # the reference loop is stopped at its one-product screen, not timed over every shape
    assert timed == [("float32", compute.SHAPES), ("bfloat16", (compute.SCREEN,))]
    assert got["screened"] == ["bfloat16"]
    rates["bfloat16"] = 1800.0
    timed.clear()
    got = compute.step_matmul_peak(torch.bfloat16)
    assert got["dtype"] == "bfloat16" and got["screened"] == []
    assert [t[1] for t in timed] == [compute.SHAPES, (compute.SCREEN,), compute.SHAPES]
    # just under the ratio: screened out; at it: timed in full
    rates["bfloat16"] = 150.0 / compute.SCREEN_RATIO * 0.99
    assert compute.step_matmul_peak(torch.bfloat16)["screened"] == ["bfloat16"]
    rates["bfloat16"] = 150.0 / compute.SCREEN_RATIO
    assert compute.step_matmul_peak(torch.bfloat16)["screened"] == []
    timed.clear()
    assert compute.step_matmul_peak(torch.float32)["candidates"] == {"float32": 150.0}
    assert timed == [("float32", compute.SHAPES)]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="repeats"):
        compute.matmul_peak(torch.float32, repeats=0)
    with pytest.raises(ValueError, match="positive"):
        compute.matmul_peak(torch.float32, shapes=((0, 4, 4),))
    with pytest.raises(ValueError, match="peak_gflops"):
        compute.compute_floor_ms(10, 0.0)


def test_floor_arithmetic():
    # 5 rows through 1e6 weights: 1e7 FLOPs; at 10 GFLOP/s that is 1 ms
    assert compute.matmul_flops(1_000_000, 5) == 10_000_000
    assert compute.compute_floor_ms(10_000_000, 10.0) == pytest.approx(1.0)


def test_weight_elements_are_the_linears_and_the_head(llama_checkpoint):
    llm = LLM(str(llama_checkpoint), optimization_level=0, max_num_seqs=1, max_model_len=32)
    mc = llm.model_config
    h, i, d = mc.hidden_size, mc.intermediate_size, mc.head_dim
    qkv = h * (mc.num_heads + 2 * mc.num_kv_heads) * d
    per_layer = qkv + mc.num_heads * d * h + 2 * h * i + i * h
    assert verify_step.weight_elements(llm) == mc.num_layers * per_layer + mc.vocab_size * h
