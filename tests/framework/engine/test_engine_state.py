"""One engine, many models: every engine owns its state (forward context, tensor-parallel
state, CUDA-graph pool), several threads may call one engine, and no output is dropped.

Before: the forward context and the TP state were module globals, the CUDA-graph pool was
shared by every engine of the process and ``torch.cuda.empty_cache`` was swapped
process-wide during captures, two threads calling ``generate`` on one ``LLM`` raised internal
errors (or returned wrong tokens), and a request queued with ``add_request`` that finished
inside ``generate`` was lost.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from framework.core.forward_context import (
    ForwardContext,
    is_forward_context_available,
    set_forward_context,
)
from framework.core.parallel_state import TPState, get_tp_state, tp_state
from framework.engine.llm import LLM
from framework.engine.observers import FirstTokenLogits
from framework.engine.sampling_params import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]


def _in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_forward_context_belongs_to_the_thread_that_set_it():
    with set_forward_context(ForwardContext({}, {})):
        assert is_forward_context_available()
        assert _in_thread(is_forward_context_available) is False
    assert not is_forward_context_available()


def test_tp_state_is_scoped_and_per_thread():
    assert get_tp_state() == TPState()
    with tp_state(TPState(1, 2, "g")):
        assert get_tp_state() == TPState(1, 2, "g")
        assert _in_thread(get_tp_state) == TPState()  # another thread builds as rank 0 of 1
    assert get_tp_state() == TPState()
    with pytest.raises(ValueError, match="rank 2 outside"):
        TPState(2, 2)


def test_two_models_in_one_process_generate_alternately(tiny_checkpoint, compile_cache_dir):
    """Two different models at two levels, alternating for several rounds: each one's
    tokens equal what it produced alone (before the other one existed)."""
    torch.set_num_threads(1)
    a = LLM(str(tiny_checkpoint("llama")), optimization_level=0, max_model_len=128)
    a_ref = a.generate(PROMPTS, max_new_tokens=6)
    b = LLM(
        str(tiny_checkpoint("qwen2")),
        compilation_config={"level": 1, "compiler": "eager"},
        cache_dir=compile_cache_dir,
        max_model_len=128,
    )
    b_ref = b.generate(PROMPTS[::-1], max_new_tokens=6)
    assert b_ref != a_ref[::-1]  # two different models
    for _ in range(3):
        assert a.generate(PROMPTS, max_new_tokens=6) == a_ref
        assert b.generate(PROMPTS[::-1], max_new_tokens=6) == b_ref


def test_each_engine_has_its_own_graph_pool(llama_checkpoint):
    cc = dict(level=1, compiler="eager", pass_config={"passes": []}, progress_bar=False)
    cc.update(cudagraph_mode="PIECEWISE", cudagraph_capture_sizes=[1, 2, 4])
    kw = dict(max_model_len=64, max_num_seqs=4, emulate_cuda_graphs=True, compilation_config=cc)
    a, b = LLM(str(llama_checkpoint), **kw), LLM(str(llama_checkpoint), **kw)
    assert a.graphs.graph_ops is not b.graphs.graph_ops
    assert a.graphs.graph_ops.shared_pool() is not b.graphs.graph_ops.shared_pool()
    # Each engine's first capture collects garbage (its own pool starts empty).
    assert a.graphs.graph_ops.gc_requests[:1] == b.graphs.graph_ops.gc_requests[:1] == [True]
    assert a.generate(PROMPTS, max_new_tokens=4) == b.generate(PROMPTS, max_new_tokens=4)


def test_cuda_capture_swaps_nothing_process_wide(monkeypatch):
    """The capture skips ``torch.cuda.empty_cache`` without replacing it (another thread, or
    engine, calling it meanwhile gets the real one); it empties the cache before the first
    capture only, and replays each graph once after its capture."""
    from framework.cudagraph import wrapper

    calls, seen = [], []
    original = torch.cuda.empty_cache

    class FakeGraph:
        def capture_begin(self, *a, **k):
            calls.append("begin")

        def capture_end(self):
            calls.append("end")

        def replay(self):
            calls.append("replay")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    patched = torch.cuda.empty_cache
    ops = wrapper.CUDAGraphOps()
    for first in (True, False):
        ops.capture(lambda: seen.append(torch.cuda.empty_cache), ops.shared_pool(),
                    collect_garbage=first)  # fmt: skip
    assert seen == [patched, patched]  # never swapped during a capture
    # each capture is replayed once (a capture alone runs nothing), outside the capture
    assert calls == ["empty", "begin", "end", "replay", "begin", "end", "replay"]
    assert wrapper.CUDAGraphOps().shared_pool() is not ops.shared_pool()
    assert original is not patched


def _threads(llm, expected, calls=5, threads=2):
    errors, results = [], []

    def run():
        try:
            for _ in range(calls):
                results.append(llm.generate(PROMPTS, max_new_tokens=6))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=run) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    assert results == [expected] * (calls * threads)


@pytest.mark.parametrize("level", [0, 2])
def test_generate_from_two_threads(llama_checkpoint, compile_cache_dir, level):
    """2 threads x 5 generate calls on one LLM, many repetitions: the calls are serialised
    and every one returns its own, correct tokens."""
    torch.set_num_threads(1)
    llm = LLM(
        str(llama_checkpoint), optimization_level=level, max_model_len=128,
        cache_dir=compile_cache_dir,
    )  # fmt: skip
    expected = llm.generate(PROMPTS, max_new_tokens=6)
    for _ in range(4 if level else 10):
        _threads(llm, expected)
    assert not llm.has_unfinished()
    assert llm.block_manager.num_free == llm.block_manager.num_usable


def test_step_api_thread_beside_generate(llama_checkpoint):
    """A step-API loop in one thread (as a server runs) and generate calls in another: each
    side gets exactly its own outputs."""
    torch.set_num_threads(1)
    llm = LLM(str(llama_checkpoint), optimization_level=0, max_model_len=128)
    expected = llm.generate(PROMPTS, max_new_tokens=6)
    got: dict[int, list[int]] = {}
    ids = []

    def loop():
        for i in range(6):
            ids.append(llm.add_request(PROMPTS[i % 3], SamplingParams(max_tokens=6)))
            for out in llm.step():
                got[out.request_id] = out.token_ids
        while llm.has_unfinished():
            for out in llm.step():
                got[out.request_id] = out.token_ids

    t = threading.Thread(target=loop)
    t.start()
    for _ in range(5):
        assert llm.generate(PROMPTS, max_new_tokens=6) == expected
    t.join()
    assert {i: got[i] for i in ids} == {i: expected[k % 3] for k, i in enumerate(ids)}


def test_output_of_a_queued_request_is_not_dropped_by_generate(llama_checkpoint):
    """``add_request`` then ``generate``: the queued request runs inside generate and its
    output comes back from the next ``step`` (before: lost, ``step`` returned [])."""
    llm = LLM(str(llama_checkpoint), optimization_level=0, max_model_len=128)
    expected = llm.generate(PROMPTS, max_new_tokens=6)
    rid = llm.add_request(PROMPTS[0], SamplingParams(max_tokens=6))
    assert llm.generate(PROMPTS[1:], max_new_tokens=6) == expected[1:]
    assert llm.has_unfinished()  # an output is still to be returned
    outs = llm.step()
    assert [(o.request_id, o.token_ids, o.finish_reason) for o in outs] == [
        (rid, expected[0], "length")
    ]
    assert not llm.has_unfinished() and llm.step() == []


def test_first_token_logits_is_an_observer(llama_checkpoint):
    """Recorded only while attached; matches the logits of a fresh eager forward."""
    llm = LLM(str(llama_checkpoint), optimization_level=0, max_model_len=128)
    assert llm.engine.observers == []
    with FirstTokenLogits.attached(llm) as first:
        out = llm.generate(PROMPTS, max_new_tokens=2)
    logits = first.take()
    assert llm.engine.observers == [] and len(logits) == len(PROMPTS)
    assert [int(x.argmax()) for x in logits] == [o[0] for o in out]
    llm.generate(PROMPTS, max_new_tokens=2)
    assert first.take() == []  # detached: nothing recorded
