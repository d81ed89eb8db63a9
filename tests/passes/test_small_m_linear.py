"""The small-M bf16 linear kernel (passes/small_m_linear.py) against torch: fp32 F.linear of
the same bf16 inputs, then one rounding.  The default tiny model's shapes and the LM head, the
test models' shapes, M = 1..64 (past 6 rows the kernel runs row passes over k-blocks of
each panel: every row's bits are what that row alone gives), bias, K odd / not a multiple of
32, N not a multiple of 64 (panel tails), strided rows, threads 1 and 2, the portable build,
the dispatch inside ``piecewise::packed_linear`` and opcheck."""

import pytest
import torch
import torch.nn.functional as F
from guard_page import before_guard_page
from onednn_panels import has_amx, onednn_reads_panels

from passes import small_m_linear as small_m
from passes.ops.packed_linear import mkldnn_available

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


ROWS = (1, 2, 5, 7, 8, 16, 17, 24, 31, 40, 64)
"""Row counts: one pass (<= 6 rows), several passes over k-blocks (balanced: 7 -> 4 + 3, 31 ->
6 + 5 x 5), up to the 64 a speculative verify step or a b64 decode step can bring."""
MAX_TESTED = 64


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_fp32_reference(n, k, bias):
    for m in ROWS:
        x, w, b = make(m, n, k, bias, seed=m)
        check(small_m.small_m_linear(x, w, b), x, w, b)


def test_every_row_count_and_the_lm_head():
    x, w, b = make(MAX_TESTED, 2816, 512, True)
    for m in range(1, MAX_TESTED + 1):
        check(small_m.small_m_linear(x[:m], w, b), x[:m], w, b)
    x, w, _ = make(40, 32000, 512, False)
    check(small_m.small_m_linear(x[:1], w, None), x[:1], w, None)
    check(small_m.small_m_linear(x, w, None), x, w, None)


@pytest.mark.parametrize("n,k", [(2816, 512), (130, 4096), (100, 1025), (64, 128)])
def test_each_row_is_what_the_row_alone_gives(n, k):
    """Row passes and k-blocks never change a row's arithmetic (one order, k ascending): with
    M rows, row r is bit for bit the result of the M = 1 call on row r -- the single-pass path,
    unchanged from the first kernel, so M <= 16 gives the bits it always gave.  K = 4096 and
    1025 take several k-blocks (256 pairs each), 1025 with the odd last k.  On AVX2 passes of
    4 and 5 rows take the tiles on x widened to fp32 (4 and 5 alone, 7 = 4 + 3, 16 = 6 + 5 +
    5, 24 = 5 x 4 + 4, 40 = 8 x 5), the others the bf16-x pair tiles."""
    x, w, b = make(MAX_TESTED, n, k, True, seed=3)
    packed = small_m.pack(w)
    alone = torch.cat([small_m.run_packed(x[r : r + 1], packed, b, n) for r in range(len(x))])
    for m in (4, 5, 7, 16, 24, 31, 40, MAX_TESTED):
        assert torch.equal(small_m.run_packed(x[:m], packed, b, n), alone[:m]), m


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "n,k",
    [(320, 99), (453, 333), (2 * 64, 64), (32000, 512), (65, 3), (192, 1), (1408, 1025)]
    + [(4800, 1025)],
)
def test_one_row_over_two_panels_at_once_gives_the_rows_bits(n, k, threads):
    """M = 1 reads several panels side by side (AVX-512: two a thread; AVX2: four parts of a
    thread's share, two k-pairs at a time); each output keeps its order, so the row is bit
    for bit what the same row gives beside another (M = 2, one pass of two rows over one
    panel at a time).  Panel counts even and odd per thread, fewer panels than streams (1, 2
    and 3 panels), K odd and K = 1 (no whole k-pair), bias, the LM head; on AVX2 shares over
    2 MB run in blocks (32000 x 512: 8 or 16 blocks; 4800 x 1025: 2 or 4 of 18-19 panels)."""
    x, w, b = make(2, n, k, True, seed=5)
    packed = small_m.pack(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        one = small_m.run_packed(x[:1], packed, b, n)
        two = small_m.run_packed(x, packed, b, n)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two[:1])
    check(one, x[:1], w, b)


@pytest.mark.parametrize("m", [3, 40])
def test_threads_give_identical_results(m):
    """Each output is computed by one thread in one order: 1 and 2 threads agree bit for bit."""
    x, w, b = make(m, 2816, 1408, True)
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
    for n, k, m in [(100, 33, 3), (1024, 512, 1), (512, 1408, 16), (130, 1025, 40), (64, 96, 64)]:
        x, w, b = make(m, n, k, True)
        check(small_m.small_m_linear(x, w, b, portable=True), x, w, b)


def test_bad_inputs_name_the_problem():
    x, w, b = make(2, 64, 32, True)
    with pytest.raises(ValueError, match="must be"):
        small_m.small_m_linear(x.float(), w, None)
    with pytest.raises(ValueError, match="bias must be"):
        small_m.small_m_linear(x, w, b[:10])


def test_pack_layout_and_unpack_round_trip():
    _, w, _ = make(2, 80, 47, False)
    packed = small_m.pack(w)
    assert packed.shape == (2, 24, 64, 2)  # ceil(80/64) panels, 24 k-pairs (K padded to 48)
    assert small_m.is_packed(packed, 80, 47) and not small_m.is_packed(packed, 80, 49)
    assert torch.equal(packed[1, 3, 5], w[64 + 5, 6:8])  # packed[p][i][j][t] = W[64p+j][2i+t]
    assert torch.equal(packed[1, 0, 16:], torch.zeros(48, 2, dtype=BF16))  # rows >= 80: zero
    assert torch.equal(small_m.unpack(packed, 80, 47), w)


def _layer(m, n, k, bias, max_rows, seed=0):
    """A layer whose weight was re-laid out once (the engine's model preparation)."""
    from models.layers import Linear
    from passes.ops.packed_linear import PackedLinearMethod

    x, w, b = make(m, n, k, bias, seed)
    layer = Linear(k, n, bias=bias, dtype=BF16)
    with torch.no_grad():
        layer.weight.copy_(w)
        if bias:
            layer.bias.copy_(b)
    method = PackedLinearMethod(max_rows)
    assert method.process(layer)
    layer.linear_method = method
    return layer, x, w, b


@pytest.mark.skipif(not mkldnn_available(), reason="needs oneDNN (mkldnn)")
def test_packed_linear_dispatches_by_rows(monkeypatch):
    """Up to the layer's max_rows bf16 rows run the kernel; more rows (or max_rows 0) run
    oneDNN on the same bytes (or F.linear on the unpacked weight).  Both agree with the
    reference; the threshold is the layer's own (two layers with different settings in one
    process).  Counted on the large-row path: the kernel runs in C++ once the op library is
    loaded (passes/native_ops.py), where no Python function is called."""
    from framework.compat import onednn

    large = []
    real_linear, real_unpack = onednn.linear, small_m.unpack
    monkeypatch.setattr(onednn, "linear", lambda *a, **k: large.append(1) or real_linear(*a, **k))
    monkeypatch.setattr(small_m, "unpack", lambda *a, **k: large.append(1) or real_unpack(*a, **k))
    layer, x, w, b = _layer(small_m.DEFAULT_MAX_ROWS + 1, 96, 64, True, small_m.DEFAULT_MAX_ROWS)
    check(layer(x[:1].view(1, 1, 64)).view(1, 96), x[:1], w, b)
    check(layer(x[:-1]), x[:-1], w, b)
    assert large == []
    slices = []
    real_run = small_m.run_packed
    monkeypatch.setattr(
        small_m, "run_packed", lambda x2, *a: slices.append(len(x2)) or real_run(x2, *a)
    )
    check(layer(x), x, w, b)
    assert (layer.weight_md is not None) == onednn_reads_panels(w)
    if layer.weight_md is not None:
        assert len(large) == 1  # 65 rows: oneDNN on the same bytes
    else:  # no oneDNN view of the panels (AVX2-only CPUs; AMX, whose oneDNN layout differs):
        assert large == [] and slices == [small_m.DEFAULT_MAX_ROWS, 1]  # max_rows at a time
    if not onednn.packs(BF16):  # an AVX2-only CPU: max_rows 0 leaves the layer dense
        from models.layers import Linear
        from passes.ops.packed_linear import PackedLinearMethod

        assert not PackedLinearMethod(0).process(Linear(64, 96, bias=True, dtype=BF16))
        return
    off, _, _, _ = _layer(small_m.DEFAULT_MAX_ROWS + 1, 96, 64, True, 0)
    before = len(large)
    check(off(x[:1]), x[:1], w, b)
    assert off.weight_md is not None and len(large) == before + 1  # max_rows 0: oneDNN always


@pytest.mark.skipif(not mkldnn_available(), reason="needs oneDNN (mkldnn)")
def test_a_layer_runs_the_kernel_up_to_its_own_max_rows_past_16(monkeypatch):
    """max_rows = 64: 40 and 64 rows (a verify step, a b64 decode step) run the kernel, 65 run
    oneDNN; both agree with the reference."""
    from framework.compat import onednn

    large = []
    real_linear, real_unpack = onednn.linear, small_m.unpack
    monkeypatch.setattr(onednn, "linear", lambda *a, **k: large.append(1) or real_linear(*a, **k))
    monkeypatch.setattr(small_m, "unpack", lambda *a, **k: large.append(1) or real_unpack(*a, **k))
    layer, x, w, b = _layer(65, 192, 96, True, 64)
    check(layer(x[:40]), x[:40], w, b)
    check(layer(x[:64]), x[:64], w, b)
    assert large == []
    check(layer(x), x, w, b)
    # 65 rows: oneDNN on the same bytes, or (no oneDNN view) the kernel 64 rows at a time
    assert len(large) == (1 if layer.weight_md is not None else 0)


@pytest.mark.skipif(not mkldnn_available(), reason="needs oneDNN (mkldnn)")
@pytest.mark.parametrize("m,max_rows", [(1, 16), (16, 16), (19, 16), (40, 64), (64, 64), (67, 64)])
def test_opcheck(m, max_rows):
    layer, x, _, b = _layer(m, 96, 64, True, max_rows)
    op = torch.ops.piecewise.packed_linear.default
    for bias in (None, b):
        args = (x, layer.weight, layer.weight_md, bias, 96, 64, max_rows)
        torch.library.opcheck(op, args)


@pytest.mark.skipif(not mkldnn_available(), reason="needs oneDNN (mkldnn)")
def test_packed_linear_refuses_a_bias_of_another_dtype():
    """The kernel reads the bias as the weight's dtype: a float32 bias next to bf16 weights
    must be an error naming both, not silently wrong outputs."""
    layer, x, _, b = _layer(1, 96, 64, True, small_m.DEFAULT_MAX_ROWS)
    with pytest.raises(ValueError, match="bias .* torch.float32 for w .* torch.bfloat16"):
        torch.ops.piecewise.packed_linear(
            x, layer.weight, layer.weight_md, b.float(), 96, 64, small_m.DEFAULT_MAX_ROWS
        )


def test_the_engine_defaults_are_the_kernels_own():
    """``KernelConfig`` (framework, below passes) spells the defaults out; they are the kernels'
    measured crossovers (``DEFAULT_MAX_ROWS``, ``python -m experiments.bench.small_m_linear``)."""
    from framework.core.config import KernelConfig
    from passes import int8_small_m as i8

    assert KernelConfig().small_m_max_rows == small_m.DEFAULT_MAX_ROWS
    assert KernelConfig().int8_small_m_max_rows == i8.DEFAULT_MAX_ROWS


def test_every_included_source_is_in_the_build_key():
    """A kernel library is rebuilt when any file it #includes changes: each quoted include of
    its source (followed through the included files) is one of its ``depends``."""
    import re

    from framework.engine import greedy_native
    from passes import int8_small_m as i8
    from passes import native_ops

    for library in (small_m.LIBRARY, i8.LIBRARY, native_ops.LIBRARY, greedy_native.LIBRARY):
        seen, todo = set(), [library.source]
        while todo:
            source = todo.pop()
            for name in re.findall(r'^#include "([^"]+)"', source.read_text(), flags=re.M):
                path = (source.parent / name).resolve()  # as the compiler finds it
                if path not in seen:
                    seen.add(path)
                    todo.append(path)
        depends = {p.resolve() for p in library.depends}
        assert seen and seen <= depends, (library.name, seen - depends)


def _cpu_flags() -> set[str]:
    from framework.core.native_build import cpu_flags

    return set(cpu_flags().split())


@pytest.mark.skipif(
    not {"avx2", "fma"} <= _cpu_flags() or "avx512_bf16" in _cpu_flags(),
    reason="the AVX2 path is the native build's on CPUs with AVX2 + FMA and no AVX512-BF16",
)
def test_avx2_build_runs_the_intrinsics_and_matches_the_portable_loops():
    """On an AVX2-only CPU (AMD Zen 3, Intel client parts) the native build is the AVX2 + FMA
    kernel, not the plain loops; it agrees with the reference and with the portable build
    within one bf16 rounding, for odd K, tails of panels and every row-pass split."""
    assert small_m.isa() == ("avx512" if "avx512f" in _cpu_flags() else "avx2_fma")
    if small_m.isa() != "avx2_fma":
        pytest.skip("an AVX-512 CPU without AVX512-BF16 runs the plain loops")
    for n, k, m in [(100, 33, 3), (1024, 512, 1), (96, 64, 2), (130, 1025, 7), (64, 96, 40)]:
        x, w, b = make(m, n, k, True)
        native = small_m.small_m_linear(x, w, b)
        check(native, x, w, b)
        portable = small_m.small_m_linear(x, w, b, portable=True)
        torch.testing.assert_close(native, portable, atol=1e-2, rtol=1e-2)
        for r in range(m):  # a row's bits do not depend on the rows beside it
            assert torch.equal(small_m.small_m_linear(x[r : r + 1], w, b)[0], native[r])


def test_amx_cpus_run_the_tile_path_at_every_row_count():
    """Where the CPU has AMX-BF16 the native build runs the tile path (``amx_bf16``) -- for
    every M, M = 1 included, so a row's bits are the same at every batch size; elsewhere it
    never does.  The portable build never does."""
    assert small_m.isa(portable=True) == "portable"
    if not has_amx() or "avx512_bf16" not in _cpu_flags():
        assert small_m.isa() != "amx_bf16"
        return
    assert small_m.isa() == "amx_bf16"
    x, w, b = make(40, 130, 1025, True, seed=3)  # K % 32 = 1: AMX steps, tail pairs, odd k
    out = small_m.small_m_linear(x, w, b)
    check(out, x, w, b)
    for m in (1, 2, 16, 17):
        assert torch.equal(small_m.small_m_linear(x[:m], w, b), out[:m])


@pytest.mark.parametrize("k", [1024, 1025, 1056])
def test_the_kernel_reads_nothing_past_the_packed_weight(k):
    """The packed weight ends where an unmapped page begins (as the last weight of a mapped
    weights file may): the tile path touches each next tile step early, and must not touch
    one past the end -- K = 1024 ends on a whole step, 1025 with an odd tail, 1056 with tail
    pairs.  A read past the end kills the process; the results equal the heap copy's."""
    x, w, b = make(40, 130, k, True, seed=5)
    packed = small_m.pack(w)
    guarded = before_guard_page(packed)
    for m in (1, 8, 17, 40):
        assert torch.equal(
            small_m.run_packed(x[:m], guarded, b, 130), small_m.run_packed(x[:m], packed, b, 130)
        )


def test_rows_independent_when_every_row_count_runs_the_kernel():
    """A panel layer without a oneDNN view runs the kernel at every row count (slices past
    max_rows), so its rows never depend on the batch: the engine then lets a step with drafts
    grow past max_rows (``Scheduler.draft_rows_limit`` None).  With a oneDNN view, batches
    past max_rows run oneDNN: not row-independent."""
    from framework.engine.model_prep import rows_independent

    layer, x, w, b = _layer(150, 96, 64, True, small_m.DEFAULT_MAX_ROWS)
    independent = layer.weight_md is None
    assert layer.linear_method.rows_independent(layer) is independent
    model = torch.nn.Sequential(layer)
    assert rows_independent(model, ["0"]) is independent and not rows_independent(model, [])
    if independent:  # the bits of a row inside a 150-row batch are its bits alone
        assert torch.equal(layer(x)[70:71], layer(x[70:71]))
