"""piecewise::fused_moe and piecewise::topk_softmax: the grouped CPU kernel against the
per-expert oracle and against transformers' own expert loop, opcheck, a symbolic trace, and
that at batch 1 only the selected experts' weights are read."""

import pytest
import torch

import passes.ops  # noqa: F401  (registers the ops)
from passes.ops.moe import fused_moe_grouped, fused_moe_reference, topk_softmax_torch

ops = torch.ops.piecewise
E, K, H, I = 6, 2, 40, 72  # noqa: E741


def make(t, dtype=torch.float32, seed=0, experts=E):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).to(dtype)
    logits = torch.randn(t, experts, generator=g).to(dtype)
    w13 = (0.1 * torch.randn(experts, 2 * I, H, generator=g)).to(dtype)
    w2 = (0.1 * torch.randn(experts, H, I, generator=g)).to(dtype)
    weights, ids = topk_softmax_torch(logits, K, True)
    return x, weights, ids, w13, w2


def hf_expert_loop(x, weights, ids, w13, w2):
    """transformers' Qwen3MoeExperts.forward (5.x), written out."""
    out = torch.zeros_like(x)
    mask = torch.nn.functional.one_hot(ids, num_classes=w13.shape[0]).permute(2, 1, 0)
    for e in range(w13.shape[0]):
        pos, tok = torch.where(mask[e])
        if tok.numel() == 0:
            continue
        gate, up = torch.nn.functional.linear(x[tok], w13[e]).chunk(2, dim=-1)
        h = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[e])
        out.index_add_(0, tok, (h * weights[tok, pos, None]).to(out.dtype))
    return out


@pytest.mark.parametrize("t", [1, 3, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_kernel_matches_oracle_and_transformers(t, dtype):
    x, weights, ids, w13, w2 = make(t, dtype)
    weights = weights.to(dtype)
    got = ops.fused_moe(x, weights, ids, w13, w2)
    assert got.shape == (t, H) and got.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, fused_moe_reference(x, weights, ids, w13, w2), **tol)
    torch.testing.assert_close(got, hf_expert_loop(x, weights, ids, w13, w2), **tol)


def test_fp32_routing_weights_with_a_bf16_model():
    """Mixtral keeps its routing weights fp32 while the experts run in bf16."""
    x, weights, ids, w13, w2 = make(9, torch.bfloat16)
    got = ops.fused_moe(x, weights, ids, w13, w2)
    want = hf_expert_loop(x, weights, ids, w13, w2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_batch_one_reads_only_the_selected_experts():
    """Poison every expert the token does not select: the grouped kernel never reads them.
    Poisoning a selected one does show up (so the check can fail)."""
    x, weights, ids, w13, w2 = make(1)
    chosen = set(ids[0].tolist())
    w13p, w2p = w13.clone(), w2.clone()
    for e in range(E):
        if e not in chosen:
            w13p[e], w2p[e] = float("nan"), float("nan")
    got = ops.fused_moe(x, weights, ids, w13p, w2p)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, fused_moe_reference(x, weights, ids, w13, w2))
    w13p[ids[0, 0]] = float("nan")
    assert torch.isnan(ops.fused_moe(x, weights, ids, w13p, w2p)).all()


def test_unrenormalised_topk_and_routing_by_expert_order():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, E, generator=g)
    w, i = ops.topk_softmax(logits, 2, False)
    probs = torch.softmax(logits, -1)
    ref_w, ref_i = torch.topk(probs, 2, -1)
    assert torch.equal(i, ref_i) and i.dtype == torch.int64
    torch.testing.assert_close(w, ref_w)
    w, _ = ops.topk_softmax(logits.bfloat16(), 2, True)
    assert w.dtype == torch.float32
    torch.testing.assert_close(w.sum(-1), torch.ones(7))


def test_empty_batch_and_bad_shapes():
    x, weights, ids, w13, w2 = make(0)
    assert ops.fused_moe(x, weights, ids, w13, w2).shape == (0, H)
    x, weights, ids, w13, w2 = make(2)
    with pytest.raises(ValueError, match="shapes disagree"):
        ops.fused_moe(x, weights, ids, w13, w2[:, :, :-1])


def test_opcheck():
    x, weights, ids, w13, w2 = make(5)
    torch.library.opcheck(ops.fused_moe.default, (x, weights, ids, w13, w2))
    torch.library.opcheck(ops.topk_softmax.default, (torch.randn(5, E), 2, True))


def test_traces_with_a_symbolic_token_count():
    """One dynamic-shape compile serves several token counts; the op stays opaque."""
    _, _, _, w13, w2 = make(1)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def block(x, logits):
        w, i = topk_softmax_torch(logits, K, True)
        return ops.fused_moe(x, w, i, w13, w2)

    compiled = torch.compile(block, backend=backend, fullgraph=True, dynamic=True)
    for t in (3, 11):
        x, _, _, _, _ = make(t, seed=t)
        logits = torch.randn(t, E)
        w, i = topk_softmax_torch(logits, K, True)
        torch.testing.assert_close(compiled(x, logits), fused_moe_grouped(x, w, i, w13, w2))
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("piecewise.fused_moe" in t for t in targets) == 1


def _quantized(w):
    """Per-row symmetric int8 of a stacked ``[E, N, K]`` weight."""
    scale = (w.abs().amax(-1) / 127).clamp(min=1e-8)
    return (w / scale.unsqueeze(-1)).round().clamp(-128, 127).to(torch.int8), scale


@pytest.mark.parametrize("t", [1, 5, 33])
@pytest.mark.parametrize("quantize_activations", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_experts_match_their_oracle(t, quantize_activations, dtype):
    from passes.ops.moe import fused_moe_int8_reference

    x, weights, ids, w13, w2 = make(t, dtype)
    w13_q, w13_s = _quantized(w13.float())
    w2_q, w2_s = _quantized(w2.float())
    args = (x, weights, ids, w13_q, w13_s, w2_q, w2_s, quantize_activations)
    got = ops.fused_moe_int8(*args)
    assert got.dtype == dtype and got.shape == (t, H)
    tol = dict(atol=2e-3, rtol=1e-2) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got, fused_moe_int8_reference(*args), **tol)
    # and close to the float experts it quantizes
    ref = fused_moe_reference(x.float(), weights, ids, w13.float(), w2.float())
    assert (got.float() - ref).abs().max() < 0.05 * ref.abs().max() + 1e-2


@pytest.mark.parametrize("quantize_activations", [False, True])
def test_int8_opcheck(quantize_activations):
    x, weights, ids, w13, w2 = make(5)
    w13_q, w13_s = _quantized(w13)
    w2_q, w2_s = _quantized(w2)
    args = (x, weights, ids, w13_q, w13_s, w2_q, w2_s, quantize_activations)
    torch.library.opcheck(ops.fused_moe_int8.default, args)
