"""The engine side of speculative decoding: drafts per step, what requests may ask, stats.

:class:`SpecDecoder` sits in the engine core (``framework.engine.core``).  Each step it asks
the proposer for drafts for the requests that decode (or whose prefill ends their prompt, so
even the first tokens are verified drafts), hands them to the
scheduler (which turns each into a verify chunk of ``1 + len(drafts)`` query tokens), attaches
the draft probabilities to the chunks, and after the step records what was accepted.
"""

from __future__ import annotations

import time
from numbers import Integral
from typing import Any, Optional, Sequence

import torch

from framework.engine.request import Request, ScheduledChunk
from framework.engine.sampling_params import SamplingParams
from framework.engine.spec.config import SpeculativeConfig
from framework.engine.spec.proposer import Proposer


class SpecDecoder:
    """Drafts for one engine's decode requests, and the acceptance statistics."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, vocab_size: int):
        self.config = config
        self.proposer = proposer
        self.k = config.num_speculative_tokens
        self.vocab_size = vocab_size
        self._probs: dict[int, torch.Tensor] = {}
        self.verify_steps = 0
        self.verify_chunks = 0
        self.drafted = [0] * self.k
        """Per draft position j: verify chunks that held a j-th draft."""
        self.accepted = [0] * self.k
        """Per draft position j: ... whose j-th draft was accepted."""
        self.kept_tokens = 0
        """Tokens the verify chunks produced (accepted drafts + one each)."""
        self.propose_s: list[float] = []
        self.verify_s: list[float] = []

    # ------------------------------------------------------------------ requests
    def check_params(self, params: SamplingParams, name: str) -> None:
        """What speculative decoding does not support, refused when the request is added
        (one ``ValueError`` naming the request and the field)."""
        for field, value, off in (
            ("repetition_penalty", params.repetition_penalty, 1.0),
            ("presence_penalty", params.presence_penalty, 0.0),
            ("frequency_penalty", params.frequency_penalty, 0.0),
        ):
            if value != off:
                raise ValueError(
                    f"{name}: SamplingParams.{field}={value} is not supported with "
                    f"speculative decoding (the engine was built with a speculative_config); "
                    f"drop the penalty or build the LLM without speculation"
                )
        if params.logprobs is not None:
            raise ValueError(
                f"{name}: SamplingParams.logprobs is not supported with speculative decoding "
                f"(the engine was built with a speculative_config)"
            )

    def release(self, req_id: int) -> None:
        self._probs.pop(req_id, None)
        self.proposer.release(req_id)

    # ------------------------------------------------------------------ per step
    def propose(self, candidates: Sequence[Request]) -> dict[int, list[int]]:
        """Drafts (by request id) for the requests that may verify drafts this step
        (``Scheduler.draft_candidates``: running ones decoding one new token, waiting ones
        whose prefill will end their prompt) that still take at least two tokens (one token
        needs no draft)."""
        reqs = [
            r
            for r in candidates
            if not r.finished
            and (r.num_tokens - r.num_computed == 1 or r.num_computed == 0)
            and r.max_new_tokens - len(r.output) >= 2
        ]
        self._probs.clear()
        if not reqs:
            return {}
        t0 = time.perf_counter()
        drafts = self.proposer.propose(reqs)
        probs = self.proposer.draft_probs()
        self.propose_s.append(time.perf_counter() - t0)
        name = type(self.proposer).__name__
        if len(drafts) != len(reqs):
            raise RuntimeError(
                f"speculative proposer {name}: {len(drafts)} draft lists for {len(reqs)} requests"
            )
        out: dict[int, list[int]] = {}
        for i, (r, d) in enumerate(zip(reqs, drafts)):
            if all(type(t) is int for t in d):  # the common case, without the ABC checks
                d = list(d)
            else:
                d = [
                    int(t) if isinstance(t, Integral) and not isinstance(t, bool) else t for t in d
                ]
            if len(d) > self.k:
                raise RuntimeError(
                    f"speculative proposer {name}: {len(d)} drafts for request {r.req_id}, "
                    f"more than num_speculative_tokens={self.k}"
                )
            for t in d:
                bad = type(t) is not int and (isinstance(t, bool) or not isinstance(t, Integral))
                if bad or not 0 <= t < self.vocab_size:
                    raise RuntimeError(
                        f"speculative proposer {name}: draft token {t!r} for request "
                        f"{r.req_id} is not a token id of the vocabulary (0..{self.vocab_size - 1})"
                    )
            if d:
                out[r.req_id] = d
                if probs is not None and probs[i] is not None:
                    self._probs[r.req_id] = probs[i]
        return out

    def attach(self, chunks: list[ScheduledChunk]) -> None:
        """Give each verify chunk the probabilities of the drafts it kept (the scheduler may
        have cut the list)."""
        if not self._probs:
            return
        for c in chunks:
            p = self._probs.get(c.req.req_id)
            if c.spec and p is not None:
                c.draft_probs = p[: len(c.spec)]

    def record(self, chunks: list[ScheduledChunk], sampled: list[Any], verify_s: float) -> None:
        """Acceptance per draft position after a step (before the tokens are applied)."""
        any_spec = False
        for c, kept in zip(chunks, sampled):
            if not c.spec or not isinstance(kept, list):
                continue
            any_spec = True
            accepted = len(kept) - 1
            self.verify_chunks += 1
            self.kept_tokens += len(kept)
            for j in range(len(c.spec)):
                self.drafted[j] += 1
                self.accepted[j] += j < accepted
        if any_spec:
            self.verify_steps += 1
            self.verify_s.append(verify_s)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        """``spec_*`` entries of ``LLM.stats``."""
        drafted, accepted = sum(self.drafted), sum(self.accepted)
        out: dict[str, Any] = {
            "spec_method": self.config.method,
            "spec_num_speculative_tokens": self.k,
            "spec_verify_steps": self.verify_steps,
            "spec_verify_chunks": self.verify_chunks,
            "spec_draft_tokens": drafted,
            "spec_accepted_tokens": accepted,
            "spec_acceptance_rate": accepted / drafted if drafted else 0.0,
            "spec_acceptance_rate_per_position": [
                a / d if d else 0.0 for a, d in zip(self.accepted, self.drafted)
            ],
            "spec_drafted_per_position": list(self.drafted),
            "spec_accepted_per_position": list(self.accepted),
            "spec_mean_accepted_length": (
                self.kept_tokens / self.verify_chunks if self.verify_chunks else 0.0
            ),
            "spec_propose_ms_per_step": _mean_ms(self.propose_s),
            "spec_verify_ms_per_step": _mean_ms(self.verify_s),
        }
        out.update({f"spec_{k}": v for k, v in self.proposer.stats().items()})
        return out


def _mean_ms(times: list[float]) -> Optional[float]:
    return 1e3 * sum(times) / len(times) if times else None
