"""Step observers the experiments attach to an engine (``LLM.add_observer``).

:class:`FirstTokenLogits` keeps, per request, the logits row that chose its first new token
(for agreement checks against a reference run).  Only an engine with the observer attached
does that work::

    with FirstTokenLogits.attached(llm) as first:
        outputs = llm.generate(prompts, max_new_tokens=8)
    logits = first.take()   # one [vocab] float32 tensor per request, in request-id order
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Optional, Protocol

import torch

from framework.engine.request import ScheduledChunk


class Observable(Protocol):
    """What an observer attaches to: an ``LLM`` or an engine core."""

    def add_observer(self, observer) -> None: ...

    def remove_observer(self, observer) -> None: ...


class FirstTokenLogits:
    def __init__(self) -> None:
        self.logits: dict[int, torch.Tensor] = {}
        """Request id -> float32 logits of its first new token."""

    def on_step(
        self, chunks: list[ScheduledChunk], sampled: list[Optional[int]], logits: torch.Tensor
    ) -> None:
        row = 0
        for c, tok in zip(chunks, sampled):
            if not c.samples:
                continue
            if tok is None:  # the row failed alone in the sampler: no first token
                row += 1 + len(c.spec)
                continue
            req = c.req
            if not req.output and req.req_id not in self.logits:
                self.logits[req.req_id] = logits[row].float().clone()
            row += 1 + len(c.spec)  # a verify chunk has a row per query token

    def of(self, request_ids: Iterable[int]) -> list[Optional[torch.Tensor]]:
        """The logits of these requests (None for one that sampled nothing yet)."""
        return [self.logits.get(i) for i in request_ids]

    def take(self) -> list[torch.Tensor]:
        """Everything recorded, in request-id order (a ``generate`` call's prompts are
        consecutive ids, in prompt order); clears the record."""
        out = [self.logits[i] for i in sorted(self.logits)]
        self.logits.clear()
        return out

    @classmethod
    @contextlib.contextmanager
    def attached(cls, llm: Observable) -> Iterator["FirstTokenLogits"]:
        """Attach a new recorder to ``llm`` (an ``LLM`` or engine core) for the block."""
        rec = cls()
        llm.add_observer(rec)
        try:
            yield rec
        finally:
            llm.remove_observer(rec)
