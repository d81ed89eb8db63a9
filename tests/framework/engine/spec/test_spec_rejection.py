"""Rejection sampling: greedy acceptance, and the sampled tokens' distribution equals the
target's (chi-square), which a deliberately wrong acceptance rule fails."""

import numpy as np
import pytest
import torch

from framework.engine.request import Request
from framework.engine.sampler import Sampler, process_logits
from framework.engine.sampling_params import SamplingParams
from framework.engine.spec import rejection
from framework.engine.spec.rejection import RejectionSampler

V = 12


def req(seed, params, output=()):
    r = Request(seed, [1, 2, 3], max_new_tokens=64, params=params, seed=seed)
    r.output = list(output)
    return r


def test_greedy_accepts_while_argmax_agrees():
    logits = torch.full((4, V), -1.0)
    for row, tok in enumerate([5, 6, 1, 9]):
        logits[row, tok] = 3.0
    verify = RejectionSampler()
    g = SamplingParams()
    assert verify(logits, [req(0, g)], [[5, 6, 1]]) == [[5, 6, 1, 9]]  # all + bonus
    assert verify(logits, [req(0, g)], [[5, 7, 1]]) == [[5, 6]]  # second rejected
    assert verify(logits, [req(0, g)], [[4, 6, 1]]) == [[5]]
    assert verify(logits[:1], [req(0, g)], [[]]) == [[5]]
    # Two requests, rows consecutive.
    two = verify(logits, [req(0, g), req(1, g)], [[5], [2]])
    assert two == [[5, 6], [1]]  # request 1: rows 2-3, its draft 2 is not the argmax 1
    assert verify(logits, [req(0, g), req(1, g)], [[5], [1]]) == [[5, 6], [1, 9]]


def test_greedy_verify_reads_the_argmaxes_it_is_given():
    """A caller that has each row's first maximum and maximum already (the LM head's greedy
    kernel) passes them: the verify decides from them, not from the logits; a count that is
    not the logits' rows is refused."""
    logits = torch.full((4, V), -1.0)
    for row, tok in enumerate([5, 6, 1, 9]):
        logits[row, tok] = 3.0
    verify = RejectionSampler()
    g = SamplingParams()
    given = ([5, 7, 1, 9], [3.0, 3.0, 3.0, 3.0])  # row 1 says 7 (the logits say 6)
    assert verify(logits, [req(0, g)], [[5, 7, 1]], None, given) == [[5, 7, 1, 9]]
    assert verify(logits, [req(0, g)], [[5, 6, 1]], None, given) == [[5, 7]]
    nan = ([5, 6, 1, 9], [3.0, float("nan"), 3.0, 3.0])
    r = req(0, g)
    assert verify(logits, [r], [[5, 6, 1]], None, nan) == [None] and r.finished
    with pytest.raises(ValueError, match="3 argmaxes and 3 maxima for 4 logits rows"):
        verify(logits, [req(0, g)], [[5, 6, 1]], None, ([5, 6, 1], [3.0] * 3))


def test_non_finite_rows_fail_their_request_alone():
    logits = torch.zeros(3, V)
    logits[1, 0] = float("nan")
    a, b = req(0, SamplingParams()), req(1, SamplingParams())
    got = RejectionSampler()(logits, [a, b], [[3], []])
    assert got[0] is None and a.finish_reason == "error" and got[1] == [0]


def chi_square_p(counts_a, counts_b) -> float:
    """p-value of Pearson's chi-square test that two count vectors share one distribution
    (a 2 x m contingency table; the upper regularized incomplete gamma gives the tail)."""
    table = np.array([counts_a, counts_b], dtype=np.float64)
    table = table[:, table.sum(axis=0) > 0]
    rare = table.sum(axis=0) < 10  # pooled into one cell: the approximation needs counts
    if rare.any():
        table = np.concatenate([table[:, ~rare], table[:, rare].sum(axis=1, keepdims=True)], 1)
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    df = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


PARAMS = SamplingParams(temperature=0.8, top_p=0.9)


def _target_logits():
    g = torch.Generator().manual_seed(3)
    return torch.randn(V, generator=g) * 1.5


def _spec_first_tokens(n, draft):
    """The first kept token of n seeded verify steps of one draft against the target."""
    x = _target_logits()
    logits = x.expand(n * 2, V).clone()  # per request: the draft row and the bonus row
    reqs = [req(s, PARAMS) for s in range(n)]
    got = RejectionSampler()(logits, reqs, [[draft]] * n)
    return [g[0] for g in got]


def test_one_hot_rule_keeps_the_target_distribution_and_always_accept_fails(monkeypatch):
    n = 4000
    x = _target_logits()
    p = process_logits(x[None], [PARAMS])[0][0].softmax(-1)
    draft = int(torch.argsort(p)[-3])  # a plausible, not the likeliest, token
    assert 0.05 < float(p[draft]) < 0.5
    # Reference: the plain sampler, n seeded requests.
    plain = Sampler()(x.expand(n, V).clone(), [req(s + 10**6, PARAMS) for s in range(n)])[0]
    ref = np.bincount(plain, minlength=V)
    spec = np.bincount(_spec_first_tokens(n, draft), minlength=V)
    assert chi_square_p(ref, spec) > 1e-3
    # A wrong rule (always accept the draft) is detected.
    monkeypatch.setattr(rejection, "one_hot_accepts", lambda draw, d: torch.ones_like(draw > 0))
    wrong = np.bincount(_spec_first_tokens(n, draft), minlength=V)
    assert chi_square_p(ref, wrong) < 1e-6
    # So is "accept with probability p(d) by a uniform of its own, else keep the target's
    # draw": right acceptance rate, but a rejection can keep the draft itself.
    monkeypatch.undo()
    coin = torch.Generator().manual_seed(5)
    monkeypatch.setattr(
        rejection,
        "one_hot_accepts",
        lambda draw, d: torch.rand(draw.shape, generator=coin) < float(p[draft]),
    )
    wrong = np.bincount(_spec_first_tokens(n, draft), minlength=V)
    assert chi_square_p(ref, wrong) < 1e-6


def test_one_hot_drafts_never_change_a_seeded_requests_tokens():
    """A one-hot draft is checked against the target's own draw at its index: the kept tokens
    are the plain sampler's draws, token for token, whatever drafts (or none) were offered."""
    x = torch.randn(5, V, generator=torch.Generator().manual_seed(4))
    for seed in range(40):
        plain = []
        for j in range(5):  # the plain sampler's draws at output indices 0..4
            r = req(seed, PARAMS, output=plain)
            plain.append(Sampler()(x[j : j + 1].clone(), [r])[0][0])
        for drafts in ([], plain[:4], plain[:2] + [(plain[2] + 1) % V, 0], [(plain[0] + 3) % V]):
            got = RejectionSampler()(x[: len(drafts) + 1].clone(), [req(seed, PARAMS)], [drafts])
            kept = got[0]
            assert kept == plain[: len(kept)], (seed, drafts, kept, plain)
            assert len(kept) == 1 + next(
                (j for j, d in enumerate(drafts) if d != plain[j]), len(drafts)
            )


def test_draft_distribution_rule_keeps_the_target_distribution(monkeypatch):
    """A sampled draft (q not one-hot): accept with min(1, p/q), else norm(max(p - q, 0));
    always accepting, or drawing from p instead of the residual, is detected."""
    n = 4000
    x = _target_logits()
    q = torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(9)), -1)
    g = torch.Generator().manual_seed(1)
    drafts = torch.multinomial(q, n, replacement=True, generator=g).tolist()
    logits = x.expand(2 * n, V).clone()
    reqs = [req(s, PARAMS) for s in range(n)]

    def first_tokens():
        got = RejectionSampler()(logits, reqs, [[d] for d in drafts], [q[None]] * n)
        return np.bincount([t[0] for t in got], minlength=V)

    plain = Sampler()(x.expand(n, V).clone(), [req(s + 10**6, PARAMS) for s in range(n)])[0]
    ref = np.bincount(plain, minlength=V)
    assert chi_square_p(ref, first_tokens()) > 1e-3
    monkeypatch.setattr(rejection, "accept_probability", lambda p, q: torch.ones_like(p))
    assert chi_square_p(ref, first_tokens()) < 1e-6
    monkeypatch.undo()
    monkeypatch.setattr(rejection, "residual", lambda p, q: p)
    assert chi_square_p(ref, first_tokens()) < 1e-6


def test_seeded_rows_do_not_depend_on_the_batch():
    x = torch.randn(6, V, generator=torch.Generator().manual_seed(0))
    a = req(7, PARAMS, output=[4, 4])
    alone = RejectionSampler()(x[:3], [a], [[1, 2]])
    b = req(8, PARAMS)
    batched = RejectionSampler()(
        torch.cat([x[3:], x[:3]]), [b, req(7, PARAMS, [4, 4])], [[3, 3], [1, 2]]
    )
    assert batched[1] == alone[0]


def test_bad_draft_probability_shape_is_named():
    with pytest.raises(ValueError, match="draft probabilities of shape"):
        RejectionSampler()(torch.zeros(2, V), [req(0, PARAMS)], [[1]], [torch.zeros(2, V)])
