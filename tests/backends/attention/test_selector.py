"""The backends' CUDA-graph support (min over layers) and the one log line when it changes the
mode (the downgrade table itself: tests/framework/core/test_cudagraph_mode.py)."""

import logging

import pytest

from backends.attention import torch_paged  # noqa: F401  (registers "torch")
from backends.attention.common import AttentionBackend, AttentionCGSupport, register_backend
from backends.attention.selector import min_support, select_cudagraph_mode
from framework.core.forward_context import CUDAGraphMode

M, S = CUDAGraphMode, AttentionCGSupport
FAP = M.FULL_AND_PIECEWISE


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
