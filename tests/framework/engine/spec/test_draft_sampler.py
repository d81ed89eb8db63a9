"""The draft's sampler on its own (``framework.engine.spec.draft_sampler``): greedy rows
take the argmax, sampling rows draw from q under their own parameters, reproducibly per
(seed, output index), and a non-finite row drafts nothing."""

import torch

from framework.engine.request import Request
from framework.engine.sampling_params import SamplingParams
from framework.engine.spec.draft_sampler import DraftSampler

VOCAB = 50


def logits(rows, seed=0):
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)).bfloat16()


def req(i, **params):
    return Request(i, [1, 2, 3], max_new_tokens=16, params=SamplingParams(**params), seed=1000 + i)


def test_greedy_rows_take_the_argmax_and_keep_no_q():
    x = logits(3)
    tokens, logprobs = DraftSampler()(x, [req(i) for i in range(3)])
    assert tokens == x.float().argmax(-1).tolist() and logprobs is None
    s = DraftSampler()
    s(x, [req(0)])
    assert s.last_probs is None


def test_sampling_rows_draw_from_their_own_q_reproducibly():
    x = logits(2, seed=1)
    reqs = [req(0), req(1, temperature=0.8, top_k=5)]
    s = DraftSampler()
    first, _ = s(x, reqs)
    q = s.last_probs
    assert q.shape == (2, VOCAB) and q.dtype == torch.float32
    assert torch.allclose(q.sum(-1), torch.ones(2))
    assert (q[1] > 0).sum() == 5  # top-k 5 of the sampling row
    assert q[1, first[1]] > 0  # the drawn token is one q can produce
    assert first[0] == x[0].float().argmax().item()  # the greedy row in a mixed batch
    again, _ = DraftSampler()(x, reqs)
    assert again == first  # the same (seed, output index): the same draw
    # another batch around the sampling request does not change its draw
    alone, _ = DraftSampler()(x[1:], reqs[1:])
    assert alone == first[1:]


def test_the_draw_follows_the_output_index():
    x = logits(1, seed=2).expand(64, VOCAB).contiguous()
    reqs = []
    for i in range(64):  # one request at 64 output positions
        r = req(7, temperature=1.0)
        r.output = [0] * i
        reqs.append(r)
    tokens, _ = DraftSampler()(x, reqs)
    assert len(set(tokens)) > 1  # different positions, different noise


def test_a_non_finite_row_drafts_nothing():
    x = logits(2)
    x[1] = float("nan")
    tokens, _ = DraftSampler()(x, [req(0), req(1)])
    assert tokens[0] is not None and tokens[1] is None
