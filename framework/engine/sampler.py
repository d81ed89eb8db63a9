"""One batched sampler for a step: penalties, temperature, top-k, top-p, min-p, sampling,
log-probabilities, as tensor ops over the whole batch (per-row parameters as tensors).

A batch of greedy requests without penalties or logprobs takes the fast path: one vectorised
argmax over the rows read as fp32 (:func:`greedy_argmax`), as before sampling existed.

Randomness is counter-based: the noise of a row is a hash of (request seed, output index,
vocabulary index), so a seeded request draws the same tokens whatever else is in the batch,
and a preempted request redraws the same tokens when it is recomputed.  Sampling uses the
exponential race (argmax of p / E with E ~ Exp(1)), which picks token i with probability p_i.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import numpy as np
import torch

from framework.engine import greedy_native
from framework.engine.request import Request

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x < 2**32 held in int64, without int64 overflow."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser (a bijection with full avalanche)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


@functools.lru_cache(maxsize=8)
def _vocab_keys(vocab_size: int, device: torch.device) -> torch.Tensor:
    return _mul32(torch.arange(vocab_size, dtype=torch.int64, device=device), 0x9E3779B1)


def _row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    seeds = seeds.to(torch.int64)
    key = _fmix32((steps.to(torch.int64) + 0x9E3779B9) & _M32)
    key = _fmix32(key ^ ((seeds >> 32) & _M32))
    return _fmix32(key ^ (seeds & _M32))


def _uniform(key: torch.Tensor, idx_keys: torch.Tensor) -> torch.Tensor:
    h = _fmix32(_fmix32(key[:, None] ^ idx_keys) ^ key[:, None])
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def uniform_noise(
    seeds: torch.Tensor,
    steps: torch.Tensor,
    vocab_size: int,
    indices: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Float32 uniforms in (0, 1), a pure function of (seed, step, vocabulary index):
    ``[n, vocab]``, or ``[n, m]`` for the vocabulary ``indices`` ``[n, m]`` only."""
    vocab_keys = _vocab_keys(vocab_size, seeds.device)
    idx = vocab_keys[None, :] if indices is None else vocab_keys[indices]
    return _uniform(_row_keys(seeds, steps), idx)


# ---------------------------------------------------------------------- logits processors
def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """Repetition penalty (transformers' rule, over prompt and output tokens), then OpenAI's
    presence and frequency penalties (over output tokens)."""
    seen = prompt_mask | (output_counts > 0)
    rp = repetition[:, None]
    penalized = torch.where(logits > 0, logits / rp, logits * rp)
    logits = torch.where(seen, penalized, logits)
    counts = output_counts.to(logits.dtype)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)


def apply_top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep the ``k[i]`` largest logits of row i (ties with the k-th kept); k <= 0: all."""
    vocab = logits.shape[-1]
    k = torch.where(k <= 0, vocab, k.clamp(max=vocab)).to(torch.int64)
    top = logits.topk(int(k.max()), dim=-1).values
    kth = top.gather(-1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(
    logits: torch.Tensor, p: torch.Tensor, max_candidates: Optional[int] = None
) -> torch.Tensor:
    """Drop the least likely tokens whose cumulative probability stays <= 1 - p[i].
    ``max_candidates``: no row has more finite logits than this (after top-k), so only the
    top ones are sorted (masked tokens have probability 0 and are dropped either way)."""
    vocab = logits.shape[-1]
    if max_candidates is not None and max_candidates < vocab:
        top = logits.topk(max_candidates, dim=-1)  # descending
        sorted_logits, order = top.values.flip(-1), top.indices.flip(-1)
    else:
        sorted_logits, order = logits.sort(dim=-1, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cum <= (1 - p)[:, None]
    remove[:, -1] = False
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order, ~remove)
    return logits.masked_fill(~keep, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p[i] times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _padded(rows: Sequence[Sequence[int]], device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), -1, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.as_tensor(r, dtype=torch.int64)
    return out.to(device)


def token_counts(rows: Sequence[Sequence[int]], vocab_size: int, device) -> torch.Tensor:
    """``[n, vocab]`` occurrence counts of each row's tokens."""
    ids = _padded(rows, device)
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(1, torch.where(ids < 0, vocab_size, ids), torch.ones_like(ids))
    return counts[:, :vocab_size]


def process_logits(x: torch.Tensor, params: Sequence) -> tuple[torch.Tensor, Optional[int]]:
    """Temperature, top-k, top-p and min-p of each row's params (penalties already applied):
    the logits whose softmax is the distribution a row samples from.  Returns them and
    ``bound``: when every row keeps at most that many candidates (all rows have a top-k), else
    None.  Greedy rows (temperature 0) are scaled by 1.  The one definition of the processed
    distribution: the sampler draws from it, speculative verification accepts against it."""
    dev, vocab = x.device, x.shape[-1]
    f32 = dict(dtype=torch.float32, device=dev)
    temp = torch.tensor([p.temperature or 1.0 for p in params], **f32)
    x = x / temp[:, None]
    bound = None
    if any(p.top_k > 0 for p in params):
        x = apply_top_k(x, torch.tensor([p.top_k for p in params], device=dev))
        if all(p.top_k > 0 for p in params):
            bound = min(max(p.top_k for p in params), vocab)  # top_k > vocab: all
    if any(p.top_p < 1 for p in params):
        x = apply_top_p(x, torch.tensor([p.top_p for p in params], **f32), bound)
    if any(p.min_p > 0 for p in params):
        x = apply_min_p(x, torch.tensor([p.min_p for p in params], **f32))
    return x, bound


def greedy_argmax(logits: torch.Tensor) -> tuple[list[Optional[int]], list[float]]:
    """Per row of ``logits [n, V]``: the index of its first maximum and that maximum as a
    float, NaN first (a row holding a NaN gets a NaN's index and value, as ``torch.max``).

    On CPU, bf16 and fp32 rows go to one native pass over the logits as they lie
    (:mod:`framework.engine.greedy_native`: no fp32 copy; the rows over the threads); other
    dtypes, or where the kernel cannot be built, are read as fp32 (exact for bf16/fp16
    values) by numpy's vectorised ``argmax``: ~9 us for a 32000-way bf16 row against ~50 us
    for ``x.float().max(-1)`` (whose index-tracking reduction is not vectorised) and ~120 us
    for the bf16 ``argmax``, measured side by side here; 8 rows ~53 us against ~280 us.  Ties
    go to the first index, as in torch.  Elsewhere ``torch.max`` on fp32 (one transfer of
    indices and maxima)."""
    native = greedy_native.greedy_argmax(logits.detach())
    if native is not None:
        return native
    x = logits.float()
    if x.device.type != "cpu" or x.dim() != 2:
        values, indices = x.max(dim=-1)
        return indices.tolist(), values.tolist()
    rows = x.detach().numpy()
    idx = rows.argmax(axis=-1)
    return idx.tolist(), rows[np.arange(rows.shape[0]), idx].tolist()


NON_FINITE = "the model's logits are not finite (NaN or inf: check the weights and inputs)"


def tokens_of_argmax(
    tokens: list[Optional[int]], maxima: list[float], reqs: Sequence[Request]
) -> list[Optional[int]]:
    """Greedy tokens from each row's first maximum and its value: a row whose maximum is not
    finite (it holds a NaN or +inf, or is all -inf) fails its request and gets None."""
    for i, v in enumerate(maxima):
        if not math.isfinite(v):
            reqs[i].fail(NON_FINITE)
            tokens[i] = None
    return tokens


class Sampler:
    """``sampler(logits, requests)`` -> (token per row, logprobs per row or None).

    A row that cannot be sampled fails *its* request alone (:meth:`Request.fail`, finish
    reason "error") and gets the token ``None``: a row whose logits hold a NaN or +inf (or
    are all -inf), or a row whose sampling raises when the batch is retried row by row after
    the batched sampler raised.  Every other row is sampled as usual."""

    def __call__(
        self, logits: torch.Tensor, reqs: Sequence[Request]
    ) -> tuple[list[Optional[int]], Optional[list[Optional[dict[int, float]]]]]:
        return self.sample(logits, reqs)

    @staticmethod
    def takes_argmax(reqs: Sequence[Request]) -> bool:
        """Every request's token is the first maximum of its logits (greedy, no penalties,
        no logprobs): the rows' argmax is all the sampler needs, wherever it was computed."""
        return all(
            r.params.greedy and not r.params.has_penalties and r.params.logprobs is None
            for r in reqs
        )

    @staticmethod
    def from_argmax(
        tokens: list[Optional[int]], maxima: list[float], reqs: Sequence[Request]
    ) -> list[Optional[int]]:
        """The tokens of a :meth:`takes_argmax` batch from each row's first maximum and its
        value (computed elsewhere: the LM head's greedy kernel): see :func:`tokens_of_argmax`."""
        return tokens_of_argmax(tokens, maxima, reqs)

    def sample(
        self, logits: torch.Tensor, reqs: Sequence[Request]
    ) -> tuple[list[Optional[int]], Optional[list[Optional[dict[int, float]]]]]:
        params = [r.params for r in reqs]
        if self.takes_argmax(reqs):
            return tokens_of_argmax(*greedy_argmax(logits), reqs), None
        x = logits.float()
        finite = torch.isfinite(x.amax(dim=-1)).tolist()
        for r, ok in zip(reqs, finite):
            if not ok:
                r.fail(NON_FINITE)
        good = [i for i, ok in enumerate(finite) if ok]
        tokens = [None] * len(reqs)
        lps: list[Optional[dict[int, float]]] = [None] * len(reqs)
        if len(good) < len(reqs):
            x = x[good]
        sub_reqs = [reqs[i] for i in good]
        try:
            got, got_lps = (
                self._sample(x, sub_reqs, [params[i] for i in good]) if good else ([], None)
            )
        except Exception:  # one bad row must not sink the batch: sample each row alone
            got, got_lps = [], []
            for j, r in enumerate(sub_reqs):
                try:
                    t, lp = self._sample(x[j : j + 1], [r], [r.params])
                except Exception as e:
                    r.fail(f"sampling failed ({type(e).__name__}: {e})")
                    t, lp = [None], None
                got.append(t[0])
                got_lps.append(lp[0] if lp is not None else None)
        for j, i in enumerate(good):
            tokens[i] = got[j]
            if got_lps is not None:
                lps[i] = got_lps[j]
        wanted = any(p.logprobs is not None for p in params)
        return tokens, (lps if wanted else None)

    def _sample(self, raw: torch.Tensor, reqs: Sequence[Request], params):
        dev, vocab = raw.device, raw.shape[-1]
        f32 = dict(dtype=torch.float32, device=dev)
        x = raw
        if any(p.has_penalties for p in params):
            x = apply_penalties(
                x,
                token_counts([r.prompt for r in reqs], vocab, dev) > 0,
                token_counts([r.output for r in reqs], vocab, dev),
                torch.tensor([p.repetition_penalty for p in params], **f32),
                torch.tensor([p.presence_penalty for p in params], **f32),
                torch.tensor([p.frequency_penalty for p in params], **f32),
            )
        greedy = torch.tensor([p.greedy for p in params], device=dev)
        tokens = x.argmax(dim=-1)
        if not bool(greedy.all()):
            x, bound = process_logits(x, params)
            seeds = torch.tensor([r.seed for r in reqs], device=dev)
            steps = torch.tensor([len(r.output) for r in reqs], device=dev)
            if bound is not None:  # every row has at most `bound` candidates: race those
                cand = x.topk(bound, dim=-1)
                noise = uniform_noise(seeds, steps, vocab, cand.indices)
                race = cand.values.softmax(dim=-1) / -noise.log()
                drawn = cand.indices.gather(-1, race.argmax(dim=-1, keepdim=True))[:, 0]
            else:
                noise = uniform_noise(seeds, steps, vocab)
                drawn = (x.softmax(dim=-1) / -noise.log()).argmax(dim=-1)
            tokens = torch.where(greedy, tokens, drawn)
        out = tokens.tolist()
        return out, self._logprobs(raw, tokens, params)

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, tokens: torch.Tensor, params
    ) -> Optional[list[Optional[dict[int, float]]]]:
        wanted = [p.logprobs for p in params]
        if all(w is None for w in wanted):
            return None
        lp = raw.log_softmax(dim=-1)
        top_n = max(w or 0 for w in wanted)
        top = lp.topk(top_n, dim=-1) if top_n else None
        chosen = lp.gather(-1, tokens[:, None])[:, 0].tolist()
        ids = top.indices.tolist() if top is not None else None
        vals = top.values.tolist() if top is not None else None
        out: list[Optional[dict[int, float]]] = []
        for i, w in enumerate(wanted):
            if w is None:
                out.append(None)
                continue
            d = {ids[i][j]: vals[i][j] for j in range(w)} if w else {}
            d[int(tokens[i])] = chosen[i]
            out.append(d)
        return out
