"""Nothing silent, nothing lost, for requests and weights: invalid sampling parameters are
refused at the door naming the request and field; a request that still fails inside a step
(the sampler raised for it, or its logits are not finite) finishes alone with
``finish_reason`` "error" and a message, while the rest of its batch goes on; non-finite
weights are reported at load; a soak with bad requests mixed in loses nothing."""

import math
import random
import warnings

import pytest
import torch

from framework import LLM, SamplingParams
from framework.engine.request import Request
from framework.engine.sampler import Sampler
from models.loader import CheckpointError, NonFiniteWeightWarning
from tests.checkpoints import derive_checkpoint

PROMPTS = [[3, 17, 42, 9], [8, 1, 250], [77, 12, 5, 90, 31], [4, 4, 4]]


@pytest.fixture(autouse=True)
def one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def llm(llama_checkpoint):
    return LLM(str(llama_checkpoint), optimization_level=0, max_num_seqs=4, max_model_len=64)


def alone(llm, prompt, sp):
    return llm.generate([prompt], sampling_params=sp)[0]


def all_blocks_free(llm):
    s = llm.stats
    return s["kv_blocks_free"] == s["kv_blocks_total"]


# ----------------------------------------------------------------------------- the door
@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", math.nan),
        ("min_p", math.nan),
        ("repetition_penalty", math.nan),
        ("repetition_penalty", math.inf),
        ("presence_penalty", math.nan),
        ("frequency_penalty", -math.inf),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
    ],
)
def test_non_finite_and_out_of_range_params_are_refused(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_logprobs_beyond_the_vocabulary_is_refused_at_add_request(llm):
    vocab = llm.model_config.vocab_size
    with pytest.raises(ValueError, match=r"request \d+: SamplingParams.logprobs=1000 exceeds"):
        llm.add_request([1, 2, 3], SamplingParams(logprobs=1000))
    with pytest.raises(ValueError, match=r"prompt 1: SamplingParams.logprobs"):
        llm.generate(
            [[1, 2], [3, 4]], sampling_params=[SamplingParams(), SamplingParams(logprobs=vocab + 1)]
        )
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.add_request([1, 2, 3], SamplingParams(stop_token_ids=(vocab,)))
    assert not llm.has_unfinished()
    # the whole vocabulary is a valid number of logprobs
    (out,) = llm.generate(
        [[1, 2]], sampling_params=SamplingParams(logprobs=vocab, max_tokens=2), return_outputs=True
    )
    assert len(out.logprobs[0]) == vocab


def test_seed_at_the_range_ends_samples(llm):
    for seed in (2**63 - 1, -(2**63)):
        sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=3)
        assert len(alone(llm, [1, 2, 3], sp)) == 3


def test_top_k_beyond_the_vocabulary_is_clamped_when_every_request_samples(llm):
    vocab = llm.model_config.vocab_size
    big = [SamplingParams(temperature=1.0, top_k=vocab + 1, seed=i, max_tokens=4) for i in range(3)]
    every = [sp.replace(top_k=0) for sp in big]
    got = llm.generate(PROMPTS[:3], sampling_params=big, ignore_eos=True)
    assert got == llm.generate(PROMPTS[:3], sampling_params=every, ignore_eos=True)


def test_generate_takes_a_generator_of_prompts(llm):
    expected = llm.generate(PROMPTS, 3, ignore_eos=True)
    assert llm.generate((p for p in PROMPTS), 3, ignore_eos=True) == expected


# ----------------------------------------------------------------------------- fail alone
def test_a_sampler_failure_fails_only_its_request(llm, monkeypatch):
    sps = [SamplingParams(temperature=0.8, seed=i, max_tokens=6, ignore_eos=True) for i in range(4)]
    expected = [alone(llm, p, sp) for p, sp in zip(PROMPTS, sps)]
    ids = [llm.add_request(p, sp) for p, sp in zip(PROMPTS, sps)]
    bad = ids[2]
    real = Sampler._sample

    def failing(self, x, reqs, params):
        if any(r.req_id == bad and len(r.output) == 2 for r in reqs):
            raise RuntimeError("injected sampler fault")
        return real(self, x, reqs, params)

    monkeypatch.setattr(Sampler, "_sample", failing)
    outs = {}
    while llm.has_unfinished():
        for out in llm.step():
            outs[out.request_id] = out
    assert sorted(outs) == sorted(ids)
    for rid, exp in zip(ids, expected):
        if rid == bad:
            assert outs[rid].finish_reason == "error"
            assert f"request {bad}" in outs[rid].error
            assert "injected sampler fault" in outs[rid].error
            assert outs[rid].token_ids == exp[:2]
        else:
            assert outs[rid].finish_reason == "length" and outs[rid].error is None
            assert outs[rid].token_ids == exp
    assert all_blocks_free(llm)
    monkeypatch.undo()
    assert llm.generate([PROMPTS[0]], sampling_params=sps[0]) == [expected[0]]


def test_non_finite_logits_fail_their_row_not_token_zero():
    reqs = [
        Request(i, [1, 2], 4, params=SamplingParams(**kw))
        for i, kw in enumerate(
            [
                {},
                {},
                {"temperature": 1.0, "seed": 3},
                {"temperature": 1.0, "seed": 4, "logprobs": 2},
            ]
        )
    ]
    logits = torch.randn(4, 16)
    for rows in ([0, 1], [2, 3]):  # the greedy fast path, then the sampling path
        batch = [reqs[i] for i in rows]
        for r in batch:
            r.error, r.finished, r.finish_reason = None, False, None
        x = logits[rows].clone()
        x[0, 5] = math.nan
        tokens, lps = Sampler()(x, batch)
        assert tokens[0] is None and batch[0].finish_reason == "error"
        assert "not finite" in batch[0].error and f"request {batch[0].req_id}" in batch[0].error
        assert tokens[1] is not None and batch[1].error is None
        alone_tokens, alone_lps = Sampler()(logits[rows[1:]], batch[1:])
        assert tokens[1] == alone_tokens[0]
        if lps is not None:
            assert lps[0] is None and lps[1] == alone_lps[0]


@pytest.fixture(scope="module")
def nan_checkpoint(llama_checkpoint, tmp_path_factory):
    def poison(tensors):
        tensors["model.layers.0.mlp.down_proj.weight"][0, 0] = math.nan

    return derive_checkpoint(llama_checkpoint, tmp_path_factory.mktemp("nan") / "m", poison)


def test_non_finite_weights_are_reported_at_load_and_requests_error(nan_checkpoint):
    with pytest.warns(NonFiniteWeightWarning, match="model.layers.0.mlp.down_proj.weight"):
        llm = LLM(str(nan_checkpoint), optimization_level=0, max_num_seqs=2, max_model_len=64)
    assert llm.stats["weight_check_s"] > 0
    outs = llm.generate([[1, 2, 3], [4, 5]], 4, return_outputs=True)
    for out in outs:
        assert out.finish_reason == "error" and "not finite" in out.error
        assert out.token_ids == []
    assert all_blocks_free(llm)
    with pytest.raises(CheckpointError, match="down_proj.weight.*NaN or inf"):
        LLM(str(nan_checkpoint), optimization_level=0, max_model_len=64, strict_weights=True)


def test_a_finite_checkpoint_loads_without_warning(llama_checkpoint):
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteWeightWarning)
        LLM(str(llama_checkpoint), optimization_level=0, max_model_len=64)


# ----------------------------------------------------------------------------- soak
BAD_PARAMS = [
    lambda vocab: dict(logprobs=vocab + 5),  # refused at add_request
    lambda vocab: dict(stop_token_ids=(vocab + 1,)),  # refused at add_request
    lambda vocab: dict(temperature=math.nan),  # refused at construction
    lambda vocab: dict(seed=2**64),  # refused at construction
    lambda vocab: "sampler-fault",  # accepted, then fails alone inside a step
]


def test_soak_with_bad_requests(llama_checkpoint, monkeypatch):
    g = random.Random(0)
    llm = LLM(
        str(llama_checkpoint), optimization_level=0, max_num_seqs=8, max_model_len=48, block_size=4
    )
    vocab = llm.model_config.vocab_size
    work = []
    for i in range(200):
        prompt = [g.randrange(vocab) for _ in range(g.randint(1, 16))]
        sp = dict(max_tokens=g.randint(1, 8), ignore_eos=g.random() < 0.7)
        if g.random() < 0.5:
            sp.update(temperature=0.9, seed=g.randrange(1000), top_k=g.choice([0, 5, vocab + 3]))
        bad = BAD_PARAMS[(i // 10) % 5](vocab) if i % 10 == 3 else None
        work.append((prompt, sp, bad))
    faulty: set[int] = set()
    real = Sampler._sample

    def failing(self, x, reqs, params):
        if any(r.req_id in faulty for r in reqs):
            raise RuntimeError("injected sampler fault")
        return real(self, x, reqs, params)

    monkeypatch.setattr(Sampler, "_sample", failing)
    ids, refused, outs = {}, 0, {}
    pending = list(range(len(work)))
    while pending or llm.has_unfinished():
        for _ in range(g.choice([0, 1, 2, 3])):
            if not pending:
                break
            i = pending.pop(0)
            prompt, sp, bad = work[i]
            try:
                if isinstance(bad, dict):
                    params = SamplingParams(**{**sp, **bad})
                else:
                    params = SamplingParams(**sp)
                rid = llm.add_request(prompt, params)
            except ValueError:
                assert isinstance(bad, dict)
                refused += 1
                continue
            ids[rid] = i
            if bad == "sampler-fault":
                faulty.add(rid)
        for out in llm.step():
            outs[out.request_id] = out
    assert refused == 16 and len(faulty) == 4
    monkeypatch.setattr(Sampler, "_sample", real)
    assert all_blocks_free(llm)
    llm.block_manager.check()
    ref = LLM(
        str(llama_checkpoint), optimization_level=0, max_num_seqs=1, max_model_len=48, block_size=4
    )
    for rid, i in ids.items():
        out = outs[rid]
        if rid in faulty:
            assert out.finish_reason == "error" and "injected sampler fault" in out.error
        else:
            prompt, sp, _ = work[i]
            assert out.error is None
            assert out.token_ids == alone(ref, prompt, SamplingParams(**sp)), i
