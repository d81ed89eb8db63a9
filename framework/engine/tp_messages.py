"""What rank 0 broadcasts each tensor-parallel step, and the requests a worker rebuilds.

Per chunk: ``(req_id, start, tokens, block_ids, samples, spec)`` (``spec``: the draft tokens
of a speculative verify chunk, after ``tokens``); a worker runs the same forward on a
:class:`_MirrorRequest` that answers what its runner reads of a request.
"""

from __future__ import annotations

from framework.engine.request import ScheduledChunk


class _MirrorRequest:
    """What a worker's runner reads of a request: its tokens in the chunk and its blocks."""

    def __init__(self, req_id, start, tokens, block_ids, samples):
        self.req_id, self.start, self._tokens = req_id, start, list(tokens)
        self.block_ids = block_ids
        self.num_tokens = start + len(tokens) + (0 if samples else 1)

        # The runner slices ``prompt[start:end]`` for multi-token chunks: positions before
        # the chunk are never read, so they are placeholders.
        self.prompt = [0] * start + list(tokens)

    def token_at(self, p: int) -> int:
        return self._tokens[p - self.start]

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens ``start:end`` (inside the chunk), as :meth:`Request.tokens`."""
        return self._tokens[start - self.start : end - self.start]

    def all_tokens(self) -> list[int]:
        return self.prompt


def chunk_msg(c) -> tuple:
    req = c.req
    tokens = [req.token_at(p) for p in range(c.start, c.end - len(c.spec))]
    return (req.req_id, c.start, tokens, list(req.block_ids), c.samples, tuple(c.spec))


def chunk_from_msg(m) -> ScheduledChunk:
    req = _MirrorRequest(*m[:5])
    spec = m[5]
    return ScheduledChunk(req, m[1], len(m[2]) + len(spec), spec)
