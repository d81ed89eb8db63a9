"""The step scheduler: waiting and running queues, admission control, preemption.

Each step every running request advances (one decode token, or its next prefill chunk), in
admission order; then waiting requests are admitted while the token budget, ``max_num_seqs``
and the KV cache allow.  A request is admitted only when the blocks for its next chunk are
free (with prefix caching, cached leading blocks are reused and its prefill starts after
them).  When a running request needs a block that is not free, the *newest* running request
is preempted by recompute: its blocks are freed, its output so far is kept, and it goes back
to the front of the waiting queue (its prompt and output are prefilled again on
re-admission).  A request that could never fit, alone in an empty cache, is rejected by
``add``.  A request samples a token only in a step that reaches the end of its known tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from framework.engine.block_manager import NO_PARENT, BlockManager, chain_hashes
from framework.engine.request import Request, ScheduledChunk

__all__ = ["Request", "ScheduledChunk", "Scheduler", "SchedulerStats"]


@dataclass
class SchedulerStats:
    preemptions: int = 0
    rejections: int = 0
    aborted: int = 0
    finished: int = 0
    step_errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "preemptions": self.preemptions,
            "rejections": self.rejections,
            "aborted": self.aborted,
            "finished_requests": self.finished,
            "step_errors": self.step_errors,
        }


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        block_size: int,
        max_num_seqs: int,
        max_num_tokens: int,
        max_model_len: int,
        on_release: Optional[Callable[[int], None]] = None,
        draft_rows_limit: Optional[int] = None,
    ):
        self.block_manager = block_manager
        self.on_release = on_release
        """Called with a request's id whenever it leaves the running set with its blocks
        freed (finished, aborted, preempted, step error): a proposer drops its state."""
        self.draft_rows_limit = draft_rows_limit
        """A step that verifies drafts (in verify or prefill chunks) stays at or under this
        many tokens (None: no limit).  Up to it every row of the step runs the row-independent
        kernels a decode step runs (the small-M linears); above it the linears switch to
        another kernel, a draft row's bits would differ from those of the decode step it
        stands for, and greedy tokens with speculation would part from those without."""
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()

    @property
    def prefix_caching(self) -> bool:
        return getattr(self.block_manager, "enable_prefix_caching", False)

    # ------------------------------------------------------------------ queue
    def add(self, req: Request) -> None:
        """Queue a request, or reject it (``ValueError`` naming it) when it can never run."""
        self.check_fits(req)
        self.waiting.append(req)

    def check_fits(self, req: Request) -> None:
        """Raise ``ValueError`` naming the request (and count a rejection) when it could
        never run, alone in an empty cache; queue nothing."""
        try:
            self._check_fits(req)
        except ValueError:
            self.stats.rejections += 1
            raise

    def _check_fits(self, req: Request) -> None:
        if not req.prompt:
            raise ValueError(f"request {req.req_id}: empty prompt")
        total = len(req.prompt) + req.max_new_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"request {req.req_id}: prompt ({len(req.prompt)}) + "
                f"max_new_tokens ({req.max_new_tokens}) = {total} exceeds "
                f"max_model_len={self.max_model_len}"
            )
        # The last sampled token is never fed back, so total - 1 tokens hold K/V.
        need = -(-(total - 1) // self.block_size)
        usable = self.block_manager.num_blocks - 1
        if need > usable:
            raise ValueError(
                f"request {req.req_id}: prompt ({len(req.prompt)}) + "
                f"max_new_tokens ({req.max_new_tokens}) needs {need} KV blocks "
                f"of {self.block_size} tokens, the whole cache holds {usable}; "
                f"shorten it or raise the KV cache memory budget"
            )

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, req_id: int) -> Optional[Request]:
        """Remove a request wherever it is, freeing its blocks; None when unknown."""
        for queue in (self.running, self.waiting):
            for r in queue:
                if r.req_id == req_id:
                    queue.remove(r)
                    self._release(r)
                    r.finish("abort")
                    self.stats.aborted += 1
                    return r
        return None

    # ------------------------------------------------------------------ blocks
    def _release(self, req: Request) -> None:
        self.block_manager.free(req.block_ids)
        req.block_ids = []
        req.num_cached_blocks = 0
        if self.on_release is not None:
            self.on_release(req.req_id)

    def _blocks_needed(self, req: Request, upto: int) -> int:
        return max(0, -(-upto // self.block_size) - len(req.block_ids))

    def _reserve(self, req: Request, upto: int) -> None:
        need = self._blocks_needed(req, upto)
        if need > 0:
            req.block_ids.extend(self.block_manager.allocate(need))

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.num_computed = 0
        req.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)

    # ------------------------------------------------------------------ schedule
    def draft_candidates(self, k: int = 0) -> list[Request]:
        """The requests that may verify drafts in the next step (speculative decoding, up to
        ``k`` drafts each): the running ones that decode (one new token), then the greedy
        waiting ones the step would admit, but only when every admission fits whole, with
        ``k`` drafts for each greedy one, into the token budget left (so drafts never split a
        prompt or push an admission to a later step).  Their drafts follow the prompt and are
        verified in the prefill chunk itself: the first new tokens need no decode step of
        their own.  Sampling requests draft from their first decode step on, so whether a
        step had room for prefill drafts (which depends on the batch) never changes a seeded
        request's draws.  With :attr:`draft_rows_limit` the step's tokens, every draft
        included, stay within it: decoding requests past it (in running order) decode
        plainly, and waiting ones get no drafts.  KV is not checked here: :meth:`schedule`
        drops drafts that find no blocks, and never delays an admission for them."""
        out = [r for r in self.running if r.num_tokens - r.num_computed == 1]
        running = sum(r.num_tokens - r.num_computed for r in self.running)
        budget = self.max_num_tokens - running - k * len(out)
        admitted, tokens = self._admissions(budget)
        limit = self.draft_rows_limit
        if limit is not None and k > 0:
            # The most a step could admit (fewer drafts leave it more budget), then drafts for
            # the decoding requests, in running order, as far as the step stays within limit.
            most = self._admissions(self.max_num_tokens - running)[1]
            out = out[: max(0, (limit - running - most) // k)]
            tokens = max(tokens, most)
        greedy = [r for r in admitted if r.params.greedy]
        rows = running + k * len(out) + tokens + k * len(greedy)  # with every draft
        if greedy and tokens + k * len(greedy) <= budget and (limit is None or rows <= limit):
            out += greedy
        return out

    def _admissions(self, budget: int) -> tuple[list[Request], int]:
        """The waiting requests a step with ``budget`` tokens left would admit (at least
        begin), and their tokens to compute."""
        slots = self.max_num_seqs - len(self.running)
        admitted: list[Request] = []
        tokens = 0
        for req in self.waiting:
            if len(admitted) >= slots or tokens >= budget:
                break
            tokens += req.num_tokens - req.num_computed
            admitted.append(req)
        return admitted, tokens

    def schedule(self, drafts: Optional[dict[int, Sequence[int]]] = None) -> list[ScheduledChunk]:
        """The step's chunks.  ``drafts``: speculative decoding's draft tokens per request
        id; a decoding request with drafts gets a verify chunk of its last token plus as many
        drafts as the token budget, its ``max_tokens`` and the free KV blocks allow (drafts
        are dropped before anyone is preempted for them); an admitted request whose chunk
        ends its prompt gets its drafts after the prompt the same way (dropped before its
        admission would wait for them)."""
        budget = self.max_num_tokens
        chunks: list[ScheduledChunk] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed, budget)
            spec: tuple[int, ...] = ()
            d = drafts.get(req.req_id) if drafts else None
            if d and req.num_tokens - req.num_computed == 1:
                room = min(budget - 1, req.max_new_tokens - len(req.output) - 1)
                spec = tuple(int(t) for t in d[: max(room, 0)])
                n = 1 + len(spec)
                free = self.block_manager.num_free
                if spec and self._blocks_needed(req, req.num_computed + n) > free:
                    spec, n = (), 1  # no blocks for the drafts: plain decode
            need = self._blocks_needed(req, req.num_computed + n)
            while need > self.block_manager.num_free and self.running[-1] is not req:
                self._preempt(self.running.pop())  # the newest running request
                preempted = True
            if need > self.block_manager.num_free:  # it is the newest itself
                self._preempt(self.running.pop())
                preempted = True
                break
            self._reserve(req, req.num_computed + n)
            chunks.append(ScheduledChunk(req, req.num_computed, n, spec))
            budget -= n
            i += 1
        # No admissions in a step that preempted: the preempted requests go first, later.
        while (
            not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
        ):
            req = self.waiting[0]
            hits = self._prefix_hits(req)
            start = len(hits) * self.block_size
            n = min(req.num_tokens - start, budget)
            need = -(-(start + n) // self.block_size) - len(hits)
            evictable_hits = sum(self.block_manager.ref_count(b) == 0 for b in hits)
            if need > self.block_manager.num_free - evictable_hits:
                break  # admission control: wait until its next chunk's blocks are free
            spec = ()
            d = drafts.get(req.req_id) if drafts else None
            if d and start + n == req.num_tokens:  # the chunk ends the prompt: drafts follow
                room = min(budget - n, req.max_new_tokens - len(req.output) - 1)
                spec = tuple(int(t) for t in d[: max(room, 0)])
                more = -(-(start + n + len(spec)) // self.block_size) - len(hits)
                if spec and more > self.block_manager.num_free - evictable_hits:
                    spec = ()  # no blocks for the drafts: a plain prefill
            self.waiting.popleft()
            self.running.append(req)  # first: recover() finds it whatever raises next
            if self.prefix_caching:
                self.block_manager.take(hits)
                self.block_manager.stats.queried_tokens += req.num_tokens
                self.block_manager.stats.hit_tokens += start
            req.block_ids = list(hits)
            req.num_cached_blocks = len(hits)
            req.num_computed = start
            n += len(spec)
            self._reserve(req, start + n)
            chunks.append(ScheduledChunk(req, start, n, spec))
            budget -= n
        return chunks

    def _prefix_hits(self, req: Request) -> list[int]:
        """Cached blocks for the request's leading full blocks, keeping at least one token
        to compute (its logits give the next token)."""
        if not self.prefix_caching:
            return []
        tokens = req.all_tokens()
        n_full = len(tokens) // self.block_size
        if len(req.block_hashes) < n_full:
            parent = req.block_hashes[-1] if req.block_hashes else NO_PARENT
            req.block_hashes += chain_hashes(tokens, self.block_size, len(req.block_hashes), parent)
        usable = (len(tokens) - 1) // self.block_size
        return self.block_manager.lookup(req.block_hashes[:usable])

    # ------------------------------------------------------------------ update
    def update(self, chunks: list[ScheduledChunk], sampled: list) -> list[Request]:
        """Advance requests after a successful step (``sampled[i]``: chunk i's token or
        None; for a verify chunk the list of kept tokens, accepted drafts + one); returns the
        requests that finished."""
        for chunk, token in zip(chunks, sampled):
            if isinstance(token, list):
                self._apply_verified(chunk, token)
                continue
            chunk.req.num_computed = chunk.end
            if self.prefix_caching:
                self._register_full_blocks(chunk.req)
            if token is not None:
                chunk.req.append(token)
        done = [r for r in self.running if r.finished]
        for r in done:
            self._release(r)
        self.stats.finished += len(done)
        self.running = [r for r in self.running if not r.finished]
        return done

    def _apply_verified(self, chunk: ScheduledChunk, kept: list[int]) -> None:
        """A verify chunk's kept tokens: the K/V of the last token and of the accepted
        drafts stay computed; the rejected drafts' slots are rolled back (blocks past the
        computed tokens are freed, as after a plain decode step).  Tokens after an EOS / stop
        token or past ``max_tokens`` are dropped (the request finishes there)."""
        req = chunk.req
        req.num_computed = chunk.end - len(chunk.spec) + len(kept) - 1
        for t in kept:
            req.append(t)
            if req.finished:
                break
        # Finished early (EOS, max_tokens): the dropped tokens' K/V is not the request's.
        req.num_computed = min(req.num_computed, req.num_tokens - 1)
        if self.prefix_caching:
            self._register_full_blocks(req)
        if not req.finished:
            keep = -(-req.num_computed // self.block_size)  # as after a plain decode step
            if len(req.block_ids) > keep:
                self.block_manager.free(req.block_ids[keep:])
                req.block_ids = req.block_ids[:keep]  # a new list: the runner rewrites its row

    def _register_full_blocks(self, req: Request) -> None:
        full = req.num_computed // self.block_size
        if full <= req.num_cached_blocks:
            return
        tokens = req.all_tokens()
        if len(req.block_hashes) < full:
            parent = req.block_hashes[-1] if req.block_hashes else NO_PARENT
            req.block_hashes += chain_hashes(
                tokens[: full * self.block_size], self.block_size, len(req.block_hashes), parent
            )
        for b in range(req.num_cached_blocks, full):
            self.block_manager.register(req.block_ids[b], req.block_hashes[b])
        req.num_cached_blocks = full

    def recover(self) -> None:
        """After a step raised: every running request releases its blocks and goes back to
        the front of the waiting queue (its output so far kept, recomputed later), so no
        block leaks and nothing stays half-scheduled."""
        self.stats.step_errors += 1
        for req in reversed(self.running):
            self._release(req)
            req.num_computed = 0
            self.waiting.appendleft(req)
        self.running = []
