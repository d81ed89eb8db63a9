"""The one dummy-batch path (framework/engine/capture.py): null-block dummies for graph
capture, real blocks (freed afterwards) for warm-up and calibration."""

from __future__ import annotations

import pytest

from framework.core.forward_context import BatchDescriptor
from framework.engine.block_manager import BlockManager
from framework.engine.capture import dummy_batch, dummy_sizes, split_tokens
from framework.engine.kv_cache import NULL_BLOCK


def test_dummy_sizes_per_key():
    assert dummy_sizes(BatchDescriptor(8, 8, True), 64, 8) == [1] * 8
    assert dummy_sizes(BatchDescriptor(10, 2, True), 64, 8) == [5, 5]  # verify keys: 1 + k
    assert dummy_sizes(BatchDescriptor(8, None, False), 64, 8) == [8]
    assert dummy_sizes(BatchDescriptor(8, 2, False), 64, 8) == [8]


def test_a_key_longer_than_one_request_is_split_into_requests_that_fit():
    """max_num_batched_tokens 512 with max_model_len 104, i.e. rows of 7 blocks of 16 = 112
    tokens (the GPU decode benchmark's settings): a 512-token key is four 112-token requests
    and one of 64, not one request whose blocks overflow its block-table row (what the second
    GPU run of the check hit).  More tokens than ``max_num_seqs`` rows hold are cut to what
    they hold: under the key's descriptor the rest are padding rows, as in a real step."""
    assert dummy_sizes(BatchDescriptor(512, None, False), 112, 32) == [112] * 4 + [64]
    assert split_tokens(224, 112, 2) == [112, 112]
    assert split_tokens(300, 112, 2) == [112, 112]
    with pytest.raises(ValueError, match="must be positive"):
        split_tokens(8, 0, 2)


def test_a_capture_key_beyond_what_the_rows_hold_still_captures(llama_checkpoint):
    """One sequence of at most 16 tokens (one block per row) and capture sizes up to 64: the
    64-token key captures with 16 real tokens and 48 padding rows, and the engine runs."""
    from framework import LLM, CompilationConfig

    llm = LLM(
        str(llama_checkpoint),
        compilation_config=CompilationConfig(
            level=1,
            compiler="eager",
            pass_config={"passes": []},
            progress_bar=False,
            cudagraph_mode="PIECEWISE",
            cudagraph_capture_sizes=[1, 16, 64],
        ),
        max_num_seqs=1,
        max_model_len=16,
        max_num_batched_tokens=64,
        emulate_cuda_graphs=True,
    )
    assert llm.runner.max_request_tokens == 16
    assert llm.stats["captures"] == 3 * (llm.model_config.num_layers + 1)  # every key, every piece
    assert llm.generate([[3, 1, 4, 1, 5]], 4, ignore_eos=True)


def test_null_block_dummies():
    with dummy_batch([1, 1, 5], block_size=4) as chunks:
        assert [c.num_tokens for c in chunks] == [1, 1, 5]
        assert [c.req.block_ids for c in chunks] == [[0], [0], [0, 0]]
        assert all(c.req.req_id < 0 and c.start == 0 and c.samples for c in chunks)
        assert NULL_BLOCK == 0


def test_real_blocks_are_freed_even_when_the_body_raises():
    bm = BlockManager(10, 4, False)
    free0 = bm.num_free
    with pytest.raises(RuntimeError, match="boom"):
        with dummy_batch([6], 4, token_ids=list(range(6)), allocate=bm.allocate, free=bm.free) as (
            chunk,
        ):
            assert len(chunk.req.block_ids) == 2 and 0 not in chunk.req.block_ids
            assert chunk.req.prompt == list(range(6)) and bm.num_free == free0 - 2
            raise RuntimeError("boom")
    assert bm.num_free == free0


def test_bad_arguments_name_the_problem():
    bm = BlockManager(10, 4, False)
    with pytest.raises(ValueError, match="both allocate and free"):
        with dummy_batch([2], 4, allocate=bm.allocate):
            pass
    with pytest.raises(ValueError, match="3 token_ids for 2 tokens"):
        with dummy_batch([2], 4, token_ids=[1, 2, 3]):
            pass
