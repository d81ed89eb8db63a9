"""Request: slices of prompt + output without building the whole token list."""

from __future__ import annotations

from framework.engine.request import Request


def test_tokens_equals_the_slice_of_all_tokens_everywhere():
    r = Request(0, [10, 11, 12, 13], 8)
    for t in (20, 21, 22):
        r.append(t)
    whole = r.all_tokens()
    for start in range(len(whole) + 1):
        for end in range(start, len(whole) + 1):
            assert r.tokens(start, end) == whole[start:end], (start, end)
            assert r.tokens(start, end) == [r.token_at(i) for i in range(start, end)]
