"""The C++ CPU kernel of piecewise::fused_moe_packed (csrc/fused_moe_packed.cpp): registered
with the dispatcher, a decode-sized call runs without entering Python, bit-identical to the
op's Python body (``piecewise::fused_moe_packed_python``) over T 1-40, K 1-3, E 6/8 and both
routing-weight dtypes, close to the per-expert oracle, opcheck'd, calls with a group above
max_rows handed to the Python body, only the chosen experts read, and bad ids named."""

import pytest
import torch
from moe_experts import make, packed

import passes.ops  # noqa: F401  (registers the ops)
import passes.ops.packed_moe as prepack_moe
from passes import native_ops
from passes import small_m_linear as small_m
from passes.ops.moe import fused_moe_reference, topk_softmax_torch

pytestmark = pytest.mark.skipif(
    not (small_m.kernel_available() and native_ops.load()),
    reason="needs the small-M kernel and the C++ op library built here",
)
ops = torch.ops.piecewise
BF16 = dict(atol=2e-2, rtol=2e-2)


def args_of(m, x, weights, ids, max_rows=None):
    method = m.moe_method
    rows = method.max_rows if max_rows is None else max_rows
    return (x, weights, ids, m.w13, m.w2, m.w13_md, m.w2_md, method.intermediate_size, rows)


@pytest.fixture
def no_python_body(monkeypatch):
    """Any call that reaches the Python body fails."""

    def fail(*a, **k):
        raise AssertionError("the call went through the Python body")

    monkeypatch.setattr(prepack_moe, "combine_by_expert", fail)


def test_the_op_has_a_cpp_cpu_kernel():
    assert "fused_moe_packed" in native_ops.OPS
    assert torch._C._dispatch_has_kernel_for_dispatch_key("piecewise::fused_moe_packed", "CPU")


def routing(t, experts, k, seed, weights_dtype, hidden=64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g).bfloat16()
    weights, ids = topk_softmax_torch(torch.randn(t, experts, generator=g), k, True)
    return x, weights.to(weights_dtype), ids


ORACLE_TOKENS = (1, 2, 7, 16, 33, 40)
"""Token counts of the sweep also checked against the per-expert oracle (it is slow)."""


@pytest.mark.parametrize("experts", [6, 8])
def test_bit_identical_to_the_python_body_over_t_k_e(experts):
    """T 1..40, K 1..3, fp32 and bf16 routing weights: the C++ kernel's bits equal the Python
    body's (same small-M kernel, torch's SiLU and mul, the same rounding of each contribution
    and the same order of the sums), with max_rows 64 so the C++ kernel takes every call;
    close to the oracle at a few token counts."""
    _, _, _, w13, w2 = make(1, experts, 1, seed=experts)
    m = packed(w13, w2, max_rows=64)
    for weights_dtype in (torch.bfloat16, torch.float32):
        for k in (1, 2, 3):
            for t in range(1, 41):
                x, weights, ids = routing(t, experts, k, 100 * k + t, weights_dtype)
                args = args_of(m, x, weights, ids)
                got = ops.fused_moe_packed(*args)
                assert got.dtype == torch.bfloat16 and got.shape == x.shape
                assert torch.equal(got, ops.fused_moe_packed_python(*args)), (t, k)
                if t in ORACLE_TOKENS:
                    oracle = fused_moe_reference(x, weights, ids, w13, w2)
                    torch.testing.assert_close(got, oracle, **BF16)


@pytest.mark.parametrize("t,k", [(1, 2), (1, 3), (8, 2), (16, 2)])
def test_decode_calls_never_enter_python(t, k, no_python_body):
    x, weights, ids, w13, w2 = make(t, 8, k, inter=96, seed=t)
    m = packed(w13, w2)
    got = ops.fused_moe_packed(*args_of(m, x, weights, ids))
    torch.testing.assert_close(got, fused_moe_reference(x, weights, ids, w13, w2), **BF16)


def test_a_group_above_max_rows_goes_to_the_python_body(no_python_body):
    x, weights, ids, w13, w2 = make(20, 6, 2, seed=1)
    m = packed(w13, w2, max_rows=16)
    ids = torch.zeros_like(ids)
    ids[:, 1] = 1  # experts 0 and 1 take all 20 tokens each: groups of 20 > max_rows 16
    with pytest.raises(AssertionError, match="Python body"):
        ops.fused_moe_packed(*args_of(m, x, weights, ids))
    # max_rows 20: the same call in C++
    torch.testing.assert_close(
        ops.fused_moe_packed(*args_of(m, x, weights, ids, max_rows=20)),
        fused_moe_reference(x, weights, ids, w13, w2),
        **BF16,
    )


def test_odd_and_unaligned_sizes():
    """Hidden 40 (a partial panel), intermediate 37 (odd k of the down GEMM)."""
    x, weights, ids, w13, w2 = make(5, 6, 2, inter=37, hidden=40, seed=4)
    m = packed(w13, w2)
    args = args_of(m, x, weights, ids)
    got = ops.fused_moe_packed(*args)
    assert torch.equal(got, ops.fused_moe_packed_python(*args))
    torch.testing.assert_close(got, fused_moe_reference(x, weights, ids, w13, w2), **BF16)


@pytest.mark.parametrize("t", [1, 3])
def test_a_token_listing_one_expert_twice(t):
    x, weights, _, w13, w2 = make(t, 6, 2)
    ids = torch.tensor([[1, 1], [2, 1], [1, 3]][:t])
    m = packed(w13, w2)
    args = args_of(m, x, weights, ids)
    got = ops.fused_moe_packed(*args)
    assert torch.equal(got, ops.fused_moe_packed_python(*args))
    torch.testing.assert_close(got, fused_moe_reference(x, weights, ids, w13, w2), **BF16)


def test_int32_ids_and_strided_inputs():
    x, weights, ids, w13, w2 = make(6, 8, 2, seed=9)
    m = packed(w13, w2)
    want = ops.fused_moe_packed(*args_of(m, x, weights, ids))
    wide = torch.zeros(6, 2 * x.shape[1], dtype=x.dtype)
    wide[:, : x.shape[1]] = x
    xs = wide[:, : x.shape[1]]  # row stride 2H
    got = ops.fused_moe_packed(*args_of(m, xs, weights.t().contiguous().t(), ids.int()))
    assert torch.equal(got, want)


def test_batch_one_reads_only_the_selected_experts():
    x, weights, ids, w13, w2 = make(1, 8, 2, seed=2)
    m = packed(w13, w2)
    want = ops.fused_moe_packed(*args_of(m, x, weights, ids))
    chosen = set(ids[0].tolist())
    with torch.no_grad():
        for e in range(8):
            if e not in chosen:
                m.w13[e] = float("nan")
                m.w2[e] = float("nan")
    assert torch.equal(ops.fused_moe_packed(*args_of(m, x, weights, ids)), want)
    with torch.no_grad():
        m.w13[ids[0, 0]] = float("nan")
    assert torch.isnan(ops.fused_moe_packed(*args_of(m, x, weights, ids))).all()


def test_out_of_range_ids_are_named():
    x, weights, ids, w13, w2 = make(2, 6, 2)
    m = packed(w13, w2)
    ids = ids.clone()
    ids[1, 0] = 6
    with pytest.raises(IndexError, match="expert id 6 of token 1 is out of range for 6"):
        ops.fused_moe_packed(*args_of(m, x, weights, ids))


@pytest.mark.parametrize(
    "t,k,weights_dtype,max_rows",
    [
        (0, 2, torch.bfloat16, 16),
        (1, 2, torch.bfloat16, 16),
        (5, 3, torch.float32, 16),
        (12, 1, torch.bfloat16, 4),  # some calls handed to the Python body
    ],
)
def test_opcheck(t, k, weights_dtype, max_rows):
    x, weights, ids, w13, w2 = make(t, 8, k, inter=96, seed=3, weights_dtype=weights_dtype)
    m = packed(w13, w2)
    torch.library.opcheck(ops.fused_moe_packed.default, args_of(m, x, weights, ids, max_rows))
