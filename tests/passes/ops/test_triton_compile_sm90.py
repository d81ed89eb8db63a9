"""Every fused-op Triton kernel compiled ahead of time for sm_90 (H100/H200), without a GPU,
in every dtype and variant the ops launch it with (tests/triton_aot.py explains the check).

The interpreter tests (test_triton_kernels.py) check the numbers; these check that the real
code generator accepts each specialisation -- what only a GPU run would otherwise reveal."""

import pytest
import torch
from triton_aot import MODEL_DTYPES, compile_for_sm90, require_cuda_backend

pytest.importorskip("triton")

from passes.ops.quant_utils import MIN_DYNAMIC_SCALE, quant_max  # noqa: E402

QUANT_OUT = {"i8": torch.int8, "fp8e4nv": torch.float8_e4m3fn}
"""Quantized output dtypes (Triton name -> torch dtype) the quant variants write."""


@pytest.fixture(autouse=True)
def _backend_and_cache(tmp_path, monkeypatch):
    require_cuda_backend()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))


def quant_constexprs(out: str) -> dict:
    if out in QUANT_OUT:
        dtype = QUANT_OUT[out]
        return dict(IS_INT8=dtype == torch.int8, QMAX=quant_max(dtype), MIN_SCALE=MIN_DYNAMIC_SCALE)
    return dict(IS_INT8=False, QMAX=1.0, MIN_SCALE=MIN_DYNAMIC_SCALE)


def variants(dt):
    """(quant mode, output dtype) as the ops use them: plain output in the activation dtype,
    static and dynamic quant to int8 and fp8."""
    yield 0, dt
    for out in QUANT_OUT:
        yield 1, out
        yield 2, out


@pytest.mark.parametrize("dt", MODEL_DTYPES)
def test_rms_norm_kernel_compiles(dt):
    from passes.ops.triton import norm

    for quant, out in variants(dt):
        for residual in (False, True):
            compile_for_sm90(
                norm._rms_norm_kernel,
                dict(
                    x_ptr=f"*{dt}",
                    res_ptr=f"*{dt}",
                    w_ptr=f"*{dt}",
                    out_ptr=f"*{out}",
                    scale_ptr="*fp32" if quant else f"*{dt}",
                    H="i32",
                    x_stride="i32",
                    res_stride="i32",
                    out_stride="i32",
                    eps="fp32",
                ),
                dict(BLOCK=4096, HAS_RESIDUAL=residual, QUANT=quant, **quant_constexprs(out)),
            )


@pytest.mark.parametrize("dt", MODEL_DTYPES)
def test_activation_row_kernel_compiles(dt):
    from passes.ops.triton import activation

    for quant, out in variants(dt):
        for gated in (True, False):
            if not gated and quant == 0:
                continue  # plain activation without quant is not an op
            compile_for_sm90(
                activation._row_kernel,
                dict(
                    x_ptr=f"*{dt}",
                    out_ptr=f"*{out}",
                    scale_ptr="*fp32" if quant else f"*{dt}",
                    N="i32",
                    x_stride="i32",
                    out_stride="i32",
                ),
                dict(BLOCK=1024, GATED=gated, QUANT=quant, **quant_constexprs(out)),
            )


@pytest.mark.parametrize("dt", MODEL_DTYPES)
def test_qk_norm_rope_kernel_compiles(dt):
    from passes.ops.triton import rope

    for is_neox in (True, False):
        for cache in sorted({dt, "fp32"}):
            compile_for_sm90(
                rope._qk_norm_rope_kernel,
                dict(
                    qkv_ptr=f"*{dt}",
                    pos_ptr="*i64",
                    qw_ptr=f"*{dt}",
                    kw_ptr=f"*{dt}",
                    cache_ptr=f"*{cache}",
                    qkv_stride="i32",
                    cache_stride="i32",
                    num_heads="i32",
                    eps="fp32",
                ),
                dict(HEAD_DIM=128, HALF_BLOCK=64, IS_NEOX=is_neox),
            )


TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

SCALED_MM = {
    # name: (a, b, accumulate in int32, upcast b); scales fp32
    "int8": ("i8", "i8", True, False),
    "fp8": ("fp8e4nv", "fp8e4nv", False, False),
}


@pytest.mark.parametrize("dt", MODEL_DTYPES)
def test_scaled_mm_kernel_compiles(dt):
    """int8 x int8 and fp8 x fp8 with the output in the activation dtype (per-token /
    per-channel scales, with and without bias); weight-only int8 with activations in ``dt``."""
    from passes.ops.triton import scaled_mm as mm

    common = dict(
        M="i32",
        N="i32",
        K="i32",
        s_am="i32",
        s_ak="i32",
        s_bk="i32",
        s_bn="i32",
        s_cm="i32",
        s_cn="i32",
    )
    for a, b, acc_int32, upcast in SCALED_MM.values():
        for bias in (False, True):
            compile_for_sm90(
                mm._scaled_mm_kernel,
                dict(
                    a_ptr=f"*{a}",
                    b_ptr=f"*{b}",
                    c_ptr=f"*{dt}",
                    a_scale_ptr="*fp32",
                    b_scale_ptr="*fp32",
                    bias_ptr=f"*{dt}",
                    **common,
                ),
                dict(
                    A_SCALE=mm.SCALE_VECTOR,
                    B_SCALE=mm.SCALE_VECTOR,
                    HAS_BIAS=bias,
                    ACC_INT32=acc_int32,
                    UPCAST_B=upcast,
                    DOT_PRECISION="tf32",  # int8 / fp8 operands: precision does not apply
                    BLOCK_M=16,
                    BLOCK_N=64,
                    BLOCK_K=64,
                ),
            )
    compile_for_sm90(
        mm._scaled_mm_kernel,
        dict(
            a_ptr=f"*{dt}",
            b_ptr="*i8",
            c_ptr=f"*{dt}",
            a_scale_ptr=f"*{dt}",
            b_scale_ptr=f"*{dt}",
            bias_ptr=f"*{dt}",
            **common,
        ),
        dict(
            A_SCALE=mm.SCALE_NONE,
            B_SCALE=mm.SCALE_VECTOR,
            HAS_BIAS=True,
            ACC_INT32=False,
            UPCAST_B=True,
            DOT_PRECISION=mm.dot_precision(TORCH_DTYPES[dt]),
            BLOCK_M=64,
            BLOCK_N=64,
            BLOCK_K=64,
        ),
    )


def test_a_compile_error_fails(tmp_path):
    """The check can fail: a kernel the interpreter would run but the compiler rejects (a
    variable whose type changes inside a loop) raises instead of being skipped."""
    import triton
    import triton.language as tl

    @triton.jit
    def bad(x_ptr, N):
        acc = 0
        for i in range(0, N):
            acc = acc + tl.load(x_ptr + i)  # int32 -> fp32 inside the loop
        tl.store(x_ptr, acc)

    with pytest.raises(Exception, match="(?i)loop|type"):
        compile_for_sm90(bad, dict(x_ptr="*fp32", N="i32"), {})


@pytest.mark.parametrize("dt", MODEL_DTYPES)
def test_moe_gemm_kernel_compiles(dt):
    """Both MoE stages: gate-up (A rows are tokens, no weight) and down (A rows are slots,
    times the routing weight, fp32 output)."""
    from passes.ops.triton import moe

    for a_per_slot, mul_weight, out in ((False, False, dt), (True, True, "fp32")):
        compile_for_sm90(
            moe._moe_gemm_kernel,
            dict(
                a_ptr=f"*{dt}",
                b_ptr=f"*{dt}",
                c_ptr=f"*{out}",
                topk_w_ptr="*fp32",
                sorted_ids_ptr="*i32",
                expert_ids_ptr="*i32",
                N="i32",
                K="i32",
                num_slots="i32",
                top_k="i32",
                s_am="i32",
                s_ak="i32",
                s_be="i32",
                s_bn="i32",
                s_bk="i32",
                s_cm="i32",
                s_cn="i32",
            ),
            dict(
                A_PER_SLOT=a_per_slot,
                MUL_WEIGHT=mul_weight,
                DOT_PRECISION=moe.dot_precision(TORCH_DTYPES[dt]),
                BLOCK_M=moe.BLOCK_M,
                BLOCK_N=moe.BLOCK_N,
                BLOCK_K=moe.BLOCK_K,
            ),
        )
