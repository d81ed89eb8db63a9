"""Speculative decoding through the engine: greedy tokens identical with it on and off (four
families, O0 and O2, batched prompts of different lengths, prefix caching, preemption), KV
rollback, EOS / max_tokens inside an accepted run, streaming, stats, the verify batches the
dispatcher sees, and the sampled distribution (chi-square) on a small-vocabulary model."""

import logging

import numpy as np
import pytest
import torch

from framework import LLM, CompilationConfig, SamplingParams
from framework.engine.kv_cache import KVCacheSpec
from models.config import ModelConfig

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K}


def copy_prompts():
    """Prompts of different lengths whose continuation can copy earlier text."""
    a = [11, 12, 13, 14, 15]
    b = [40, 41, 42, 43, 44, 45, 46]
    c = [90, 91, 92]
    return [a * 3, b * 4 + [40, 41], c * 2 + [7], [5, 6, 7, 8, 9, 10, 5, 6]]


def build(path, spec=None, level=0, cache=None, **kw):
    kw.setdefault("max_model_len", 128)
    kw.setdefault("max_num_seqs", 4)
    return LLM(str(path), optimization_level=level, cache_dir=cache, speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def ref_llama(llama_checkpoint):
    return build(llama_checkpoint, None)


@pytest.fixture(scope="module")
def spec_llama(llama_checkpoint):
    """One n-gram engine shared by the tests that only read what it does (stats add up)."""
    return build(llama_checkpoint, NGRAM)


def assert_clean(llm):
    assert llm.block_manager.num_free == llm.block_manager.num_usable
    llm.block_manager.check()
    assert not llm.has_unfinished()


def check_identical(path, level=0, cache=None, n=24, **kw):
    ref = build(path, None, level, cache, **kw).generate(copy_prompts(), n, ignore_eos=True)
    llm = build(path, NGRAM, level, cache, **kw)
    got = llm.generate(copy_prompts(), n, ignore_eos=True)
    assert got == ref
    st = llm.stats
    # The test means something only when drafts were verified and some were accepted.
    assert st["spec_verify_steps"] > 0 and st["spec_accepted_tokens"] > 0, st
    assert_clean(llm)
    return llm, st


@pytest.mark.parametrize(
    "family",
    # reason for slow: ~5-15 s each on this shared machine; llama stays in the fast suite
    ["llama"] + [pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES[1:]],
)
def test_greedy_tokens_identical_with_ngram_at_o0(tiny_checkpoint, family):
    check_identical(tiny_checkpoint(family))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_identical_with_ngram_at_o2(tiny_checkpoint, family, compile_cache_dir):
    llm, _ = check_identical(tiny_checkpoint(family), level=2, cache=compile_cache_dir)
    assert all(s % (1 + K) == 0 for s in llm.config.cudagraph_capture_sizes)
    assert all(s % (1 + K) == 0 for s in llm.config.compile_sizes)


@pytest.mark.slow(reason="two int8 O2 builds of the tiny model, 10-40 s")
def test_int8_verify_steps_past_the_kernels_max_rows_keep_greedy_tokens(
    llama_checkpoint, compile_cache_dir, caplog
):
    """int8 linears with a small-M limit of 8 rows, verify steps of up to 4 x (1 + K) = 16
    rows: where the int8 kernels take every row count (AVX2 without VNNI: in slices; AMX:
    W8A8 in one call) a row's bits do not depend on the step's size, so steps with drafts are
    not held to 8 rows (``draft_rows_limit`` None); elsewhere they are, and 4 decoding
    requests leave room for one request's drafts a step (a limit of 4 left none: no draft was
    ever verified there).  Either way the greedy tokens are the plain engine's."""
    from passes.int8_small_m import takes_every_row_count, w8a8_takes_every_row_count

    every_count = takes_every_row_count() or w8a8_takes_every_row_count()

    cc = CompilationConfig(kernel_config={"int8_small_m_max_rows": 8}, progress_bar=False)
    llm, _ = check_identical(
        llama_checkpoint,
        level=2,
        cache=compile_cache_dir,
        quantization="int8_per_token",
        compilation_config=cc,
        dtype="bfloat16",  # (an fp32 LM head is oneDNN's at every row count: a limit anyway)
    )
    methods = [getattr(m, "linear_method", None) for m in llm.model.modules()]
    assert any(type(m).__name__ == "PackedInt8LinearMethod" for m in methods)
    assert llm.scheduler.draft_rows_limit == (None if every_count else 8)
    # 4 sequences x (1 + K) = 16 tokens do not fit a limit of 8: the start-up line says so
    said = [r.getMessage() for r in caplog.records if "held to 8 tokens" in r.getMessage()]
    assert len(said) == (0 if every_count else 1), said


def test_greedy_identical_with_prefix_caching(llama_checkpoint):
    shared = [11, 12, 13, 14, 15] * 7  # two full blocks shared by every prompt
    prompts = [shared + p for p in copy_prompts()[:3]]
    kw = dict(enable_prefix_caching=True, max_model_len=160)
    ref_llm = build(llama_checkpoint, None, **kw)
    ref = ref_llm.generate(prompts, 20, ignore_eos=True)
    llm = build(llama_checkpoint, NGRAM, **kw)
    got = [llm.generate([p], 20, ignore_eos=True)[0] for p in prompts]  # one by one: hits
    assert got == ref
    again = llm.generate(prompts, 20, ignore_eos=True)  # all at once, reusing cached blocks
    assert again == ref
    st = llm.stats
    assert st["prefix_cache_hit_tokens"] > 0 and st["spec_accepted_tokens"] > 0
    assert_clean(llm)


def _kv_bytes(path, blocks, block=16):
    mc = ModelConfig.from_hf_dir(str(path))
    spec = KVCacheSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, torch.float32, block)
    return blocks * spec.bytes_per_block


def test_greedy_identical_under_kv_pressure_with_preemption(llama_checkpoint, ref_llama):
    prompts = copy_prompts()
    ref = ref_llama.generate(prompts, 40, ignore_eos=True)
    llm = build(llama_checkpoint, NGRAM, kv_cache_memory_bytes=_kv_bytes(llama_checkpoint, 12))
    got = llm.generate(prompts, 40, ignore_eos=True)
    assert got == ref
    st = llm.stats
    assert st["preemptions"] > 0 and st["spec_accepted_tokens"] > 0, st
    assert_clean(llm)


def test_rejected_drafts_roll_back_their_blocks(llama_checkpoint):
    """After every step a running request holds exactly the blocks of its computed tokens
    (as after a plain decode step): the slots of rejected drafts are given back."""
    llm = build(llama_checkpoint, {"method": "ngram", "num_speculative_tokens": 7}, max_num_seqs=2)
    bs = llm.scheduler.block_size
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ids = [llm.add_request(p, params) for p in copy_prompts()[:2]]
    seen_verify = False
    while llm.has_unfinished():
        llm.step()
        for r in llm.scheduler.running:
            assert r.num_computed == r.num_tokens - 1
            assert len(r.block_ids) == -(-r.num_computed // bs), (r.num_computed, r.block_ids)
        seen_verify |= llm.stats.get("spec_verify_steps", 0) > 0
    assert seen_verify and len(ids) == 2
    assert_clean(llm)


def test_max_tokens_and_eos_inside_an_accepted_run(ref_llama, spec_llama):
    prompts = copy_prompts()
    full = ref_llama.generate(prompts, 24, ignore_eos=True)
    llm = spec_llama
    for n in (2, 7):
        assert llm.generate(prompts, n, ignore_eos=True) == [f[:n] for f in full]
    # A stop token in the middle of the greedy output: the output ends right at it.
    stop = full[0][9]
    cut = full[0][: full[0].index(stop) + 1]
    out = llm.generate(
        [prompts[0]],
        sampling_params=SamplingParams(max_tokens=24, stop_token_ids=(stop,), ignore_eos=True),
        return_outputs=True,
    )[0]
    assert out.token_ids == cut and out.finish_reason == "stop"
    assert_clean(llm)


def test_streaming_step_api_and_stats(ref_llama, spec_llama):
    llm = spec_llama
    ref = ref_llama.generate(copy_prompts()[:2], 20, ignore_eos=True)
    rids = [
        llm.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True), stream=True)
        for p in copy_prompts()[:2]
    ]
    seen = {r: [] for r in rids}
    grew_by_more_than_one = False
    while llm.has_unfinished():
        for out in llm.step():
            before = len(seen[out.request_id])
            assert out.token_ids[:before] == seen[out.request_id]  # only ever grows
            grew_by_more_than_one |= len(out.token_ids) - before > 1
            seen[out.request_id] = out.token_ids
    assert [seen[r] for r in rids] == ref
    assert grew_by_more_than_one  # a verify step gave several tokens at once
    st = llm.stats
    per_pos = st["spec_acceptance_rate_per_position"]
    assert len(per_pos) == K and all(0.0 <= a <= 1.0 for a in per_pos)
    acc = st["spec_accepted_per_position"]
    assert all(a >= b for a, b in zip(acc, acc[1:]))  # a later draft only after the earlier
    assert (
        sum(acc) == st["spec_accepted_tokens"]
        and sum(st["spec_drafted_per_position"]) == (st["spec_draft_tokens"])
    )
    assert st["spec_accepted_tokens"] <= st["spec_draft_tokens"]
    assert 1.0 <= st["spec_mean_accepted_length"] <= 1 + K
    assert st["spec_propose_ms_per_step"] > 0 and st["spec_verify_ms_per_step"] > 0
    assert st["verify_steps"] > 0 and "spec_ngram_hit_rate" in st


def test_verify_batches_are_uniform_for_the_dispatcher(spec_llama):
    llm = spec_llama
    assert llm.runner.uniform_query_len == 1 + K
    calls = []
    real = llm.runner.dispatch

    def record(n, reqs, uniform):
        calls.append((n, reqs, uniform))
        return real(n, reqs, uniform)

    llm.runner.dispatch = record
    try:
        llm.generate([[11, 12, 13, 14] * 4, [21, 22, 23, 24] * 4], 20, ignore_eos=True)
    finally:
        llm.runner.dispatch = real
    uniform = [c for c in calls if c[2]]
    assert uniform and all(n == reqs * (1 + K) for n, reqs, _ in uniform)
    # A plain decode batch (one token each) is not uniform for a 1 + k dispatcher.
    assert all(not u for n, reqs, u in calls if n == reqs)


def test_penalties_and_logprobs_are_refused(spec_llama):
    llm = spec_llama
    with pytest.raises(ValueError, match="repetition_penalty=1.2 is not supported with spec"):
        llm.add_request([1, 2, 3], SamplingParams(repetition_penalty=1.2))
    with pytest.raises(ValueError, match="prompt 0: SamplingParams.logprobs"):
        llm.generate([[1, 2, 3]], sampling_params=SamplingParams(logprobs=2))
    assert not llm.has_unfinished()


@pytest.mark.slow  # reason: a Dynamo trace and emulated graph captures (~15 s here)
def test_capture_sizes_rounded_and_loud_warning(llama_checkpoint, ref_llama, caplog):
    """Graphs emulated on CPU (so the sizes are used): capture sizes become multiples of
    1 + k, and sizes that cannot hold max_num_seqs x (1 + k) tokens are said loudly."""
    cc = dict(level=1, compiler="eager", cudagraph_capture_sizes=[1, 2, 4, 8], progress_bar=False)
    with caplog.at_level(logging.WARNING):
        llm = build(
            llama_checkpoint, NGRAM, level=None, compilation_config=cc, emulate_cuda_graphs=True
        )
    assert llm.config.cudagraph_capture_sizes == [4, 8]
    assert llm.graphs.dispatcher.uniform_decode_query_len == 1 + K
    assert llm.worker.spec_size_warning is not None
    msg = [r.getMessage() for r in caplog.records if "speculative decoding" in r.getMessage()]
    assert msg and "[4, 8]" in msg[0] and "16" in msg[0], msg
    out = llm.generate(copy_prompts()[:2], 12, ignore_eos=True)
    assert out == ref_llama.generate(copy_prompts()[:2], 12, ignore_eos=True)


# ---------------------------------------------------------------------- distribution
@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    from checkpoints import build_family_checkpoint

    return build_family_checkpoint(
        tmp_path_factory.mktemp("small-vocab") / "m", "llama", vocab_size=8, seed=5
    )


def _second_tokens(path, spec, n, seed0):
    """Token 2 and 3 of n seeded requests (the first comes from the prefill, the next from a
    verify step when speculating)."""
    llm = build(path, spec, max_num_seqs=64, max_model_len=32, max_num_batched_tokens=512)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=3, seed=seed0 + i, ignore_eos=True)
        for i in range(n)
    ]
    outs = llm.generate([[1, 2, 3, 1, 2, 3, 1, 2]] * n, sampling_params=params)
    return llm, np.array(outs)


def _chi2_p(a, b):
    from test_spec_rejection import chi_square_p

    return chi_square_p(a, b)


@pytest.mark.slow  # reason: 3 x 1500 requests (~35 s here); test_spec_rejection.py is fast
def test_sampled_distribution_matches_without_speculation(small_vocab_model, monkeypatch):
    n = 1500
    _, ref = _second_tokens(small_vocab_model, None, n, 0)
    llm, got = _second_tokens(small_vocab_model, NGRAM, n, 10**6)
    assert llm.stats["spec_accepted_tokens"] > 0
    codes = lambda x: x[:, 1] * 8 + x[:, 2]  # noqa: E731 - the joint of tokens 2 and 3
    ref_c, got_c = np.bincount(codes(ref), minlength=64), np.bincount(codes(got), minlength=64)
    assert _chi2_p(ref_c, got_c) > 1e-3
    from framework.engine.spec import rejection

    # n-gram drafts are one-hot: their rule is rejection.one_hot_accepts; always accepting
    # them is detected
    monkeypatch.setattr(rejection, "one_hot_accepts", lambda draw, d: torch.ones_like(draw > 0))
    _, wrong = _second_tokens(small_vocab_model, NGRAM, n, 2 * 10**6)
    assert _chi2_p(ref_c, np.bincount(codes(wrong), minlength=64)) < 1e-6


@pytest.mark.slow  # reason: a TP=2 start-up (spawns a gloo worker process, ~10 s)
def test_tensor_parallel_target_with_speculation(llama_checkpoint, ref_llama):
    torch.set_num_threads(1)
    ref = ref_llama.generate(copy_prompts(), 20, ignore_eos=True)
    llm = build(llama_checkpoint, NGRAM, tensor_parallel_size=2)
    try:
        got = llm.generate(copy_prompts(), 20, ignore_eos=True)
        st = llm.stats
    finally:
        llm.close()
    assert got == ref
    assert st["spec_accepted_tokens"] > 0


class RandomDrafts:
    """A plugin proposer drafting random tokens (optionally 'sampled' from a uniform q)."""

    def __init__(self, config, context, with_probs=False, bad=False):
        self.num_speculative_tokens = config.num_speculative_tokens
        self.vocab = context.model_config.vocab_size
        self.gen = torch.Generator().manual_seed(0)
        self.with_probs, self.bad = with_probs, bad
        self.released: list[int] = []
        self._n = 0

    def propose(self, reqs):
        self._n = len(reqs)
        k = self.num_speculative_tokens
        if self.bad:
            return [[self.vocab + 5] for _ in reqs]
        return [torch.randint(self.vocab, (k,), generator=self.gen).tolist() for _ in reqs]

    def draft_probs(self):
        if not self.with_probs:
            return None
        k = self.num_speculative_tokens
        return [torch.full((k, self.vocab), 1.0 / self.vocab) for _ in range(self._n)]

    def release(self, req_id):
        self.released.append(req_id)

    def stats(self):
        return {"random_calls": self._n}


@pytest.fixture
def plugin_proposers():
    from framework.engine.spec.proposer import PROPOSERS, register_proposer

    made = []

    def factory(**kw):
        def make(config, context):
            made.append(RandomDrafts(config, context, **kw))
            return made[-1]

        return make

    register_proposer("test_random")(factory())
    register_proposer("test_random_q")(factory(with_probs=True))
    register_proposer("test_bad")(factory(bad=True))
    yield made
    for name in ("test_random", "test_random_q", "test_bad"):
        PROPOSERS.remove(name)


def test_any_drafts_keep_greedy_tokens_and_release_on_finish(
    llama_checkpoint, ref_llama, plugin_proposers
):
    ref = ref_llama.generate(copy_prompts(), 16, ignore_eos=True)
    for method in ("test_random", "test_random_q"):
        llm = build(llama_checkpoint, {"method": method, "num_speculative_tokens": 2})
        assert llm.generate(copy_prompts(), 16, ignore_eos=True) == ref
        prop = plugin_proposers[-1]
        assert sorted(set(prop.released)) == list(range(len(copy_prompts())))
        assert llm.stats["spec_verify_steps"] > 0 and "spec_random_calls" in llm.stats
        assert_clean(llm)
    # Sampling with sampled drafts (q uniform: accepted with min(1, p / q)) runs.
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True)
    out = llm.generate(copy_prompts(), sampling_params=params)
    assert all(len(o) == 12 for o in out)


def test_seeded_sampling_with_ngram_is_the_same_alone_and_batched(llama_checkpoint, spec_llama):
    """Drafts that depend only on the request's own tokens (n-gram) and noise keyed by
    (seed, output index): a seeded request gets the same tokens whatever the batch.  A low
    temperature, so that drafts are accepted in every phase (the random test model's copy
    tokens are rarely likely enough at 0.8: none were, which left the accept path untested
    here), each phase's acceptances counted apart (the engine's stats add up across the
    tests that share it)."""
    llm = spec_llama
    params = [
        SamplingParams(temperature=0.1, top_p=0.9, seed=s, max_tokens=16, ignore_eos=True)
        for s in range(4)
    ]

    def accepted(engine):
        return engine.stats["spec_accepted_tokens"]

    before = accepted(llm)
    alone = [llm.generate([p], sampling_params=sp)[0] for p, sp in zip(copy_prompts(), params)]
    assert accepted(llm) > before
    before = accepted(llm)
    batched = llm.generate(copy_prompts(), sampling_params=params)
    assert batched == alone
    assert accepted(llm) > before
    tight = build(llama_checkpoint, NGRAM, kv_cache_memory_bytes=_kv_bytes(llama_checkpoint, 6))
    assert tight.generate(copy_prompts(), sampling_params=params) == alone
    assert tight.stats["preemptions"] > 0
    assert accepted(tight) > 0


def test_a_proposer_out_of_vocabulary_is_named(llama_checkpoint, plugin_proposers):
    llm = build(llama_checkpoint, {"method": "test_bad", "num_speculative_tokens": 2})
    with pytest.raises(RuntimeError, match="draft token 261 for request 0 is not a token id"):
        llm.generate([[1, 2, 3]], 4, ignore_eos=True)
    assert llm.block_manager.num_free == llm.block_manager.num_usable


def test_a_draft_rows_limit_below_a_full_verify_step_is_said_at_start_up():
    """Steps with drafts held to a limit below max_num_seqs x (1 + k) tokens leave some
    decoding requests without drafts (all of them once max_num_seqs reaches limit - k): the
    start-up line says so with the numbers; nothing is said where nothing is held back."""
    from framework.engine.llm import draft_rows_warning

    assert draft_rows_warning(None, 8, 4) is None  # every row count on the kernel
    assert draft_rows_warning(64, 8, 4) is None  # 40 tokens fit
    assert draft_rows_warning(8, 4, 0) is None  # no speculation
    note = draft_rows_warning(8, 4, 3)
    assert note is not None and "held to 8 tokens" in note and "only 1 of them" in note
    assert "needs 16 tokens" in note and "small_m_max_rows" in note
    assert "only 0 of them" in draft_rows_warning(4, 4, 3)
