"""piecewise::fused_moe_packed: the routed experts on weights re-laid out once for the small-M
kernel (bf16, CPU) against the per-expert oracle, at decode and prefill sizes (the small-M
kernel, oneDNN on the same bytes, the kernel in slices); the direct (decode) grouping equals
the sorted one bit for bit; opcheck; a symbolic trace; at batch 1 only the chosen experts
are read; and the re-layout holds each stack once."""

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from moe_experts import Experts, make, packed
from onednn_panels import has_amx, onednn_reads_panels

import passes.ops  # noqa: F401  (registers the ops)
from passes import small_m_linear as small_m
from passes.ops.moe import (
    combine_by_expert,
    fused_moe_grouped,
    fused_moe_reference,
    topk_softmax_torch,
)
from passes.ops.packed_moe import (
    PackedExpertsMethod,
    fused_moe_packed,
    pack_experts,
    unpack_experts,
)

pytestmark = pytest.mark.skipif(
    not small_m.kernel_available(), reason="needs the small-M kernel built here"
)
ops = torch.ops.piecewise
H = 64
BF16 = dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "t,experts,k,inter,max_rows",
    [
        (1, 6, 2, 72, 16),  # decode b1: the direct path, K contributions added
        (1, 8, 1, 96, 16),
        (8, 8, 2, 96, 16),  # decode b8
        (5, 6, 3, 72, 16),
        (40, 8, 2, 96, 16),  # sorted path, groups above max_rows: oneDNN on the panels
        (40, 6, 2, 72, 16),  # w2's K = 72: no oneDNN layout, the kernel in slices
        (9, 6, 2, 72, 2),  # small max_rows: both kinds of group in one call
    ],
)
def test_matches_the_oracle(t, experts, k, inter, max_rows):
    x, weights, ids, w13, w2 = make(t, experts, k, inter, seed=t)
    m = packed(w13, w2, max_rows)
    got = m(x, weights, ids)
    assert got.shape == (t, H) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, fused_moe_reference(x, weights, ids, w13, w2), **BF16)
    torch.testing.assert_close(got, fused_moe_grouped(x, weights, ids, w13, w2), **BF16)


def test_without_a_onednn_view_large_groups_run_the_kernel_in_slices(monkeypatch):
    """Where oneDNN does not read the panels (AMX and AVX2-only CPUs, K not a multiple of 32;
    pinned here by a probe that finds no layout) a group above max_rows runs the small-M
    kernel max_rows rows at a time, never unpacking an expert: each token then gets the bits
    it gets in a decode step alone, and the method says so."""
    from framework.compat import onednn
    from framework.engine.model_prep import rows_independent

    monkeypatch.setattr(onednn, "reorder", lambda w: None)  # no oneDNN view of any stack
    x, weights, ids, w13, w2 = make(40, 6, 2, 72, seed=7)
    m = packed(w13, w2, 4)
    assert m.w13_md is None and m.w2_md is None
    alone = torch.cat([m(x[i : i + 1], weights[i : i + 1], ids[i : i + 1]) for i in range(40)])
    # so the engine lets a step with drafts grow past max_rows (draft_rows_limit None)
    assert m.moe_method.rows_independent(m) and rows_independent(torch.nn.Sequential(m), ["0"])
    monkeypatch.setattr(small_m, "unpack", lambda *a: pytest.fail("an expert was unpacked"))
    rows, real = [], small_m.run_packed
    monkeypatch.setattr(small_m, "run_packed", lambda x2, *a: rows.append(len(x2)) or real(x2, *a))
    got = ops.fused_moe_packed_python(
        x, weights, ids, m.w13, m.w2, None, None, 72, 4
    )  # the op's Python body: where the C++ op hands a group above max_rows
    assert max(rows) == 4 and sum(rows) == 2 * 40 * 2  # gate-up and down, 80 (token, expert) rows
    assert torch.equal(got, alone)
    torch.testing.assert_close(got, fused_moe_reference(x, weights, ids, w13, w2), **BF16)
    assert torch.equal(m(x, weights, ids), alone)  # the layer's op (C++ where it is built)


def test_a_stack_onednn_reads_keeps_rows_dependent(monkeypatch):
    """With a oneDNN view of a stack, a group above max_rows runs oneDNN (whose bits for a row
    can depend on the rows beside it): the method must not claim row independence."""
    x, weights, ids, w13, w2 = make(8, 6, 2, 72, seed=3)
    m = packed(w13, w2, 4)
    m.w13_md = torch.zeros(1)  # stands for a descriptor: only its presence is read here
    assert not m.moe_method.rows_independent(m)


def test_fp32_routing_weights_with_bf16_experts():
    """Mixtral keeps its routing weights fp32."""
    x, weights, ids, w13, w2 = make(3, weights_dtype=torch.float32)
    m = packed(w13, w2)
    torch.testing.assert_close(
        m(x, weights, ids), fused_moe_reference(x, weights, ids, w13, w2), **BF16
    )


def test_onednn_reads_the_panels_where_the_layout_agrees():
    """oneDNN's descriptor is kept for an expert stack exactly where oneDNN lays that shape
    out as the panels (probed here on the first expert): on AVX512-BF16 without AMX, K = 64
    (w13) and 96 (w2) but not K = 72 (w2 of the 72-wide experts); with AMX, none; each shape
    is decided once per model."""
    if small_m.isa() not in ("avx512_bf16", "amx_bf16"):
        pytest.skip("oneDNN lays out no bf16 weight here (the AVX2 build)")
    layouts: dict = {}
    for inter in (96, 72):
        _, _, _, w13, w2 = make(1, inter=inter)
        m = packed(w13, w2, layouts=layouts)
        assert (m.w13_md is not None) == onednn_reads_panels(w13[0])
        assert (m.w2_md is not None) == onednn_reads_panels(w2[0])
        if not has_amx():  # (with AMX: none, as seen on a Xeon with amx_bf16)
            assert m.w13_md is not None and (m.w2_md is None) == (inter == 72)
    assert len(layouts) == 4  # (192, 64), (64, 96), (144, 64), (64, 72)
    # the same shapes again: decided from the dict, not oneDNN
    wide = packed(*make(1, inter=96)[3:], layouts=layouts)
    again = packed(*make(1, inter=96, seed=5)[3:], layouts=layouts)
    assert again.w13_md is wide.w13_md


@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,k", [(1, 2), (1, 3), (6, 2), (20, 3)])
def test_direct_grouping_equals_sorted_grouping_bitwise(t, k, weights_dtype):
    """The Python grouping of a decode step and the tensor sort of prefill give the same
    bits (same GEMMs, same contribution rounding, same expert order), for the packed kernel
    and the plain one."""
    x, weights, ids, w13, w2 = make(t, k=k, seed=10 + t, weights_dtype=weights_dtype)
    m = packed(w13, w2)
    calls = []

    def expert(e, xs):
        calls.append(e)
        h = small_m.run_packed(xs, m.w13[e], None, 144)
        return small_m.run_packed(F.silu(h[:, :72]) * h[:, 72:], m.w2[e], None, H)

    direct = combine_by_expert(x, weights, ids, expert)
    assert calls == sorted(set(ids.flatten().tolist()))  # each expert hit once, in order
    sorted_ = combine_by_expert(x, weights, ids, expert, direct_max_slots=0)
    assert torch.equal(direct, sorted_)
    assert torch.equal(m(x, weights, ids), direct)
    # the plain kernel (F.linear on plain stacks, fp32): its direct path equals sorting too
    xf, wf, w13f, w2f = x.float(), weights.float(), w13.float(), w2.float()

    def plain(e, xs):
        gate, up = F.linear(xs, w13f[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w2f[e])

    assert torch.equal(
        fused_moe_grouped(xf, wf, ids, w13f, w2f),
        combine_by_expert(xf, wf, ids, plain, direct_max_slots=0),
    )


@pytest.mark.parametrize("t", [1, 3])
def test_a_token_listing_one_expert_twice(t):
    """Not what a router produces, but the op's contract: both slots count."""
    x, weights, _, w13, w2 = make(t)
    ids = torch.tensor([[1, 1], [2, 1], [1, 3]][:t])
    m = packed(w13, w2)
    want = fused_moe_reference(x, weights, ids, w13, w2)
    torch.testing.assert_close(m(x, weights, ids), want, **BF16)
    torch.testing.assert_close(fused_moe_grouped(x, weights, ids, w13, w2), want, **BF16)


def test_batch_one_reads_only_the_selected_experts():
    """Poison every packed expert the token does not select: never read.  Poisoning a
    selected one shows (so the check can fail)."""
    x, weights, ids, w13, w2 = make(1)
    m = packed(w13, w2)
    want = m(x, weights, ids)
    chosen = set(ids[0].tolist())
    with torch.no_grad():
        for e in range(6):
            if e not in chosen:
                m.w13[e] = float("nan")
                m.w2[e] = float("nan")
    assert torch.equal(m(x, weights, ids), want)
    with torch.no_grad():
        m.w2[ids[0, 1]] = float("nan")
    assert torch.isnan(m(x, weights, ids)).all()


@pytest.mark.parametrize(
    "t,with_md,max_rows",
    [(0, True, 16), (1, True, 16), (9, False, 2)],  # empty; decode; groups above max_rows
)
def test_opcheck(t, with_md, max_rows):
    x, weights, ids, w13, w2 = make(t, experts=6, inter=96, seed=3)
    m = packed(w13, w2)
    mds = (m.w13_md, m.w2_md) if with_md else (None, None)
    args = (x, weights, ids, m.w13, m.w2, *mds, 96, max_rows)
    torch.library.opcheck(ops.fused_moe_packed.default, args)


def test_bad_shapes_are_named():
    x, weights, ids, w13, w2 = make(2)
    m = packed(w13, w2)
    meta = [t.to("meta") for t in (x, weights, ids, m.w13, m.w2)]
    with pytest.raises(ValueError, match="fused_moe_packed.*intermediate size 64"):
        fused_moe_packed(*meta, None, None, 64, 16)  # the fake checks the packed shapes
    with pytest.raises(TypeError, match="fused_moe_packed"):
        fused_moe_packed(x.float(), weights, ids, m.w13, m.w2, None, None, 72, 16)


def test_traces_with_a_symbolic_token_count():
    _, _, _, w13, w2 = make(1)
    m = packed(w13, w2)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def block(x, logits):
        w, i = topk_softmax_torch(logits, 2, True)
        return m(x, w.bfloat16(), i)

    compiled = torch.compile(block, backend=backend, fullgraph=True, dynamic=True)
    for t in (3, 11, 30):
        x, _, _, _, _ = make(t, seed=t)
        logits = torch.randn(t, 6)
        w, i = topk_softmax_torch(logits, 2, True)
        torch.testing.assert_close(compiled(x, logits), m(x, w.bfloat16(), i))
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("piecewise.fused_moe_packed" in t for t in targets) == 1


def test_each_stack_is_held_once_and_the_originals_released():
    x, weights, ids, w13, w2 = make(4)
    m = Experts(w13, w2)
    refs = [weakref.ref(m.w13), weakref.ref(m.w2)]
    method = PackedExpertsMethod(small_m.DEFAULT_MAX_ROWS)
    method.process(m)
    m.moe_method = method
    gc.collect()
    assert all(r() is None for r in refs), "the plain expert stacks must be released"
    tensors = list(m.parameters()) + [b for b in m.buffers() if b is not None]
    big = [t for t in tensors if t.numel() >= w2.numel()]
    assert sorted(t.shape for t in big) == sorted([m.w13.shape, m.w2.shape])
    assert m.w13.shape == (6, *small_m.panel_shape(144, H))
    assert m.w2.shape == (6, *small_m.panel_shape(H, 72))
    assert m.w13.untyped_storage().nbytes() == m.w13.numel() * 2
    got13, got2 = method.plain_weights(m)
    assert torch.equal(got13, w13) and torch.equal(got2, w2)
    assert torch.equal(unpack_experts(pack_experts(w2), H, 72), w2)
    # a second re-layout is refused (the stacks are no longer [E, N, K])
    assert not PackedExpertsMethod.applies_to(m, 16)
    torch.testing.assert_close(
        m(x, weights, ids), fused_moe_reference(x, weights, ids, w13, w2), **BF16
    )


def test_applies_only_to_bf16_float_experts_with_the_kernel_on():
    _, _, _, w13, w2 = make(1)
    assert not PackedExpertsMethod.applies_to(Experts(w13.float(), w2.float()), 16)
    assert not PackedExpertsMethod.applies_to(Experts(w13, w2), 0)
    quantized = Experts(w13, w2)
    quantized.moe_method = object()  # e.g. an int8 expert scheme took them
    assert not PackedExpertsMethod.applies_to(quantized, 16)
    with pytest.raises(ValueError, match="max_rows"):
        PackedExpertsMethod(0)
