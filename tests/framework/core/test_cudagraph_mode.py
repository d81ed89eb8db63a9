"""The effective CUDA-graph mode: the downgrade table per attention support level, and the
CUDA / piecewise-compilation checks that CompilationConfig.resolve applies."""

import pytest

from framework.core.cudagraph_mode import AttentionCGSupport, effective_cudagraph_mode
from framework.core.forward_context import CUDAGraphMode

M, S = CUDAGraphMode, AttentionCGSupport
FAP, FDO = M.FULL_AND_PIECEWISE, M.FULL_DECODE_ONLY


def resolve_cudagraph_mode(requested, support, *, piecewise_available=True, **kw):
    return effective_cudagraph_mode(
        requested, support=support, piecewise_compiled=piecewise_available, **kw
    )


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


@pytest.mark.parametrize("requested", list(M))
def test_without_cuda_every_mode_is_none(requested):
    mode, reason = effective_cudagraph_mode(requested, has_cuda=False)
    assert mode is M.NONE
    assert (reason is None) == (requested is M.NONE)


@pytest.mark.parametrize(
    "requested,expected", [(M.PIECEWISE, M.FULL), (FAP, M.FULL), (M.FULL, M.FULL), (FDO, FDO)]
)
def test_piecewise_graphs_need_piecewise_compilation(requested, expected):
    mode, reason = effective_cudagraph_mode(requested, piecewise_compiled=False)
    assert mode is expected
    assert (reason is None) == (mode is requested)


@pytest.mark.parametrize("requested", list(M))
@pytest.mark.parametrize("support", list(S))
@pytest.mark.parametrize("piecewise", [True, False])
def test_applying_it_again_changes_nothing(requested, support, piecewise):
    once, _ = effective_cudagraph_mode(requested, support=support, piecewise_compiled=piecewise)
    again, why = effective_cudagraph_mode(once, support=support, piecewise_compiled=piecewise)
    assert again is once and why is None
