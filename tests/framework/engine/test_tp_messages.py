"""The tensor-parallel step message: a worker's mirror request answers every read the runner
makes of a request (token_at, tokens, all_tokens, num_tokens, block_ids) as the real one does,
for prefill, decode and verify chunks."""

from __future__ import annotations

import pytest

from framework.engine.request import Request, ScheduledChunk
from framework.engine.tp_messages import chunk_from_msg, chunk_msg


def _request() -> Request:
    r = Request(7, [11, 12, 13, 14, 15], max_new_tokens=8)
    r.output = [21, 22]
    r.block_ids = [3, 1]
    return r


@pytest.mark.parametrize(
    "start,num,spec",
    [
        (0, 3, ()),  # a prefill chunk that ends mid-prompt (it samples nothing)
        (2, 5, ()),  # the rest of prompt + output: it samples
        (6, 1, ()),  # a decode chunk
        (6, 4, (31, 32, 33)),  # a verify chunk: the last token and three drafts
        (4, 6, (31, 32, 33)),  # a verify chunk over more known tokens
    ],
)
def test_the_mirror_reads_as_the_request(start, num, spec):
    req = _request()
    chunk = ScheduledChunk(req, start, num, spec)
    got = chunk_from_msg(chunk_msg(chunk))
    mirror = got.req
    assert (got.start, got.num_tokens, got.spec, got.samples) == (
        chunk.start,
        chunk.num_tokens,
        chunk.spec,
        chunk.samples,
    )
    known_end = chunk.end - len(spec)
    for p in range(start, known_end):
        assert mirror.token_at(p) == req.token_at(p)
    assert mirror.tokens(start, known_end) == req.tokens(start, known_end)
    assert mirror.all_tokens()[start:known_end] == req.all_tokens()[start:known_end]
    assert mirror.block_ids == req.block_ids and mirror.req_id == req.req_id
    if chunk.samples:
        assert mirror.num_tokens == req.num_tokens
