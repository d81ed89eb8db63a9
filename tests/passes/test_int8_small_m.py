"""The small-M int8 kernels (passes/int8_small_m.py) against the project's reference paths.

W8A8: bit for bit what ``dynamic_per_token_quant`` + an exact int8 matmul + the scaled-mm
epilogue give (the unpacked ``int8_per_token`` path), for bf16 and fp32 activations, M up to
64 (row passes over k-blocks past 6 rows), bias, K not a multiple of 4, N not a multiple of 64,
strided rows, threads 1 and 2, the portable build.  Weight-only: within one rounding of the
fp32 result, and past 6 rows each row bit for bit what it gives alone.  Then the layer level
(``PackedInt8LinearMethod``: one copy, same outputs as the unpacked scheme at every row count)
and the ops (opcheck; the small-M calls never enter Python once the C++ kernels are loaded)."""

import pytest
import torch
import torch.nn.functional as F
from guard_page import before_guard_page
from onednn_panels import has_amx

from framework.core.quantization import QuantizationConfig
from passes import int8_small_m as i8
from passes import native_ops
from passes.ops.activation_quant import dynamic_per_token_quant_torch
from passes.ops.scaled_mm import _epilogue

pytestmark = pytest.mark.skipif(
    not i8.kernel_available(), reason="the int8 small-M kernels need a C++ compiler"
)
BF16 = torch.bfloat16


def make(m, n, k, bias, dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g) / k**0.5
    scale = (w.abs().amax(dim=1) / 127).clamp_(min=1e-10)
    w_q = (w / scale[:, None]).round_().clamp_(-128, 127).to(torch.int8)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w_q, scale, b


def reference(x, w_q, scale, b):
    """The unpacked int8_per_token path: per-token quant, exact int32 products, epilogue."""
    x_q = torch.empty(x.shape, dtype=torch.int8)
    s = torch.empty(x.shape[0], 1)
    dynamic_per_token_quant_torch(x_q, x, s)
    acc = x_q.to(torch.int32) @ w_q.to(torch.int32).t()
    return _epilogue(acc, s, scale.reshape(1, -1), b, x.dtype)


def kernel(x, w_q, scale, b, portable=None):
    return i8.run_packed(x, i8.pack(w_q), scale, i8.compensation(w_q), b, w_q.shape[0], portable)


# (N, K): 1.1B-shape projections cut down, the default model's, panel and K tails.
SHAPES = [(2560, 256), (512, 1408), (1024, 512), (100, 33), (7, 3), (64, 128), (130, 4096)]


ROWS = (1, 2, 5, 7, 8, 16, 17, 24, 31, 40, 64)
"""One pass (<= 6 rows), several passes over k-blocks, up to a verify / b64 step's 64."""


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_w8a8_equals_the_reference_bit_for_bit(n, k, dtype):
    for m in ROWS:
        for bias in (False, True):
            x, w_q, scale, b = make(m, n, k, bias, dtype, seed=m)
            out, ref = kernel(x, w_q, scale, b), reference(x, w_q, scale, b)
            assert out.dtype == dtype and out.shape == (m, n)
            assert torch.equal(out, ref), f"M={m} bias={bias}: max diff {(out - ref).abs().max()}"


def test_amx_cpus_run_w8a8_from_six_rows_on_tiles_with_the_same_bits():
    """Where the CPU has AMX-INT8 the native build reports ``amx_int8`` and runs W8A8 calls of 6
    rows or more on tiles (K with whole 64-k steps and a tail, odd panel tails); the sums are
    exact, so every row equals the reference and its own VNNI-path result (one row alone)."""
    if not has_amx():
        assert i8.isa() != "amx_int8"
        return
    assert i8.isa() == "amx_int8"
    for n, k in [(130, 4096 + 36), (200, 100)]:
        x, w_q, scale, b = make(40, n, k, True)
        out = kernel(x, w_q, scale, b)
        assert torch.equal(out, reference(x, w_q, scale, b))
        assert torch.equal(torch.cat([kernel(x[r : r + 1], w_q, scale, b) for r in range(40)]), out)


@pytest.mark.parametrize("k", [1024, 1028, 1060])
def test_w8a8_reads_nothing_past_the_packed_weight(k):
    """The packed weight ends where an unmapped page begins: the tile path (6 rows and more on
    AMX) touches each next tile step early and must not touch one past the end -- K = 1024 ends
    on a whole 64-k step, 1028 and 1060 with quads past it.  A read past the end kills the
    process; the results equal the heap copy's."""
    x, w_q, scale, b = make(24, 130, k, True, seed=7)
    packed, comp = i8.pack(w_q), i8.compensation(w_q)
    guarded = before_guard_page(packed)
    for m in (1, 6, 17, 24):
        assert torch.equal(
            i8.run_packed(x[:m], guarded, scale, comp, b, 130),
            i8.run_packed(x[:m], packed, scale, comp, b, 130),
        )


def test_portable_build_equals_the_reference():
    assert i8.isa(portable=True) in ("portable", "avx2", "avx512", "neon")
    for n, k, m in [(100, 33, 3), (1024, 512, 1), (512, 1408, 16), (64, 128, 7), (130, 2051, 40)]:
        x, w_q, scale, b = make(m, n, k, True)
        assert torch.equal(kernel(x, w_q, scale, b, portable=True), reference(x, w_q, scale, b))
    x, w_q, scale, b = make(64, 130, 2051, True, torch.float32)
    out = i8.run_packed_weight_only(x, i8.pack(w_q), scale, b, 130, portable=True)
    check_weight_only(out, x, w_q, scale, b)


def test_zero_rows_large_values_and_strided_rows():
    x, w_q, scale, b = make(4, 192, 96, True)
    x = x * 1e4  # large activations: the scale follows, the result is still exact
    x[1] = 0  # an all-zero row quantises to zero (the scale floor keeps it finite)
    wide = torch.zeros(4, 160, dtype=BF16)
    wide[:, 10:106] = x
    out = kernel(wide[:, 10:106], w_q, scale, b)  # row stride 160
    assert torch.equal(out, reference(x, w_q, scale, b))
    assert torch.equal(out[1], b)
    assert kernel(x[:0], w_q, scale, b).shape == (0, 192)


@pytest.mark.parametrize("m", [3, 40])
def test_threads_give_identical_results(m):
    """Panels and the prologue's rows are split over the threads; every output is computed by
    one thread in one order, so 1 and 2 threads agree bit for bit (both kernels)."""
    x, w_q, scale, b = make(m, 2816, 1408, True)
    before = torch.get_num_threads()
    try:
        outs, wo = [], []
        for t in (1, 2):
            torch.set_num_threads(t)
            outs.append(kernel(x, w_q, scale, b))
            wo.append(i8.run_packed_weight_only(x, i8.pack(w_q), scale, b, 2816))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(wo[0], wo[1])
    assert torch.equal(outs[1], reference(x, w_q, scale, b))


@pytest.mark.parametrize("n,k", [(2560, 256), (130, 4096), (100, 1027)])
def test_weight_only_rows_are_what_each_row_alone_gives(n, k):
    """Weight-only is not bit-equal to a torch path, so its M > 6 passes are pinned to its own
    one-pass result: with M rows, row r is bit for bit the M = 1 call on row r."""
    x, w_q, scale, b = make(64, n, k, True, seed=5)
    packed = i8.pack(w_q)
    alone = torch.cat(
        [i8.run_packed_weight_only(x[r : r + 1], packed, scale, b, n) for r in range(64)]
    )
    for m in (7, 16, 40, 64):
        assert torch.equal(i8.run_packed_weight_only(x[:m], packed, scale, b, n), alone[:m]), m


def check_weight_only(out, x, w_q, scale, b):
    """Within one rounding of the fp32 result, plus fp32 summation-order noise."""
    w = w_q.float() * scale[:, None]
    ref = F.linear(x.float(), w, None if b is None else b.float())
    noise = 1e-5 * (x.float().abs() @ w.abs().t() + 1)
    err = (out.float() - ref).abs()
    ulp = 2.0**-8 if out.dtype == BF16 else 2.0**-23
    assert bool((err <= ref.abs() * ulp + noise).all()), f"max err {err.max()}"


@pytest.mark.parametrize("n,k", SHAPES)
def test_weight_only_matches_the_fp32_result(n, k):
    for m, dtype in ((1, BF16), (5, torch.float32), (16, BF16), (40, torch.float32), (64, BF16)):
        x, w_q, scale, b = make(m, n, k, True, dtype, seed=m)
        out = i8.run_packed_weight_only(x, i8.pack(w_q), scale, b, n)
        assert out.dtype == dtype and out.shape == (m, n)
        check_weight_only(out, x, w_q, scale, b)
    out = i8.run_packed_weight_only(x, i8.pack(w_q), scale, b, n, portable=True)
    check_weight_only(out, x, w_q, scale, b)


def test_pack_layout_unpack_and_compensation():
    _, w_q, _, _ = make(1, 80, 47, False)
    packed = i8.pack(w_q)
    assert packed.shape == (2, 12, 64, 4) and i8.is_packed(packed, 80, 47)
    assert torch.equal(packed[1, 3, 5], w_q[64 + 5, 12:16])  # packed[p][i][j][t] = W[64p+j][4i+t]
    assert torch.equal(packed[1, 0, 16:], torch.zeros(48, 4, dtype=torch.int8))  # rows >= 80
    assert torch.equal(packed[0, 11, :, 3], torch.zeros(64, dtype=torch.int8))  # k >= 47
    assert torch.equal(i8.unpack(packed, 80, 47), w_q)
    assert torch.equal(i8.compensation(w_q), 128 * w_q.int().sum(1))


# --- the layer and the ops ---------------------------------------------------------------------


def _layer(scheme_name, n, k, bias, seed=0, dtype=BF16, max_rows=i8.DEFAULT_MAX_ROWS):
    """A Linear quantised by the scheme (unpacked), and a copy re-laid out for the kernel."""
    from models.layers import Linear
    from passes.ops.int8_packed_linear import PackedInt8LinearMethod
    from passes.quant_schemes import apply_scheme, scheme_for

    layers = []
    for _ in range(2):
        g = torch.Generator().manual_seed(seed)
        layer = Linear(k, n, bias=bias, dtype=dtype)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)
            if bias:
                layer.bias.copy_(torch.randn(n, generator=g))
        spec = QuantizationConfig.parse(scheme_name).spec_for("layer")
        apply_scheme(layer, scheme_for(spec)(spec))
        layers.append(layer)
    plain, packed = layers
    method = PackedInt8LinearMethod(packed.linear_method, max_rows)
    assert PackedInt8LinearMethod.applies_to(packed) and method.process(packed)
    packed.linear_method = method
    return plain, packed


def test_packed_layer_holds_one_copy_and_equals_the_unpacked_scheme():
    plain, packed = _layer("int8_per_token", 96, 64, True)
    assert i8.is_packed(packed.weight, 96, 64)
    assert sorted(n for n, _ in packed.named_parameters()) == ["bias", "weight"]
    assert packed.weight_scale.shape == (96,) and packed.weight_comp.dtype == torch.int32
    g = torch.Generator().manual_seed(1)
    for rows in (1, i8.DEFAULT_MAX_ROWS, i8.DEFAULT_MAX_ROWS + 3):  # kernel, kernel, _int_mm
        x = torch.randn(1, rows, 64, generator=g).to(BF16)
        assert torch.equal(packed(x), plain(x)), rows


def test_packed_weight_only_layer_matches_the_unpacked_scheme():
    plain, packed = _layer("int8_per_channel_weight_only", 96, 64, True)
    g = torch.Generator().manual_seed(1)
    for rows in (1, i8.DEFAULT_MAX_ROWS + 3):
        x = torch.randn(rows, 64, generator=g).to(BF16)
        torch.testing.assert_close(packed(x), plain(x), atol=3e-2, rtol=2e-2)


def _args(layer, x):
    m = layer.linear_method
    if m.weight_only:
        return (x, layer.weight, layer.weight_scale, layer.bias, 96, 64, m.max_rows)
    return (x, layer.weight, layer.weight_scale, layer.weight_comp, layer.bias, 96, 64, m.max_rows)


def test_a_layer_with_max_rows_64_equals_the_unpacked_scheme_past_16():
    plain, packed = _layer("int8_per_token", 160, 96, True, max_rows=64)
    g = torch.Generator().manual_seed(2)
    for rows in (17, 40, 64, 65):  # kernel up to 64, _int_mm at 65
        x = torch.randn(rows, 96, generator=g).to(BF16)
        assert torch.equal(packed(x), plain(x)), rows


@pytest.mark.parametrize("scheme", ["int8_per_token", "int8_per_channel_weight_only"])
@pytest.mark.parametrize(
    "rows,max_rows", [(1, 16), (16, 16), (19, 16), (40, 64), (64, 64), (67, 64)]
)
def test_opcheck(scheme, rows, max_rows):
    _, layer = _layer(scheme, 96, 64, True, max_rows=max_rows)
    op = (
        torch.ops.piecewise.int8_wo_packed_linear.default
        if layer.linear_method.weight_only
        else torch.ops.piecewise.int8_packed_linear.default
    )
    x = torch.randn(rows, 64).to(BF16)
    torch.library.opcheck(op, _args(layer, x))


@pytest.mark.skipif(not native_ops.load(), reason="the C++ op library does not build here")
def test_small_m_calls_run_in_cpp_and_larger_ones_in_python(monkeypatch):
    """With the C++ kernels registered, a call of at most max_rows rows never enters Python
    (the ctypes entry and the unpack would raise); more rows go to the op's Python twin,
    which unpacks the weight for _int_mm (where torch has a fast int8 GEMM: pinned here)."""
    assert torch._C._dispatch_has_kernel_for_dispatch_key("piecewise::int8_packed_linear", "CPU")
    monkeypatch.setattr(i8, "takes_every_row_count", lambda: False)
    monkeypatch.setattr(i8, "w8a8_takes_every_row_count", lambda: False)  # not AMX: pinned
    plain, layer = _layer("int8_per_token", 96, 64, True)
    x = torch.randn(i8.DEFAULT_MAX_ROWS + 1, 64).to(BF16)
    expected = plain(x)
    unpacks = []
    real_unpack = i8.unpack

    def no_python(*a, **k):
        raise AssertionError("the small-M call went through Python")

    monkeypatch.setattr(i8, "run_packed", no_python)
    monkeypatch.setattr(i8, "unpack", lambda *a: unpacks.append(1) or real_unpack(*a))
    assert torch.equal(layer(x[:1]), expected[:1])
    assert torch.equal(layer(x[:-1]), expected[:-1])
    assert unpacks == []
    assert torch.equal(layer(x), expected)
    assert unpacks == [1]


@pytest.mark.parametrize("scheme", ["int8_per_token", "int8_per_channel_weight_only"])
def test_where_torch_has_no_fast_int8_gemm_larger_calls_run_the_kernel_in_slices(
    monkeypatch, scheme
):
    """Where the kernels take every row count (AVX2 without VNNI, pinned here) a call past
    max_rows runs the kernel max_rows rows at a time and never unpacks the weight: W8A8 gives
    the unpacked scheme's bits, and in both schemes every row what it gives alone."""
    from framework.engine.model_prep import rows_independent

    plain, layer = _layer(scheme, 96, 64, True, max_rows=16)
    monkeypatch.setattr(i8, "w8a8_takes_every_row_count", lambda: False)  # not AMX: pinned
    monkeypatch.setattr(i8, "takes_every_row_count", lambda: False)  # VNNI: torch past max_rows
    assert not layer.linear_method.rows_independent(layer)
    # W8A8's tile path in one call (AMX): its rows are independent, weight-only's are not
    monkeypatch.setattr(i8, "w8a8_takes_every_row_count", lambda: True)
    assert layer.linear_method.rows_independent(layer) == (not layer.linear_method.weight_only)
    monkeypatch.setattr(i8, "w8a8_takes_every_row_count", lambda: False)
    monkeypatch.setattr(i8, "takes_every_row_count", lambda: True)
    # so the engine lets a step with drafts grow past max_rows (draft_rows_limit None)
    assert layer.linear_method.rows_independent(layer)
    assert rows_independent(torch.nn.Sequential(layer), ["0"])
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(3)).to(BF16)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(40)])
    expected = plain(x)
    name = "run_packed_weight_only" if layer.linear_method.weight_only else "run_packed"
    calls, real_run = [], getattr(i8, name)
    monkeypatch.setattr(i8, name, lambda x2, *a: calls.append(x2.shape[0]) or real_run(x2, *a))
    monkeypatch.setattr(i8, "unpack", lambda *a: pytest.fail("the weight was unpacked"))
    op = (
        torch.ops.piecewise.int8_wo_packed_linear_python.default
        if layer.linear_method.weight_only
        else torch.ops.piecewise.int8_packed_linear_python.default
    )
    got = op(*_args(layer, x))  # the op's Python body: where the C++ op hands calls past max_rows
    assert calls == [16, 16, 8]
    assert torch.equal(got, alone)
    if layer.linear_method.weight_only:
        torch.testing.assert_close(got, expected, atol=3e-2, rtol=2e-2)
    else:
        assert torch.equal(got, expected)


@pytest.mark.parametrize("rows", [17, 40, 300])
def test_on_amx_w8a8_calls_past_max_rows_run_the_kernel_in_one_call(monkeypatch, rows):
    """Where the W8A8 kernel runs on AMX tiles (pinned here; the AVX2 slices pinned off) a
    call past max_rows runs the kernel once for all its rows and never unpacks the weight:
    the unpacked scheme's bits, and every row what it gives alone.  The weight-only op keeps
    torch's path there (its kernel has no tile path)."""
    monkeypatch.setattr(i8, "takes_every_row_count", lambda: False)
    monkeypatch.setattr(i8, "w8a8_takes_every_row_count", lambda: True)
    plain, layer = _layer("int8_per_token", 96, 64, True, max_rows=16)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).to(BF16)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(rows)])
    expected = plain(x)
    calls, real_run, real_unpack = [], i8.run_packed, i8.unpack
    monkeypatch.setattr(i8, "run_packed", lambda x2, *a: calls.append(len(x2)) or real_run(x2, *a))
    monkeypatch.setattr(i8, "unpack", lambda *a: pytest.fail("the weight was unpacked"))
    got = torch.ops.piecewise.int8_packed_linear_python.default(*_args(layer, x))
    assert calls == [rows]
    assert torch.equal(got, expected) and torch.equal(got, alone)
    _, wo = _layer("int8_per_channel_weight_only", 96, 64, True, max_rows=16)
    unpacked = []
    monkeypatch.setattr(i8, "unpack", lambda *a: unpacked.append(1) or real_unpack(*a))
    torch.ops.piecewise.int8_wo_packed_linear_python.default(*_args(wo, x))
    assert unpacked == [1]


def test_model_prep_packs_the_int8_layers(llama_checkpoint):
    """``process_weights`` re-lays every int8_per_token linear once (not the bf16/fp32 LM head's
    way), each packed layer computing exactly what it computed unpacked; with
    ``int8_small_m_max_rows = 0`` nothing int8 is packed."""
    from framework.core.config import CompilationConfig, PassConfig
    from framework.engine.model_prep import load_quantized, process_weights

    def config(rows):
        return CompilationConfig(
            pass_config=PassConfig(passes=["prepack_linear"]),
            kernel_config={"int8_small_m_max_rows": rows},
        )

    model, mc, _ = load_quantized(llama_checkpoint, torch.float32, "cpu", "int8_per_token")
    plain = {n: m for n, m in model.named_modules() if getattr(m, "linear_method", None)}
    x = torch.randn(3, mc.hidden_size)
    layer0 = "model.layers.0.self_attn.qkv_proj"
    before = plain[layer0](x)
    packed = process_weights(model, config(i8.DEFAULT_MAX_ROWS))
    int8 = [n for n in packed if ".layers." in n]
    assert len(int8) == 4 * mc.num_layers
    assert repr(plain[layer0].linear_method).startswith("PackedInt8LinearMethod")
    assert torch.equal(plain[layer0](x), before)
    other, _, _ = load_quantized(llama_checkpoint, torch.float32, "cpu", "int8_per_token")
    assert not [n for n in process_weights(other, config(0)) if ".layers." in n]


@pytest.mark.slow(reason="two LLM builds of the tiny model, ~30 s")
def test_engine_packs_int8_layers_and_keeps_the_tokens(llama_checkpoint, compile_cache_dir):
    """O1 (eager adaptor) with int8_per_token: every int8 linear is re-laid out once (the
    prepack pass counts them) and the greedy tokens equal the unpacked int8 path's
    (``int8_small_m_max_rows = 0``), which the kernel reproduces bit for bit."""
    from framework import LLM, CompilationConfig

    def build(rows):
        cc = CompilationConfig(
            level=1,
            compiler="eager",
            progress_bar=False,
            kernel_config={"int8_small_m_max_rows": rows},
        )
        return LLM(
            str(llama_checkpoint),
            quantization="int8_per_token",
            compilation_config=cc,
            max_num_seqs=2,
            max_model_len=64,
            cache_dir=compile_cache_dir,
        )

    prompts = [[3, 17, 42, 9, 100, 7], [8, 1, 250]]
    packed, plain = build(i8.DEFAULT_MAX_ROWS), build(0)
    layers = packed.model_config.num_layers
    qkv = packed.model.get_submodule("model.layers.0.self_attn.qkv_proj")
    assert repr(qkv.linear_method).startswith("PackedInt8LinearMethod(dynamic_per_token")
    assert sum(".layers." in n for n in packed.packed_layers) == 4 * layers
    assert packed.stats["passes"]["prepack_linear"]["total_matches"] == 4 * layers
    assert packed.generate(prompts, 8, ignore_eos=True) == plain.generate(
        prompts, 8, ignore_eos=True
    )


def test_the_int8_knob_is_validated_and_part_of_the_cache_key():
    from framework.core.config import CompilationConfig, KernelConfig

    base = CompilationConfig().compute_hash()
    assert (
        CompilationConfig(kernel_config=KernelConfig(int8_small_m_max_rows=8)).compute_hash()
        != base
    )
    assert KernelConfig(int8_small_m_max_rows=8, small_m_linear=False).int8_max_rows() == 0
    with pytest.raises(ValueError, match="KernelConfig.int8_small_m_max_rows"):
        KernelConfig(int8_small_m_max_rows=-1)


def test_extreme_int8_weights_are_exact_on_every_build():
    """Weights at -128 and 127 against activations at the ends of their range: the AVX2 build
    (vpmaddubsw: u8 x s8 pairs into saturating int16) moves the sign to the activation side so
    no pair sum saturates; W8A8 stays bit for bit the reference on every build."""
    from framework.core.native_build import cpu_flags

    flags = set(cpu_flags().split())
    if {"avx2", "fma"} <= flags and "avx512f" not in flags:
        assert i8.isa() == "avx2_fma"
    g = torch.Generator().manual_seed(3)
    n, k = 130, 1027
    w_q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    w_q[:, ::3] = -128
    w_q[:, 1::3] = 127
    scale = torch.rand(n, generator=g) * 1e-2 + 1e-3
    for m in (1, 2, 3, 7, 13):
        x = torch.randn(m, k, generator=g).to(BF16)
        x[:, ::5] = x.abs().amax(dim=1, keepdim=True)  # q = 127 ...
        x[:, 2::5] = -x.abs().amax(dim=1, keepdim=True)  # ... and -127
        for portable in (None, True):
            out = kernel(x, w_q, scale, None, portable)
            assert torch.equal(out, reference(x, w_q, scale, None)), f"M={m} portable={portable}"
