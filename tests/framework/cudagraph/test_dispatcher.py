"""CUDA-graph dispatcher: every mode x token counts x request mixes, padding, validation."""

import bisect
import time

import pytest

from framework.core.config import default_capture_sizes
from framework.core.forward_context import BatchDescriptor, CUDAGraphMode
from framework.cudagraph.dispatcher import CudagraphDispatcher

M = CUDAGraphMode
SIZES = [1, 2, 4, 8, 16, 24, 32]
MAX_TOKENS = 48


def reference(mode, sizes, n, reqs, uniform, q=1, max_reqs=None):
    """The dispatch rule written out plainly (the tables must agree with it)."""
    max_reqs = max_reqs or MAX_TOKENS
    unpadded = (M.NONE, BatchDescriptor(n, reqs, uniform))
    i = bisect.bisect_left(sizes, n)
    if i == len(sizes):
        return unpadded
    s = sizes[i]
    if uniform and mode in (M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE):
        usizes = [x for x in sizes if x % q == 0 and x >= n and x // q <= max_reqs]
        if usizes:
            return M.FULL, BatchDescriptor(usizes[0], usizes[0] // q, True)
    if mode is M.FULL:
        return M.FULL, BatchDescriptor(s, min(s, max_reqs), False)
    if mode in (M.PIECEWISE, M.FULL_AND_PIECEWISE):
        return M.PIECEWISE, BatchDescriptor(s, None, False)
    return unpadded


def mixes(n, q=1):
    """(num_reqs, uniform_decode) request mixes with n tokens."""
    out = [(1, False)]  # one prefill
    if n >= 2:
        out.append((n - 1, False))  # decodes + one 2-token prefill
        out.append((2, False))
    if n % q == 0:
        out.append((n // q, True))  # pure (uniform) decode
    return out


@pytest.mark.parametrize("mode", list(M))
@pytest.mark.parametrize("q", [1, 2])
@pytest.mark.parametrize("max_reqs", [None, 12])
def test_every_mode_token_count_and_mix(mode, q, max_reqs):
    d = CudagraphDispatcher(
        mode, SIZES, MAX_TOKENS, uniform_decode_query_len=q, max_num_reqs=max_reqs
    )
    for n in range(1, MAX_TOKENS + 1):
        for reqs, uniform in mixes(n, q):
            if reqs > (max_reqs or MAX_TOKENS):
                continue
            got = d.dispatch(n, reqs, uniform)
            assert got == reference(mode, SIZES, n, reqs, uniform, q, max_reqs=max_reqs), (
                mode,
                n,
                reqs,
                uniform,
            )
            runtime, desc = got
            assert runtime in (M.NONE, M.PIECEWISE, M.FULL)
            if runtime is not M.NONE:
                assert desc in d.keys(runtime)  # every returned key gets captured
                assert desc.num_tokens >= n
                assert desc.num_reqs is None or desc.num_reqs >= reqs


@pytest.mark.parametrize(
    "mode,n,reqs,uniform,expected",
    [
        # uniform decode: FULL where the mode has decode graphs, padded 3 -> 4 tokens/requests
        (M.FULL_AND_PIECEWISE, 3, 3, True, (M.FULL, BatchDescriptor(4, 4, True))),
        (M.FULL_DECODE_ONLY, 3, 3, True, (M.FULL, BatchDescriptor(4, 4, True))),
        (M.FULL, 3, 3, True, (M.FULL, BatchDescriptor(4, 4, False))),
        (M.PIECEWISE, 3, 3, True, (M.PIECEWISE, BatchDescriptor(4))),
        (M.NONE, 3, 3, True, (M.NONE, BatchDescriptor(3, 3, True))),
        # mixed prefill + decode
        (M.FULL_AND_PIECEWISE, 17, 5, False, (M.PIECEWISE, BatchDescriptor(24))),
        (M.FULL_DECODE_ONLY, 17, 5, False, (M.NONE, BatchDescriptor(17, 5, False))),
        (M.FULL, 17, 5, False, (M.FULL, BatchDescriptor(24, 24, False))),
        # exactly a capture size: no padding
        (M.FULL_AND_PIECEWISE, 32, 32, True, (M.FULL, BatchDescriptor(32, 32, True))),
        # above the largest capture size: no graphs, unpadded
        (M.FULL_AND_PIECEWISE, 33, 33, True, (M.NONE, BatchDescriptor(33, 33, True))),
        (M.PIECEWISE, 40, 2, False, (M.NONE, BatchDescriptor(40, 2, False))),
        (M.FULL, 48, 7, False, (M.NONE, BatchDescriptor(48, 7, False))),
    ],
)
def test_named_cases(mode, n, reqs, uniform, expected):
    assert CudagraphDispatcher(mode, SIZES, MAX_TOKENS).dispatch(n, reqs, uniform) == expected


def test_multi_token_uniform_decode_uses_divisible_sizes():
    d = CudagraphDispatcher(M.FULL_AND_PIECEWISE, [1, 2, 3, 4, 6, 8], 8, uniform_decode_query_len=2)
    # 2 requests x 2 tokens: exact; 3 x 2 = 6: exact (6 is divisible by 2)
    assert d.dispatch(4, 2, True) == (M.FULL, BatchDescriptor(4, 2, True))
    assert d.dispatch(6, 3, True) == (M.FULL, BatchDescriptor(6, 3, True))
    # 1 x 2: size 2 -> 1 request slot
    assert d.dispatch(2, 1, True) == (M.FULL, BatchDescriptor(2, 1, True))
    # a mixed batch of 3 tokens pads to size 3 (not divisible: piecewise only)
    assert d.dispatch(3, 2, False) == (M.PIECEWISE, BatchDescriptor(3))
    assert BatchDescriptor(3, 1, True) not in d.keys(M.FULL)
    with pytest.raises(ValueError, match="uniform_decode_query_len=2"):
        d.dispatch(3, 2, True)


def test_request_slots_are_capped_by_max_num_reqs():
    d = CudagraphDispatcher(M.FULL, SIZES, MAX_TOKENS, max_num_reqs=6)
    # a general FULL graph of 24 tokens has 6 request slots, not 24
    assert d.dispatch(17, 6, False) == (M.FULL, BatchDescriptor(24, 6, False))
    d = CudagraphDispatcher(M.FULL_AND_PIECEWISE, SIZES, MAX_TOKENS, max_num_reqs=6)
    # 5 decodes would pad to 8 request slots > 6: no FULL key, piecewise instead
    assert d.dispatch(5, 5, True) == (M.PIECEWISE, BatchDescriptor(8))
    assert d.dispatch(4, 4, True) == (M.FULL, BatchDescriptor(4, 4, True))
    assert max(k.num_reqs for k in d.keys(M.FULL)) == 4


def test_padded_num_tokens():
    d = CudagraphDispatcher(M.PIECEWISE, SIZES, MAX_TOKENS)
    assert [d.padded_num_tokens(n) for n in (1, 3, 4, 5, 9, 17, 32, 33, 48)] == [
        1,
        4,
        4,
        8,
        16,
        24,
        32,
        33,
        48,
    ]
    sizes = default_capture_sizes(512)
    d = CudagraphDispatcher(M.PIECEWISE, sizes, 512)
    for n in range(1, 513):
        assert d.padded_num_tokens(n) == min([s for s in sizes if s >= n], default=n)


def test_unsorted_sizes_are_accepted():
    d = CudagraphDispatcher(M.PIECEWISE, [16, 1, 4], 16)
    assert d.capture_sizes == [1, 4, 16]
    assert d.dispatch(5, 1, False) == (M.PIECEWISE, BatchDescriptor(16))


@pytest.mark.parametrize(
    "sizes,match",
    [
        ([1, 2, 2], "duplicate size 2"),
        ([0, 4], "must be positive"),
        ([-8], "must be positive"),
        ([1, 64], "size 64 is above max_num_tokens=48"),
        ([1, 2.0], "must be integers"),
        ([True], "must be integers"),
        (None, "expected a list"),
        ("1,2", "expected a list"),
    ],
)
def test_bad_capture_sizes(sizes, match):
    with pytest.raises(ValueError, match="cudagraph_capture_sizes") as e:
        CudagraphDispatcher(M.PIECEWISE, sizes, MAX_TOKENS)
    assert match in str(e.value)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_num_tokens=0), "max_num_tokens"),
        (dict(uniform_decode_query_len=0), "uniform_decode_query_len"),
        (dict(max_num_reqs=0), "max_num_reqs"),
        (dict(cudagraph_mode="SOMETIMES"), "unknown CUDAGraphMode"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = dict(cudagraph_mode=M.PIECEWISE, capture_sizes=[1, 2], max_num_tokens=8)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        CudagraphDispatcher(**args)


@pytest.mark.parametrize("n,reqs", [(0, 1), (4, 0), (2, 3), (MAX_TOKENS + 1, 1), (20, 17)])
def test_bad_dispatch_arguments(n, reqs):
    d = CudagraphDispatcher(M.PIECEWISE, SIZES, MAX_TOKENS, max_num_reqs=16)
    with pytest.raises(
        ValueError,
        match="0 < num_reqs <= num_tokens <= max_num_tokens=48 and num_reqs <= max_num_reqs=16",
    ):
        d.dispatch(n, reqs, False)


def test_no_capture_sizes_means_no_graphs():
    d = CudagraphDispatcher(M.FULL_AND_PIECEWISE, [], MAX_TOKENS)
    assert d.capture_plan() == []
    assert d.dispatch(1, 1, True) == (M.NONE, BatchDescriptor(1, 1, True))


@pytest.mark.parametrize(
    "mode,full,piecewise",
    [
        (M.NONE, 0, 0),
        (M.PIECEWISE, 0, 7),
        (M.FULL, 7, 0),
        (M.FULL_DECODE_ONLY, 7, 0),
        (M.FULL_AND_PIECEWISE, 7, 7),
    ],
)
def test_capture_plan_largest_first(mode, full, piecewise):
    d = CudagraphDispatcher(mode, SIZES, MAX_TOKENS)
    plan = d.capture_plan()
    assert sum(m is M.FULL for m, _ in plan) == full
    assert sum(m is M.PIECEWISE for m, _ in plan) == piecewise
    tokens = [desc.num_tokens for _, desc in plan]
    assert tokens == sorted(tokens, reverse=True)
    assert {desc for m, desc in plan if m is M.FULL} == d.keys(M.FULL)
    assert {desc for m, desc in plan if m is M.PIECEWISE} == d.keys(M.PIECEWISE)
    if plan:
        assert plan[0][1].num_tokens == 32


def test_dispatch_is_fast():
    d = CudagraphDispatcher(M.FULL_AND_PIECEWISE, default_capture_sizes(512), 8192)
    cases = [(1, 1, True), (100, 100, True), (300, 7, False), (4000, 30, False)]
    n = 20000
    start = time.perf_counter()
    for i in range(n):
        d.dispatch(*cases[i & 3])
    per_call_us = (time.perf_counter() - start) / n * 1e6
    # Target < 5 us; the bound leaves room for a loaded shared CI machine.
    assert per_call_us < 20, per_call_us
