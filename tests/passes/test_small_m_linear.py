"""The small-M bf16 linear kernel (passes/small_m_linear.py) against torch: fp32 F.linear of
the same bf16 inputs, then one rounding.  The default tiny model's shapes and the LM head, the
test models' shapes, M = 1..MAX_ROWS, bias, K odd / not a multiple of 32, N not a multiple
of 64 (panel tails), strided rows, threads 1 and 2, the portable build, the dispatch inside
``piecewise::prepacked_linear`` and opcheck."""

import pytest
import torch
import torch.nn.functional as F

from passes import small_m_linear as small_m
from passes.ops_prepack import _PACKED as ONEDNN_PACKED
from passes.ops_prepack import clear_packed_weights, mkldnn_available

pytestmark = pytest.mark.skipif(
    not small_m.kernel_available(), reason="the small-M kernel needs a C++ compiler"
)
BF16 = torch.bfloat16


def make(m, n, k, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(BF16)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(BF16)
    b = torch.randn(n, generator=g).to(BF16) if bias else None
    return x, w, b


def check(out, x, w, b):
    """Within one bf16 rounding of the fp32 result, plus fp32 summation-order noise."""
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    noise = 1e-5 * (x.float().abs() @ w.float().abs().t() + 1)
    assert out.dtype == BF16 and out.shape == ref.shape
    err = (out.float() - ref).abs()
    bound = ref.abs() * 2.0**-8 + noise
    assert bool((err <= bound).all()), f"max err {err.max()} at {err.argmax()}, bound {bound}"


# (N, K): the default model (qkv, o, gate_up, down), test models, tails, K=4096.
SHAPES = [
    (1024, 512),
    (512, 512),
    (2816, 512),
    (512, 1408),
    (256, 64),
    (64, 128),
    (100, 33),
    (7, 3),
    (130, 4096),
    (4096, 64),
]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_fp32_reference(n, k, bias):
    for m in (1, 2, 5, 7, 8, small_m.MAX_ROWS):
        x, w, b = make(m, n, k, bias, seed=m)
        check(small_m.small_m_linear(x, w, b), x, w, b)


def test_every_row_count_and_the_lm_head():
    x, w, b = make(small_m.MAX_ROWS, 2816, 512, True)
    for m in range(1, small_m.MAX_ROWS + 1):
        check(small_m.small_m_linear(x[:m], w, b), x[:m], w, b)
    x, w, _ = make(1, 32000, 512, False)
    check(small_m.small_m_linear(x, w, None), x, w, None)


def test_threads_give_identical_results():
    """Each output is computed by one thread in one order: 1 and 2 threads agree bit for bit."""
    x, w, b = make(3, 2816, 512, True)
    before = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2):
            torch.set_num_threads(t)
            outs.append(small_m.small_m_linear(x, w, b))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])
    check(outs[1], x, w, b)


def test_strided_rows_and_empty_input():
    x, w, b = make(4, 192, 96, True)
    wide = torch.zeros(4, 160, dtype=BF16)
    wide[:, 10:106] = x
    view = wide[:, 10:106]  # row stride 160
    check(small_m.small_m_linear(view, w, b), x, w, b)
    assert small_m.small_m_linear(x[:0], w, b).shape == (0, 192)


def test_portable_build_matches_reference():
    assert small_m.isa(portable=True) in ("portable", "avx2", "avx512", "neon")
    for n, k, m in [(100, 33, 3), (1024, 512, 1), (512, 1408, 16)]:
        x, w, b = make(m, n, k, True)
        check(small_m.small_m_linear(x, w, b, portable=True), x, w, b)


def test_bad_inputs_name_the_problem():
    x, w, b = make(2, 64, 32, True)
    with pytest.raises(ValueError, match="must be"):
        small_m.small_m_linear(x.float(), w, None)
    with pytest.raises(ValueError, match="bias must be"):
        small_m.small_m_linear(x, w, b[:10])


def test_packed_once_and_repacked_after_in_place_update():
    small_m.clear_packed_weights()
    x, w, _ = make(2, 80, 48, False)
    small_m.small_m_linear(x, w, None)
    packed = small_m._PACKED.values()[0]
    assert packed.shape == (2, 24, 64, 2)  # ceil(80/64) panels, 24 k-pairs
    small_m.small_m_linear(x, w, None)
    assert len(small_m._PACKED) == 1 and small_m._PACKED.values()[0] is packed
    w.mul_(2)
    check(small_m.small_m_linear(x, w, None), x, w, None)


@pytest.mark.skipif(not mkldnn_available(), reason="needs oneDNN (mkldnn)")
def test_prepacked_linear_dispatches_by_rows(monkeypatch):
    """Up to MAX_ROWS bf16 rows run the kernel; more rows, fp32, or the kernel switched off
    run oneDNN.  Both agree with the reference."""
    op = torch.ops.piecewise.prepacked_linear
    x, w, b = make(small_m.MAX_ROWS + 1, 96, 64, True)
    clear_packed_weights()
    check(op(x[:1].view(1, 1, 64), w, b).view(1, 96), x[:1], w, b)
    assert len(small_m._PACKED) == 1 and len(ONEDNN_PACKED) == 0
    check(op(x, w, b), x, w, b)
    assert len(ONEDNN_PACKED) == 1
    clear_packed_weights()
    w32 = w.float()  # kept alive: a packed copy lives as long as its weight
    op(x.float()[:1], w32, None)  # fp32: oneDNN
    assert len(small_m._PACKED) == 0 and len(ONEDNN_PACKED) == 1
    monkeypatch.setattr(small_m, "kernel_available", lambda: False)
    clear_packed_weights()
    check(op(x[:1], w, b), x[:1], w, b)
    assert len(small_m._PACKED) == 0 and len(ONEDNN_PACKED) == 1


@pytest.mark.skipif(not mkldnn_available(), reason="needs oneDNN (mkldnn)")
@pytest.mark.parametrize("m", [1, small_m.MAX_ROWS])
def test_opcheck(m):
    x, w, b = make(m, 96, 64, True)
    for bias in (None, b):
        torch.library.opcheck(torch.ops.piecewise.prepacked_linear.default, (x, w, bias))


def test_prepacked_linear_refuses_a_bias_of_another_dtype():
    """The kernel reads the bias as the weight's dtype: a float32 bias next to bf16 weights
    must be an error naming both, not silently wrong outputs."""
    if not small_m.kernel_available():
        pytest.skip("no C++ compiler for the small-M kernel")
    x, w, b = make(1, 96, 64, True)
    with pytest.raises(ValueError, match="bias .* torch.float32 for w .* torch.bfloat16"):
        torch.ops.piecewise.prepacked_linear(x, w, b.float())
