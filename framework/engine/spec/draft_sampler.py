"""How a draft model picks its drafts: the argmax for greedy requests, a draw from its own
distribution q (the request's temperature, top-k, top-p and min-p; no penalties) for the
others, with counter-based noise so drafts are reproducible whatever else is in the batch.
q is kept for the rejection sampler (:mod:`framework.engine.spec.rejection`), which accepts a
draft d with probability ``min(1, p(d) / q(d))``: any q keeps the output exact, only the
acceptance depends on it.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

from framework.engine.request import Request
from framework.engine.sampler import apply_min_p, apply_top_k, apply_top_p, uniform_noise


class DraftSampler:
    """The draft runner's sampler: ``(logits, reqs) -> (tokens, None)``; keeps, for the
    sampling (non-greedy) rows, the distribution q each token was drawn from in
    :attr:`last_probs` (``[rows, vocab]`` float32, None when every row is greedy).  A row whose
    logits are not finite gets ``None`` (the request drafts no further) and fails nothing.

    :meth:`pick` is the same rule on tensors (no host sync), for the draft's step loop."""

    def __init__(self) -> None:
        self.last_probs: Optional[torch.Tensor] = None

    def __call__(self, logits: torch.Tensor, reqs: Sequence[Request]):
        params = [r.params for r in reqs]
        greedy = all(p.greedy for p in params)
        seeds = steps = None
        if not greedy:
            seeds = torch.tensor([r.seed for r in reqs], device=logits.device)
            steps = torch.tensor([len(r.output) for r in reqs], device=logits.device)
        tok, values, self.last_probs = self.pick(logits, params, greedy, seeds, steps)
        return self._tokens(tok, values), None

    def from_argmax(self, tokens: torch.Tensor, maxima: torch.Tensor) -> list[Optional[int]]:
        """The drafts of an all-greedy batch from each row's first maximum and its value,
        computed elsewhere (the LM head's greedy kernel): what ``__call__`` returns for the
        logits, with no q kept."""
        self.last_probs = None
        return self._tokens(tokens, maxima)

    @staticmethod
    def _tokens(tokens: torch.Tensor, maxima: torch.Tensor) -> list[Optional[int]]:
        """``tokens`` as ints, None where the row's maximum is not finite."""
        return [t if math.isfinite(v) else None for t, v in zip(tokens.tolist(), maxima.tolist())]

    def pick(
        self,
        logits: torch.Tensor,
        params: Sequence[Any],
        greedy: bool,
        seeds: Optional[torch.Tensor],
        steps: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """``(tokens, row maxima, q)`` for ``logits`` ``[rows, vocab]``: the argmax for greedy
        rows, a draw from q (noise keyed by ``seeds`` and the output index ``steps``) for
        the others; q is None when ``greedy`` (every row greedy).  A row whose maximum is not
        finite must be dropped by the caller."""
        x = logits.float()  # an fp32 max is exact for bf16 values and faster than bf16's
        values, argmax = x.max(dim=-1)
        if greedy:
            return argmax, values, None
        probs = self._distribution(x, params)
        noise = uniform_noise(seeds, steps, x.shape[-1])
        drawn = (probs / -noise.log()).argmax(dim=-1)
        mask = torch.tensor([p.greedy for p in params], device=x.device)
        return torch.where(mask, argmax, drawn), values, probs

    @staticmethod
    def _distribution(x: torch.Tensor, params) -> torch.Tensor:
        dev = x.device
        f32 = dict(dtype=torch.float32, device=dev)
        temp = torch.tensor([p.temperature or 1.0 for p in params], **f32)
        x = x / temp[:, None]
        if any(p.top_k > 0 for p in params):
            x = apply_top_k(x, torch.tensor([p.top_k for p in params], device=dev))
        if any(p.top_p < 1 for p in params):
            x = apply_top_p(x, torch.tensor([p.top_p for p in params], **f32))
        if any(p.min_p > 0 for p in params):
            x = apply_min_p(x, torch.tensor([p.min_p for p in params], **f32))
        return x.softmax(dim=-1)


__all__ = ["DraftSampler"]
