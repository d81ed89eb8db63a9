"""Every Triton kernel vs the op's plain-torch implementation: compiled on CUDA, in the Triton
interpreter on CPU.

This process never sets ``TRITON_INTERPRET`` (see tests/triton_interpreter.py): on CPU the
kernel tests below skip here and ``test_in_interpreter`` reruns them in a child process that
starts with ``TRITON_INTERPRET=1``; ``scripts/gpu_check.sh`` runs them compiled on the GPU
(``-m triton_kernel``).  Shapes are tiny: the interpreter runs kernels in numpy.
"""

import pytest
import torch

triton = pytest.importorskip("triton")

from triton_interpreter import (  # noqa: E402
    ON_GPU,
    kernel_test,
    language_is_interpreted,
    run_module_in_interpreter,
)

import passes.ops  # noqa: E402,F401
from passes.ops import activation as act_ops  # noqa: E402
from passes.ops import activation_quant as aq_ops  # noqa: E402
from passes.ops import moe as moe_ops  # noqa: E402
from passes.ops import norm as norm_ops  # noqa: E402
from passes.ops import rope as rope_ops  # noqa: E402
from passes.ops import scaled_mm as mm_ops  # noqa: E402
from passes.ops.triton import activation as tri_act  # noqa: E402
from passes.ops.triton import moe as tri_moe  # noqa: E402
from passes.ops.triton import norm as tri_norm  # noqa: E402
from passes.ops.triton import rope as tri_rope  # noqa: E402
from passes.ops.triton import scaled_mm as tri_mm  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"


def kernel(fn):
    """A test that launches kernels in this process (see the module docstring)."""
    return pytest.mark.triton_kernel(kernel_test(fn))


def dev(*tensors):
    """Test data is made on CPU (seeded generators) and moved to the kernels' device."""
    moved = tuple(t.to(DEVICE) for t in tensors)
    return moved[0] if len(moved) == 1 else moved


@pytest.mark.skipif(
    ON_GPU or language_is_interpreted(), reason="the kernel tests run in this process"
)
def test_in_interpreter(request):
    run_module_in_interpreter(__file__, request)


def _patch_interpreter_float_conversion():
    """Make the interpreter round float downcasts like the GPU does.

    Triton 3.9's interpreter truncates fp32->bf16 (GPUs round to nearest even) and, when it
    does round to fp8, drops the carry from mantissa into exponent (127.6 -> 64 instead of
    128).  Kernels are checked against the hardware semantics, so conversions between the
    float types torch knows go through torch's round-to-nearest-even casts; explicit
    round-toward-zero requests keep the interpreter's own code."""
    import numpy as np
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    tl = triton.language
    torch_dtypes = {
        tl.float32: torch.float32,
        tl.bfloat16: torch.bfloat16,
        tl.float16: torch.float16,
        tl.float8e4nv: torch.float8_e4m3fn,
        tl.float8e5: torch.float8_e5m2,
    }
    bits_view = {32: torch.int32, 16: torch.int16, 8: torch.uint8}
    original = interpreter._convert_float

    def convert(data, in_dtype, out_dtype, rounding_mode):
        src, dst = torch_dtypes.get(in_dtype), torch_dtypes.get(out_dtype)
        if src is None or dst is None or rounding_mode == ir.ROUNDING_MODE.RTZ:
            return original(data, in_dtype, out_dtype, rounding_mode)
        raw = np.ascontiguousarray(data)
        t = torch.from_numpy(
            raw.view(np.dtype(f"uint{raw.dtype.itemsize * 8}")).view(f"int{raw.dtype.itemsize * 8}")
            if raw.dtype.itemsize > 1
            else raw.view(np.uint8)
        )
        out = t.view(src).to(dst).view(bits_view[out_dtype.primitive_bitwidth]).numpy()
        return out.view(np.dtype(f"uint{out_dtype.primitive_bitwidth}"))

    interpreter._convert_float = convert


def _patch_interpreter_bf16_dot():
    """Triton 3.9's interpreter multiplies bf16 ``tl.dot`` operands as their raw 16-bit
    patterns (numpy has no bf16); the GPU multiplies the values exactly and accumulates in
    fp32, which is what upcasting both operands to fp32 first computes.  Returns the original."""
    import numpy as np
    from triton.runtime import interpreter

    tl = triton.language
    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def as_f32(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        bits = np.ascontiguousarray(h.data).astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, as_f32(a), as_f32(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    return original


@pytest.fixture(autouse=True)
def interpreter_rounds_like_the_gpu():
    """The conversion (and bf16 dot) patches, only around each kernel test that runs in the
    interpreter."""
    if not language_is_interpreted():
        yield
        return
    from triton.runtime import interpreter

    original = interpreter._convert_float
    _patch_interpreter_float_conversion()
    original_dot = _patch_interpreter_bf16_dot()
    try:
        yield
    finally:
        interpreter._convert_float = original
        interpreter.InterpreterBuilder.create_dot = original_dot


EPS = 1e-6
QDTYPES = [torch.int8, torch.float8_e4m3fn]


def assert_quant_equal_up_to_one_step(got, want):
    if got.dtype == torch.int8:
        assert (got.int() - want.int()).abs().max() <= 1
        assert (got != want).float().mean() < 0.05
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=0.13, atol=2**-9)


def data(t=3, h=40, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return list(
        dev(
            *[torch.randn(t, h, generator=g).to(dtype) for _ in range(2)],
            (1 + 0.1 * torch.randn(h, generator=g)).to(dtype),
        )
    )


@kernel
def test_rms_norm_kernel():
    x, _, w = data()  # hidden 40: not a power of two, exercises masking
    got, want = torch.empty_like(x), torch.empty_like(x)
    tri_norm.rms_norm(got, x, w, EPS)
    norm_ops.rms_norm_torch(want, x, w, EPS)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


@kernel
def test_fused_add_rms_norm_kernel():
    x, r, w = data()
    x2, r2 = x.clone(), r.clone()
    tri_norm.fused_add_rms_norm(x, r, w, EPS)
    norm_ops.fused_add_rms_norm_torch(x2, r2, w, EPS)
    assert torch.equal(r, r2)
    torch.testing.assert_close(x, x2, atol=1e-2, rtol=1e-2)


@kernel
@pytest.mark.parametrize("qdtype", QDTYPES)
def test_rms_norm_static_quant_kernels(qdtype):
    x, r, w = data()
    s = dev(torch.tensor([0.02]))
    got, want = (torch.empty(x.shape, dtype=qdtype, device=DEVICE) for _ in range(2))
    tri_norm.rms_norm_static_quant(got, x, w, s, EPS)
    norm_ops.rms_norm_static_quant_torch(want, x, w, s, EPS)
    assert_quant_equal_up_to_one_step(got, want)
    r2 = r.clone()
    tri_norm.fused_add_rms_norm_static_quant(got, x, r, w, s, EPS)
    norm_ops.fused_add_rms_norm_static_quant_torch(want, x, r2, w, s, EPS)
    assert torch.equal(r, r2)
    assert_quant_equal_up_to_one_step(got, want)


@kernel
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_dynamic_quant_kernel(qdtype, with_residual):
    x, r, w = data()
    r2 = r.clone()
    got, want = (torch.empty(x.shape, dtype=qdtype, device=DEVICE) for _ in range(2))
    gs, ws = torch.empty(3, 1, device=DEVICE), torch.empty(3, 1, device=DEVICE)
    tri_norm.rms_norm_dynamic_quant(got, x, w, gs, EPS, r if with_residual else None)
    norm_ops.rms_norm_dynamic_quant_torch(want, x, w, ws, EPS, r2 if with_residual else None)
    torch.testing.assert_close(gs, ws, rtol=1e-5, atol=0)
    assert torch.equal(r, r2)
    assert_quant_equal_up_to_one_step(got, want)


@kernel
@pytest.mark.parametrize("block", [8, 1024])  # 8: several chunks per row (two-pass path)
def test_silu_and_mul_kernels(block):
    x = data(h=2 * 20)[0] * 2
    got, want = (torch.empty(3, 20, dtype=x.dtype, device=DEVICE) for _ in range(2))
    tri_act._launch(got, x, None, True, tri_act.NO_QUANT, block=block)
    act_ops.silu_and_mul_torch(want, x)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    for qdtype in QDTYPES:
        s = dev(torch.tensor([0.03]))
        got, want = (torch.empty(3, 20, dtype=qdtype, device=DEVICE) for _ in range(2))
        tri_act._launch(got, x, s, True, tri_act.STATIC, block=block)
        act_ops.silu_and_mul_static_quant_torch(want, x, s)
        assert_quant_equal_up_to_one_step(got, want)
        gs, ws = torch.empty(3, 1, device=DEVICE), torch.empty(3, 1, device=DEVICE)
        tri_act._launch(got, x, gs, True, tri_act.DYNAMIC, block=block)
        act_ops.silu_and_mul_dynamic_quant_torch(want, x, ws)
        torch.testing.assert_close(gs, ws, rtol=1e-5, atol=0)
        assert_quant_equal_up_to_one_step(got, want)


@kernel
@pytest.mark.parametrize("qdtype", QDTYPES)
def test_activation_quant_kernels(qdtype):
    x = data()[0]
    s = dev(torch.tensor([0.02]))
    got, want = (torch.empty(x.shape, dtype=qdtype, device=DEVICE) for _ in range(2))
    tri_act.static_scaled_quant(got, x, s)
    aq_ops.static_scaled_quant_torch(want, x, s)
    assert torch.equal(got.float(), want.float())  # no reduction involved: bit-exact
    gs, ws = torch.empty(3, 1, device=DEVICE), torch.empty(3, 1, device=DEVICE)
    tri_act.dynamic_per_token_quant(got, x, gs)
    aq_ops.dynamic_per_token_quant_torch(want, x, ws)
    assert torch.equal(gs, ws) and torch.equal(got.float(), want.float())


@kernel
def test_int8_kernel_rounds_half_to_even():
    x = dev(torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 1000.0, -1000.0]]))
    got = torch.empty(x.shape, dtype=torch.int8, device=DEVICE)
    tri_act.static_scaled_quant(got, x, dev(torch.tensor([1.0])))
    assert got.tolist() == [[0, 2, 2, 0, -2, -2, 4, 127, -128]]


@kernel
@pytest.mark.parametrize("is_neox", [True, False])
def test_qk_norm_rope_kernel(is_neox):
    hq, hkv, d = 2, 1, 12  # d/2 = 6: not a power of two, exercises masking
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, (hq + 2 * hkv) * d, generator=g).to(torch.bfloat16)
    qw, kw = torch.randn(d, generator=g), torch.randn(d, generator=g)
    cache = torch.randn(16, d, generator=g)
    qkv, qw, kw, cache = dev(qkv, qw, kw, cache)
    pos = dev(torch.tensor([0, 5, 15]))
    got, want = qkv.clone(), qkv.clone()
    tri_rope.qk_norm_rope(got, pos, qw, kw, cache, hq, hkv, d, EPS, is_neox)
    rope_ops.qk_norm_rope_torch(want, pos, qw, kw, cache, hq, hkv, d, EPS, is_neox)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)


@kernel
@pytest.mark.parametrize("m", [3, 20])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_scaled_mm_kernel(m, with_bias):
    g = torch.Generator().manual_seed(0)
    x_q = torch.randint(-128, 128, (m, 80), generator=g, dtype=torch.int8)
    w_q = torch.randint(-127, 128, (70, 80), generator=g, dtype=torch.int8).t()
    xs, ws = torch.rand(m, 1, generator=g), torch.rand(1, 70, generator=g)
    bias = dev(torch.randn(70, generator=g)) if with_bias else None
    x_q, w_q, xs, ws = dev(x_q, w_q, xs, ws)
    got = tri_mm.int8_scaled_mm(x_q, xs, w_q, ws, bias, torch.float32)
    want = mm_ops.int8_scaled_mm_torch(x_q, xs, w_q, ws, bias, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)
    got = tri_mm.int8_scaled_mm(
        x_q, dev(torch.tensor([0.5])), w_q, dev(torch.tensor([2.0])), None, torch.float32
    )
    assert torch.equal(got, (x_q.double() @ w_q.double()).float())  # exact (int matmul: CPU only)


@kernel
def test_fp8_scaled_mm_kernel():
    g = torch.Generator().manual_seed(0)
    x_q = (torch.randn(5, 48, generator=g) * 30).to(torch.float8_e4m3fn)
    w_q = (torch.randn(20, 48, generator=g) * 30).to(torch.float8_e4m3fn).t()
    xs, ws = torch.rand(5, 1, generator=g), torch.rand(1, 20, generator=g)
    x_q, w_q, xs, ws = dev(x_q, w_q, xs, ws)
    got = tri_mm.fp8_scaled_mm(x_q, xs, w_q, ws, None, torch.bfloat16)
    want = mm_ops.fp8_scaled_mm_torch(x_q, xs, w_q, ws, None, torch.bfloat16)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


@kernel
def test_int8_weight_only_mm_kernel():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 48, generator=g)
    w_q = torch.randint(-127, 128, (24, 48), generator=g, dtype=torch.int8)
    ws, bias = torch.rand(24, generator=g) * 0.02, torch.randn(24, generator=g)
    x, w_q, ws, bias = dev(x, w_q, ws, bias)
    got = tri_mm.int8_weight_only_mm(x, w_q, ws, bias)
    want = mm_ops.int8_weight_only_mm_torch(x, w_q, ws, bias)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@kernel
@pytest.mark.parametrize("t", [1, 5, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_kernel(t, dtype):
    """Grouped GEMM over the slots sorted by expert: 6 experts top-2, hidden 40, expert
    intermediate 72 (no size a multiple of the blocks), against the per-expert oracle."""
    g = torch.Generator().manual_seed(t)
    E, H, I, K = 6, 40, 72, 2  # noqa: E741
    x = torch.randn(t, H, generator=g).to(dtype)
    w13 = (0.1 * torch.randn(E, 2 * I, H, generator=g)).to(dtype)
    w2 = (0.1 * torch.randn(E, H, I, generator=g)).to(dtype)
    w, ids = moe_ops.topk_softmax_torch(torch.randn(t, E, generator=g), K, True)
    x, w13, w2, w, ids = dev(x, w13, w2, w, ids)
    got = tri_moe.fused_moe(x, w, ids, w13, w2)
    want = moe_ops.fused_moe_reference(x.cpu(), w.cpu(), ids.cpu(), w13.cpu(), w2.cpu())
    # fp32 dots are exact ("ieee", not TF32) on the GPU too: the fp32 tolerance holds there
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.cpu(), want, **tol)


@kernel
def test_fused_moe_kernel_runs_inside_a_cuda_graph():
    """The MoE op sits inside the piecewise graphs, so its kernel must capture: static sizes,
    no host read of a device value (the first version read the padded total with ``int()``
    and used ``bincount`` / ``repeat_interleave``).  Captured once, then replayed on new
    routing written into the same buffers, it gives the new result.  Real CUDA graphs on the
    GPU; on CPU the emulated ones, which fail a host read during capture as a real capture
    does."""
    from framework.cudagraph.emulation import EmulatedGraphOps
    from framework.cudagraph.wrapper import CUDAGraphOps

    g = torch.Generator().manual_seed(5)
    T, E, H, I, K = 3, 6, 40, 72, 2  # noqa: E741
    w13 = (0.1 * torch.randn(E, 2 * I, H, generator=g)).to(torch.float32)
    w2 = (0.1 * torch.randn(E, H, I, generator=g)).to(torch.float32)

    def routing(seed):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(T, H, generator=gen)
        w, ids = moe_ops.topk_softmax_torch(torch.randn(T, E, generator=gen), K, True)
        return x, w, ids

    x, w, ids = dev(*routing(0))
    w13, w2 = dev(w13, w2)
    tri_moe.fused_moe(x, w, ids, w13, w2)  # warm-up: kernels compiled and loaded
    ops = CUDAGraphOps() if ON_GPU else EmulatedGraphOps()
    graph, out = ops.capture(
        lambda: tri_moe.fused_moe(x, w, ids, w13, w2), ops.shared_pool(), collect_garbage=False
    )
    for seed in (1, 2):  # e.g. seed 1 routes differently from seed 0
        nx, nw, nids = routing(seed)
        x.copy_(nx), w.copy_(nw), ids.copy_(nids)
        ops.replay(graph)
        ops.synchronize()
        want = moe_ops.fused_moe_reference(nx, nw, nids, w13.cpu(), w2.cpu())
        torch.testing.assert_close(out.cpu(), want, atol=1e-4, rtol=1e-4)


def test_align_by_expert_pads_each_expert_to_the_block():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    sorted_ids, experts = tri_moe.align_by_expert(ids, 4, 4)
    sentinel = ids.numel()
    # static sizes: (6 slots + 4 experts hit at most * 3 padding) // 4 = 4 blocks; expert 3
    # is not hit (no block), and the last block, past expert 2's, is skipped (-1)
    assert tri_moe.max_blocks(6, 4, 4) == 4
    assert experts.tolist() == [0, 1, 2, -1]
    # flat slots: [2, 0, 2, 1, 0, 2] -> expert 0: slots 1, 4; expert 1: 3; expert 2: 0, 2, 5
    assert sorted_ids.tolist() == [1, 4, sentinel, sentinel, 3, sentinel, sentinel, sentinel,
                                   0, 2, 5, sentinel] + [sentinel] * 4  # fmt: skip


def test_align_by_expert_sizes_depend_on_shapes_alone():
    """Whatever the routing, the sizes are the same (a CUDA graph replays them): every slot
    on one expert, or spread one per expert."""
    one = tri_moe.align_by_expert(torch.zeros(3, 2, dtype=torch.int64), 6, 4)
    spread = tri_moe.align_by_expert(torch.arange(6).view(3, 2), 6, 4)
    assert [t.shape for t in one] == [t.shape for t in spread]
    assert one[1].tolist()[:2] == [0, 0] and set(one[1].tolist()[2:]) == {-1}
    assert spread[1].tolist() == [0, 1, 2, 3, 4, 5]
