"""The piecewise::attention op and the plain-torch paged backend: mixed prefill+decode
batches, GQA, sliding windows, padding, opcheck."""

import math

import pytest
import torch

import backends.attention  # noqa: F401  (registers the op)
from framework.core.attention_metadata import AttentionMetadata
from framework.core.forward_context import ForwardContext, set_forward_context

HQ, HKV, D, BS, NB = 4, 2, 16, 4, 32


def reference(q_all, k_all, v_all, window):
    """Dense causal attention of one request over its whole history [L, H, D]."""
    L = q_all.shape[0]
    k = k_all.repeat_interleave(HQ // HKV, 1)
    v = v_all.repeat_interleave(HQ // HKV, 1)
    s = torch.einsum("qhd,khd->hqk", q_all, k) / math.sqrt(D)
    pos = torch.arange(L)
    mask = pos[None, :] <= pos[:, None]
    if window > 0:
        mask &= pos[None, :] > pos[:, None] - window
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def run_steps(histories, steps, window=-1, pad=0):
    """Feed each request's tokens in the given chunk sizes, all requests in one batch per
    step; returns the op's outputs per request, concatenated over steps."""
    kv = torch.zeros(2, NB, BS, HKV, D)
    blocks = {r: list(range(1 + 8 * r, 9 + 8 * r)) for r in range(len(histories))}
    done = [0] * len(histories)
    outs = [[] for _ in histories]
    for sizes in steps:
        qs, ks, vs, slots, qsl, lens, table = [], [], [], [], [0], [], []
        active = [r for r, n in enumerate(sizes) if n]
        for r in active:
            n = sizes[r]
            q, k, v = histories[r]
            sl = slice(done[r], done[r] + n)
            qs.append(q[sl])
            ks.append(k[sl])
            vs.append(v[sl])
            slots += [blocks[r][p // BS] * BS + p % BS for p in range(done[r], done[r] + n)]
            done[r] += n
            qsl.append(qsl[-1] + n)
            lens.append(done[r])
            table.append(blocks[r])
        q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
        n_real = q.shape[0]
        if pad:
            q, k, v = (torch.cat([t, torch.randn(pad, *t.shape[1:])]) for t in (q, k, v))
            slots += [-1] * pad
        out = torch.full_like(q, float("nan"))
        md = AttentionMetadata(
            "torch",
            n_real,
            len(active),
            max(sizes),
            max(lens),
            torch.tensor(qsl, dtype=torch.int32),
            torch.tensor(lens, dtype=torch.int32),
            torch.tensor(table, dtype=torch.int32),
            torch.tensor(slots),
            qsl,
            lens,
        )
        with set_forward_context(ForwardContext({"l": md}, {"l": kv})):
            torch.ops.piecewise.attention(q, k, v, out, "l", 1 / math.sqrt(D), window)
        if pad:
            assert torch.equal(out[n_real:], torch.zeros_like(out[n_real:]))
        for i, r in enumerate(active):
            outs[r].append(out[qsl[i] : qsl[i + 1]])
    return [torch.cat(o) for o in outs]


@pytest.mark.parametrize("window", [-1, 3])
def test_mixed_prefill_and_decode_batches_match_dense(window):
    torch.manual_seed(0)
    lengths = [9, 5, 7]
    hist = [
        (torch.randn(n, HQ, D), torch.randn(n, HKV, D), torch.randn(n, HKV, D)) for n in lengths
    ]
    # step 1: two prefills (one chunked); step 2: chunk + decode + new prefill; then decodes
    steps = [[6, 4, 0], [2, 1, 5], [1, 0, 1], [0, 0, 1]]
    outs = run_steps(hist, steps, window, pad=3)
    for (q, k, v), out in zip(hist, outs):
        torch.testing.assert_close(out, reference(q, k, v, window), atol=1e-5, rtol=1e-5)


def test_batched_decode_path_matches_dense():
    torch.manual_seed(1)
    hist = [
        (torch.randn(n, HQ, D), torch.randn(n, HKV, D), torch.randn(n, HKV, D)) for n in (6, 3, 9)
    ]
    steps = [[5, 2, 8], [1, 1, 1]]  # the second step is pure decode (batched path)
    outs = run_steps(hist, steps)
    for (q, k, v), out in zip(hist, outs):
        torch.testing.assert_close(out, reference(q, k, v, -1), atol=1e-5, rtol=1e-5)


def test_opcheck_and_missing_metadata():
    q, k, v = torch.randn(3, HQ, D), torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    out = torch.empty_like(q)
    kv = torch.zeros(2, NB, BS, HKV, D)
    md = AttentionMetadata(
        "torch",
        3,
        1,
        3,
        3,
        torch.tensor([0, 3], dtype=torch.int32),
        torch.tensor([3], dtype=torch.int32),
        torch.tensor([[1]], dtype=torch.int32),
        torch.tensor([4, 5, 6]),
        [0, 3],
        [3],
    )
    with set_forward_context(ForwardContext({"l": md}, {"l": kv})):
        torch.library.opcheck(torch.ops.piecewise.attention.default, (q, k, v, out, "l", 0.25, -1))
        with pytest.raises(RuntimeError, match="no attention metadata for layer 'other'"):
            torch.ops.piecewise.attention(q, k, v, out, "other", 0.25, -1)


def test_reading_the_context_outside_a_forward_is_a_clear_error():
    q = torch.randn(1, HQ, D)
    with pytest.raises(RuntimeError, match="no forward context is set"):
        torch.ops.piecewise.attention(q, q[:, :HKV], q[:, :HKV], torch.empty_like(q), "l", 0.25, -1)
