"""The CUDA-graph downgrade table per attention support level, and min over backends."""

import logging

import pytest

from backends.attention import torch_paged  # noqa: F401  (registers "torch")
from backends.attention.common import AttentionBackend, AttentionCGSupport, register_backend
from backends.attention.selector import min_support, resolve_cudagraph_mode, select_cudagraph_mode
from framework.core.forward_context import CUDAGraphMode

M, S = CUDAGraphMode, AttentionCGSupport
FAP, FDO = M.FULL_AND_PIECEWISE, M.FULL_DECODE_ONLY

# requested -> {support: resolved} with q = 1 and a piecewise-compiled model.
TABLE = {
    M.NONE: {
        S.ALWAYS: M.NONE,
        S.UNIFORM_BATCH: M.NONE,
        S.UNIFORM_SINGLE_TOKEN_DECODE: M.NONE,
        S.NEVER: M.NONE,
    },
    M.PIECEWISE: {
        S.ALWAYS: M.PIECEWISE,
        S.UNIFORM_BATCH: M.PIECEWISE,
        S.UNIFORM_SINGLE_TOKEN_DECODE: M.PIECEWISE,
        S.NEVER: M.PIECEWISE,
    },
    M.FULL: {
        S.ALWAYS: M.FULL,
        S.UNIFORM_BATCH: FAP,
        S.UNIFORM_SINGLE_TOKEN_DECODE: FAP,
        S.NEVER: M.PIECEWISE,
    },
    FAP: {
        S.ALWAYS: FAP,
        S.UNIFORM_BATCH: FAP,
        S.UNIFORM_SINGLE_TOKEN_DECODE: FAP,
        S.NEVER: M.PIECEWISE,
    },
    FDO: {S.ALWAYS: FDO, S.UNIFORM_BATCH: FDO, S.UNIFORM_SINGLE_TOKEN_DECODE: FDO, S.NEVER: M.NONE},
}


@pytest.mark.parametrize("requested", list(TABLE))
@pytest.mark.parametrize("support", list(S))
def test_downgrade_table(requested, support):
    mode, reason = resolve_cudagraph_mode(requested, support)
    assert mode is TABLE[requested][support]
    if mode is requested:
        assert reason is None
    else:
        assert support.name in reason and reason


@pytest.mark.parametrize(
    "requested,support,expected",
    [
        # Not piecewise-compiled: a fallback cannot be PIECEWISE.
        (M.FULL, S.NEVER, M.NONE),
        (M.FULL, S.UNIFORM_BATCH, FDO),
        (M.FULL, S.UNIFORM_SINGLE_TOKEN_DECODE, FDO),
        (M.FULL, S.ALWAYS, M.FULL),
        (FDO, S.NEVER, M.NONE),
    ],
)
def test_without_piecewise_compilation(requested, support, expected):
    mode, _ = resolve_cudagraph_mode(requested, support, piecewise_available=False)
    assert mode is expected


@pytest.mark.parametrize(
    "requested,expected",
    [(M.FULL, M.PIECEWISE), (FAP, M.PIECEWISE), (FDO, M.NONE), (M.PIECEWISE, M.PIECEWISE)],
)
def test_single_token_support_with_multi_token_decode(requested, expected):
    mode, reason = resolve_cudagraph_mode(
        requested, S.UNIFORM_SINGLE_TOKEN_DECODE, uniform_decode_query_len=2
    )
    assert mode is expected
    if mode is not requested:
        assert "uniform_decode_query_len=2" in reason
    # UNIFORM_BATCH covers q > 1
    assert (
        resolve_cudagraph_mode(requested, S.UNIFORM_BATCH, uniform_decode_query_len=2)[0]
        is TABLE[requested][S.UNIFORM_BATCH]
    )


def test_reasons_say_why():
    _, reason = resolve_cudagraph_mode(M.FULL, S.UNIFORM_SINGLE_TOKEN_DECODE)
    assert reason == (
        "attention backend support is UNIFORM_SINGLE_TOKEN_DECODE: full graphs "
        "only for single-token decode; mixed batches use piecewise graphs"
    )
    _, reason = resolve_cudagraph_mode(FAP, S.NEVER)
    assert "cannot be captured" in reason and "attention runs eagerly" in reason


@pytest.fixture
def fake_backends():
    """Two backends with fixed support levels, removed again so the registry stays clean."""
    from backends.attention import common

    made = {}
    for name, level in (("_test_never", S.NEVER), ("_test_uniform", S.UNIFORM_BATCH)):
        made[name] = register_backend(name)(
            type(name, (AttentionBackend,), {"cudagraph_support": level})
        )
    yield made
    for name in made:
        common.BACKENDS.remove(name)


def test_min_support_over_layers(fake_backends):
    assert min_support(["_test_uniform", "_test_uniform"]) is S.UNIFORM_BATCH
    assert min_support(["_test_uniform", "_test_never", "_test_uniform"]) is S.NEVER
    assert min_support([]) is S.ALWAYS
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        min_support(["nope"])


def test_select_logs_one_line(caplog, fake_backends):
    with caplog.at_level(logging.INFO, logger="backends.attention.selector"):
        assert select_cudagraph_mode(M.FULL, ["_test_uniform"] * 4) is FAP
        assert select_cudagraph_mode(M.PIECEWISE, ["_test_never"]) is M.PIECEWISE
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "cudagraph_mode FULL -> FULL_AND_PIECEWISE: attention backend support is "
        "UNIFORM_BATCH: full graphs only for uniform batches; mixed batches use "
        "piecewise graphs"
    ]
