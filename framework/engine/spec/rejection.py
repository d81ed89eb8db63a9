"""Exact verification of draft tokens (rejection sampling): the tokens a request keeps from a
verify step follow the target's distribution exactly, whatever the drafts were.

A verify chunk of request r has ``1 + m`` logits rows: row j (j < m) is the target's
distribution ``p_j`` of the token after the j-th query token, against which draft ``d_j`` is
checked; row m gives the bonus token when every draft is accepted.

* Greedy (temperature 0): accept ``d_j`` while it is the target's argmax; the first
  disagreement is replaced by the argmax (so the tokens are exactly those of plain greedy
  decoding), and when all m are accepted the argmax of row m is appended.
* Sampling: ``p_j`` is the target's *processed* distribution (temperature, top-k, top-p,
  min-p exactly as :func:`framework.engine.sampler.process_logits` applies them).  Draft
  ``d_j`` drawn from ``q_j`` is accepted with probability ``min(1, p_j(d)/q_j(d))``; on the
  first rejection a token is drawn from ``norm(max(p_j - q_j, 0))`` and the step ends.  For a
  deterministic draft (n-gram lookup; any proposer that gives no q) ``q_j`` is one-hot: accept
  with probability ``p_j(d)``, else draw from p_j without d.  Every kept token then has the
  target's distribution (Leviathan et al. 2023, Chen et al. 2023).

Randomness is the sampler's counter-based noise: output index ``i`` of a request draws its
race noise from ``(seed, i)``, as the plain sampler does.  A one-hot draft is checked against
that draw itself (:func:`one_hot_accepts`): the target draws its token ``t`` at index ``i``
exactly as it would without speculation, and the draft is accepted when ``t == d``.  That is
the rule above with one coupling of its randomness: ``P(t == d) = p(d)``, and on a rejection
``t`` is distributed as p without d, renormalised.  So the kept tokens never depend on the
drafts: a seeded request gets the same tokens whatever the batch, after a preemption, with
or without drafts at any position (a step whose drafts were held back, k changed).  A draft
drawn from q (a sampling draft model) takes ``min(1, p/q)`` against a uniform from
``(seed, i + ACCEPT_STREAM)`` and the residual race; its tokens are reproducible for the same
drafts (the draft's own noise is keyed by the seed too), but a step that gives a request fewer
drafts (``draft_rows_limit``, a full draft cache) changes the draws after it.
Penalties and logprobs are refused with speculation (``framework.engine.spec.decoder``).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from framework.engine.request import Request
from framework.engine.sampler import NON_FINITE, greedy_argmax, process_logits, uniform_noise

ACCEPT_STREAM = 1 << 31
"""Offset of the output index that keys a position's acceptance uniform (its race noise uses
the index itself): the two never collide for outputs shorter than 2**31 tokens."""


def accept_probability(p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """``min(1, p(d) / q(d))`` per row of a draft drawn from q (a one-hot draft is checked by
    :func:`one_hot_accepts` instead)."""
    return (p_draft / q_draft).clamp(max=1.0)


def one_hot_accepts(draw: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """A one-hot draft's acceptance: the target's own draw at its index is the draft (an
    event of probability ``p(d)``; on a rejection the draw is the kept token)."""
    return draw == draft


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``max(p - q, 0)`` (unnormalised: the race below is scale-free); with q = 0 (the bonus
    row) it is p itself."""
    return (p - q).clamp_min(0.0)


class RejectionSampler:
    """``verify(logits, reqs, drafts, draft_probs, argmax)`` -> kept tokens per request.

    ``logits``: ``[sum(1 + len(d)), vocab]``, each request's rows consecutive, in order;
    ``draft_probs[i]``: None (one-hot q) or ``[len(drafts[i]), vocab]`` probabilities;
    ``argmax``: each row's first maximum and maximum where the caller has them already (the
    LM head's greedy kernel), else None (computed here, from ``logits``).
    Returns per request the accepted drafts plus one token of the target's (1 to
    ``1 + len(d)`` tokens), or None when the request failed alone (non-finite logits:
    :meth:`Request.fail`)."""

    def __call__(
        self,
        logits: torch.Tensor,
        reqs: Sequence[Request],
        drafts: Sequence[Sequence[int]],
        draft_probs: Optional[Sequence[Optional[torch.Tensor]]] = None,
        argmax: Optional[tuple[list[int], list[float]]] = None,
    ) -> list[Optional[list[int]]]:
        if len(reqs) != len(drafts):
            raise ValueError(f"verify: {len(reqs)} requests but {len(drafts)} draft lists")
        n_rows = [1 + len(d) for d in drafts]
        if logits.shape[0] != sum(n_rows):
            raise ValueError(
                f"verify: {logits.shape[0]} logits rows for {sum(n_rows)} query positions"
            )
        starts = [0]
        for n in n_rows:
            starts.append(starts[-1] + n)
        # As the sampler's greedy path picks its argmax: on the logits as they lie (an fp32
        # copy of a b8, k = 4 verify step's 40 x 32000 bf16 logits cost ~0.4 ms), fp32 only
        # for the sampling rows below.
        first, maxes = greedy_argmax(logits) if argmax is None else argmax
        if len(first) != logits.shape[0] or len(maxes) != logits.shape[0]:
            raise ValueError(
                f"verify: {len(first)} argmaxes and {len(maxes)} maxima for "
                f"{logits.shape[0]} logits rows"
            )
        ok = []
        for i, r in enumerate(reqs):
            good = all(math.isfinite(v) for v in maxes[starts[i] : starts[i + 1]])
            if not good:
                r.fail(NON_FINITE)
            ok.append(good)
        sampled = [i for i, r in enumerate(reqs) if ok[i] and not r.params.greedy]
        drawn: dict[int, list[int]] = {}
        accepted: dict[int, list[bool]] = {}
        if sampled:
            drawn, accepted = self._sample_rows(logits, reqs, drafts, draft_probs, starts, sampled)
        out: list[Optional[list[int]]] = []
        for i, (r, d) in enumerate(zip(reqs, drafts)):
            if not ok[i]:
                out.append(None)
                continue
            base = starts[i]
            kept: list[int] = []
            for j, tok in enumerate(d):
                if r.params.greedy:
                    target = first[base + j]
                    if target != tok:
                        kept.append(target)
                        break
                elif not accepted[i][j]:
                    kept.append(drawn[i][j])
                    break
                kept.append(int(tok))
            else:  # every draft accepted: the bonus token
                kept.append(first[base + len(d)] if r.params.greedy else drawn[i][len(d)])
            out.append(kept)
        return out

    @staticmethod
    def _sample_rows(logits, reqs, drafts, draft_probs, starts, which):
        """For the sampling requests ``which``: per row, the acceptance decision of its draft
        and the token drawn from the residual (the plain distribution on the bonus row); their
        rows of ``logits`` read as fp32."""
        dev, vocab = logits.device, logits.shape[-1]
        rows, params, seeds, steps, draft_tok = [], [], [], [], []
        for i in which:
            r, d = reqs[i], drafts[i]
            for j in range(len(d) + 1):
                rows.append(starts[i] + j)
                params.append(r.params)
                seeds.append(r.seed)
                steps.append(len(r.output) + j)
                draft_tok.append(int(d[j]) if j < len(d) else -1)
        xp, _ = process_logits(logits[rows].float(), params)
        p = xp.softmax(dim=-1)
        m = len(rows)
        tok = torch.tensor(draft_tok, dtype=torch.int64, device=dev)
        has_draft = tok >= 0
        safe_tok = tok.clamp_min(0)
        # q rows of the sampled drafts; a one-hot draft's row stays zero (its residual race is
        # the plain draw from p, against which one_hot_accepts checks it)
        q = torch.zeros(m, vocab, dtype=p.dtype, device=dev)
        one_hot = torch.zeros(m, dtype=torch.bool, device=dev)
        at = 0
        for i in which:
            nd = len(drafts[i])
            qi = draft_probs[i] if draft_probs is not None else None
            if qi is None:
                one_hot[at : at + nd] = True
            else:
                if tuple(qi.shape) != (nd, vocab):
                    raise ValueError(
                        f"verify: request {reqs[i].req_id}: draft probabilities of shape "
                        f"{tuple(qi.shape)}, expected ({nd}, {vocab})"
                    )
                q[at : at + nd] = qi.to(device=dev, dtype=p.dtype)
            at += nd + 1
        seeds_t = torch.tensor(seeds, device=dev)
        steps_t = torch.tensor(steps, device=dev)
        p_d = p.gather(-1, safe_tok[:, None])[:, 0]
        q_d = q.gather(-1, safe_tok[:, None])[:, 0]
        u = uniform_noise(seeds_t, steps_t + ACCEPT_STREAM, vocab, safe_tok[:, None])[:, 0]
        # q(d) = 0 would mean a draft its own distribution could not produce: reject it.
        prob = torch.where(q_d > 0, accept_probability(p_d, q_d.clamp_min(1e-30)), 0.0)
        noise = uniform_noise(seeds_t, steps_t, vocab)
        race = residual(p, q) / -noise.log()
        draw = race.argmax(dim=-1)
        acc = torch.where(one_hot, one_hot_accepts(draw, tok), u < prob) & has_draft
        got = draw.tolist()
        acc_l = acc.tolist()
        drawn, accepted = {}, {}
        at = 0
        for i in which:
            n = len(drafts[i]) + 1
            drawn[i] = got[at : at + n]
            accepted[i] = acc_l[at : at + n]
            at += n
        return drawn, accepted
