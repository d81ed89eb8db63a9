"""The engine under KV pressure: admission control, preemption by recompute, rejection,
recovery after a failing step, and the step API (add_request / step / abort)."""

import random

import pytest
import torch

from framework import LLM, RequestOutput, SamplingParams
from framework.engine.kv_cache import KVCacheSpec

BLOCK = 16


def kv_bytes(llm_or_path, blocks: int) -> int:
    from models.config import ModelConfig

    mc = ModelConfig.from_hf_dir(str(llm_or_path))
    spec = KVCacheSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, torch.float32, BLOCK)
    return blocks * spec.bytes_per_block


def small_llm(path, blocks: int, **kw) -> LLM:
    kw.setdefault("max_model_len", 128)
    return LLM(
        str(path),
        optimization_level=0,
        max_num_seqs=4,
        kv_cache_memory_bytes=kv_bytes(path, blocks),
        **kw,
    )


@pytest.fixture(scope="module")
def roomy(llama_checkpoint):
    return LLM(str(llama_checkpoint), optimization_level=0, max_num_seqs=4, max_model_len=160)


def alone(llm, prompts, n):
    return [llm.generate([p], n, ignore_eos=True)[0] for p in prompts]


def assert_clean(llm):
    assert llm.block_manager.num_free == llm.block_manager.num_usable
    llm.block_manager.check()
    assert not llm.has_unfinished()


def test_issue_case_12_blocks_four_99_token_prompts(llama_checkpoint, roomy):
    """The reported failing case: 12 blocks, 4 prompts of 99 tokens, 20 new tokens each used to
    raise 'out of KV cache blocks' and leave the LLM unusable."""
    g = random.Random(0)
    prompts = [[g.randrange(256) for _ in range(99)] for _ in range(4)]
    llm = small_llm(llama_checkpoint, 12)
    assert llm.stats["kv_blocks_total"] == 11
    assert llm.generate(prompts, 20, ignore_eos=True) == alone(roomy, prompts, 20)
    assert_clean(llm)
    assert llm.generate([[1, 2, 3]], max_new_tokens=3, ignore_eos=True) == roomy.generate(
        [[1, 2, 3]], 3, ignore_eos=True
    )


def test_decode_growth_preempts_newest_and_keeps_its_output(llama_checkpoint, roomy):
    g = random.Random(1)
    prompts = [[g.randrange(256) for _ in range(20)] for _ in range(4)]
    llm = small_llm(llama_checkpoint, 12)  # 4 x 2 blocks admitted, 4 x 4 needed later
    outs = llm.generate(prompts, 40, ignore_eos=True, return_outputs=True)
    assert [o.token_ids for o in outs] == alone(roomy, prompts, 40)
    assert llm.stats["preemptions"] > 0
    assert sum(o.stats["preemptions"] for o in outs) == llm.stats["preemptions"]
    assert outs[0].stats["preemptions"] == 0  # the oldest is never the victim
    assert all(o.finish_reason == "length" for o in outs)
    assert_clean(llm)


def test_request_that_can_never_fit_is_rejected_and_others_run_on(llama_checkpoint, roomy):
    llm = small_llm(llama_checkpoint, 12, max_model_len=512)
    ok = llm.add_request([5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))
    with pytest.raises(ValueError, match=r"request 1: .*needs 12 KV blocks.*holds 11"):
        llm.add_request([1] * 99, SamplingParams(max_tokens=90))
    done = []
    while llm.has_unfinished():
        done += llm.step()
    assert [(o.request_id, o.token_ids) for o in done] == [
        (ok, roomy.generate([[5, 6, 7]], 5, ignore_eos=True)[0])
    ]
    assert llm.stats["rejections"] == 1
    with pytest.raises(ValueError, match="prompt 1: .*KV blocks"):
        llm.generate([[1, 2], [1] * 99], 90)  # all or nothing: nothing ran
    assert_clean(llm)


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "3"])
def test_max_new_tokens_must_be_a_positive_int(roomy, value):
    with pytest.raises(ValueError, match="max_new_tokens: must be a positive int"):
        roomy.generate([[1, 2]], value)


@pytest.mark.parametrize(
    "token,match",
    [
        (1.5, "prompt 0 prompt\\[1\\]: token ids must be ints"),
        (True, "token ids must be ints"),
        (-1, "outside the vocabulary"),
        (256, "outside the vocabulary"),
    ],
)
def test_token_ids_are_ints_in_range(roomy, token, match):
    with pytest.raises(ValueError, match=match):
        roomy.generate([[1, token]], 2)
    assert_clean(roomy)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("top_k", -2),
        ("top_k", 1.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", 2),
        ("repetition_penalty", 0),
        ("presence_penalty", 3),
        ("frequency_penalty", "x"),
        ("seed", 1.0),
        ("max_tokens", 0),
        ("max_tokens", True),
        ("ignore_eos", 1),
        ("logprobs", -1),
        ("stop_token_ids", "12"),
        ("stop_token_ids", [1.0]),
    ],
)
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}:"):
        SamplingParams(**{field: value})


def _raise_on_call(module, calls: list, when: int):
    def hook(mod, args):
        calls.append(1)
        if len(calls) == when:
            raise RuntimeError("injected fault")

    return module.register_forward_pre_hook(hook)


def test_exception_inside_forward_leaves_engine_usable(llama_checkpoint, roomy):
    g = random.Random(2)
    prompts = [[g.randrange(256) for _ in range(g.randint(5, 40))] for _ in range(4)]
    expected = alone(roomy, prompts, 12)
    llm = small_llm(llama_checkpoint, 12)
    calls = []
    handle = _raise_on_call(llm.model.model.layers[1], calls, when=6)
    with pytest.raises(RuntimeError, match="injected fault"):
        llm.generate(prompts, 12, ignore_eos=True)
    handle.remove()
    assert_clean(llm)
    assert llm.stats["step_errors"] == 1
    assert llm.generate(prompts, 12, ignore_eos=True) == expected
    assert_clean(llm)


def test_step_api_survives_a_failing_step(llama_checkpoint, roomy):
    """Through the step API the failed step's requests go back to waiting and finish later,
    with the tokens they would have had."""
    prompts = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]
    expected = alone(roomy, prompts, 10)
    llm = small_llm(llama_checkpoint, 12)
    ids = [llm.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True)) for p in prompts]
    for _ in range(4):
        assert llm.step() == []
    calls = []
    handle = _raise_on_call(llm.model.model.layers[0], calls, when=1)
    with pytest.raises(RuntimeError, match="injected fault"):
        llm.step()
    handle.remove()
    assert llm.block_manager.num_free == llm.block_manager.num_usable  # nothing half-scheduled
    assert len(llm.scheduler.waiting) == 3 and not llm.scheduler.running
    done = {}
    while llm.has_unfinished():
        done.update({o.request_id: o.token_ids for o in llm.step()})
    assert [done[i] for i in ids] == expected
    assert_clean(llm)


def test_requests_arrive_while_others_decode_and_abort(llama_checkpoint, roomy):
    llm = small_llm(llama_checkpoint, 20)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    a = llm.add_request([1, 2, 3], sp, stream=True)
    first = llm.step()
    assert len(first) == 1 and first[0].request_id == a and len(first[0].token_ids) == 1
    assert first[0].finish_reason is None
    b = llm.add_request([4, 5, 6, 7], sp)
    c = llm.add_request([8, 9], sp)
    assert [len(o.token_ids) for o in llm.step()] == [2]  # only a streams
    assert llm.abort(c) and not llm.abort(c) and not llm.abort(12345)
    finished = {}
    streamed = []
    while llm.has_unfinished():
        for o in llm.step():
            if o.finished:
                finished[o.request_id] = o
            else:
                streamed.append(len(o.token_ids))
    assert set(finished) == {a, b}
    assert streamed == list(range(3, 8))  # a's incremental outputs, one token per step
    assert isinstance(finished[a], RequestOutput)
    assert finished[a].token_ids == roomy.generate([[1, 2, 3]], 8, ignore_eos=True)[0]
    assert finished[b].token_ids == roomy.generate([[4, 5, 6, 7]], 8, ignore_eos=True)[0]
    assert finished[b].prompt_token_ids == [4, 5, 6, 7] and finished[b].text is None
    assert llm.stats["aborted"] == 1
    assert_clean(llm)


def test_stop_token_ids_and_logprobs(roomy):
    ref = roomy.generate([[3, 17, 42]], 6, ignore_eos=True)[0]
    out = roomy.generate(
        [[3, 17, 42]],
        sampling_params=SamplingParams(max_tokens=6, stop_token_ids=[ref[2]], logprobs=3),
        return_outputs=True,
    )[0]
    assert out.token_ids == ref[:3] and out.finish_reason == "stop"
    assert len(out.logprobs) == 3
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert len(lp) == 3 and tok in lp  # greedy: the chosen token is the top one
        assert max(lp, key=lp.get) == tok and lp[tok] <= 0


def test_seeded_sampling_survives_preemption(llama_checkpoint, roomy):
    """The sampling noise is keyed by (seed, output index): a preempted, recomputed request
    draws the tokens it would have drawn without pressure."""
    g = random.Random(3)
    prompts = [[g.randrange(256) for _ in range(20)] for _ in range(4)]
    sps = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=40, ignore_eos=True)
        for i in range(4)
    ]
    want = [roomy.generate([p], sampling_params=sp)[0] for p, sp in zip(prompts, sps)]
    llm = small_llm(llama_checkpoint, 12)
    assert llm.generate(prompts, sampling_params=sps) == want
    assert llm.stats["preemptions"] > 0
    assert_clean(llm)
