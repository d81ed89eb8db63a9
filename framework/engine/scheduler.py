"""Requests and the step scheduler.

Each step: every running request decodes one token; then waiting requests are admitted and
prefill (chunked when the token budget runs out), in the same step when both exist.  A
request samples a token only in a step that reaches the end of its known tokens.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from framework.engine.kv_cache import BlockAllocator


@dataclass
class Request:
    req_id: int
    prompt: list[int]
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    output: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    """Tokens whose K/V are already in the cache."""
    finished: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def token_at(self, i: int) -> int:
        p = len(self.prompt)
        return self.prompt[i] if i < p else self.output[i - p]

    def append(self, token: int) -> None:
        self.output.append(token)
        if len(self.output) >= self.max_new_tokens or token in self.eos_token_ids:
            self.finished = True


@dataclass
class ScheduledChunk:
    req: Request
    start: int
    """First position of the chunk (== req.num_computed when scheduled)."""
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """The chunk reaches the last known token, so its logits give the next token."""
        return self.end == self.req.num_tokens


class Scheduler:
    def __init__(self, allocator: BlockAllocator, *, block_size: int, max_num_seqs: int,
                 max_num_tokens: int, max_model_len: int):
        self.allocator = allocator
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        total = len(req.prompt) + req.max_new_tokens
        if not req.prompt:
            raise ValueError(f"request {req.req_id}: empty prompt")
        if total > self.max_model_len:
            raise ValueError(f"request {req.req_id}: prompt ({len(req.prompt)}) + "
                             f"max_new_tokens ({req.max_new_tokens}) = {total} exceeds "
                             f"max_model_len={self.max_model_len}")
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _reserve(self, req: Request, upto: int) -> None:
        need = -(-upto // self.block_size) - len(req.block_ids)
        if need > 0:
            req.block_ids.extend(self.allocator.allocate(need))

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_tokens
        chunks: list[ScheduledChunk] = []
        for req in self.running:
            if budget == 0:
                break
            n = min(req.num_tokens - req.num_computed, budget)
            self._reserve(req, req.num_computed + n)
            chunks.append(ScheduledChunk(req, req.num_computed, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.popleft()
            n = min(req.num_tokens - req.num_computed, budget)
            self._reserve(req, req.num_computed + n)
            self.running.append(req)
            chunks.append(ScheduledChunk(req, req.num_computed, n))
            budget -= n
        return chunks

    def update(self, chunks: list[ScheduledChunk], sampled: list[Optional[int]]) -> None:
        """Advance requests after a step; ``sampled[i]`` is chunk i's token or None."""
        for chunk, token in zip(chunks, sampled):
            chunk.req.num_computed = chunk.end
            if token is not None:
                chunk.req.append(token)
        done = [r for r in self.running if r.finished]
        for r in done:
            self.allocator.free(r.block_ids)
            r.block_ids = []
        self.running = [r for r in self.running if not r.finished]
