"""The draft-model proposer: its drafts are the draft model's own continuation (batched, after
any accepted prefix: the rollback contract), its inputs are checked against what it was
compiled for, a mismatched vocabulary is refused, and it owns its compile-cache namespace."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from checkpoints import build_family_checkpoint

from framework import LLM
from framework.engine.request import Request
from framework.engine.sampling_params import SamplingParams
from framework.engine.spec.config import SpeculativeConfig
from framework.engine.spec.draft import (
    DraftModelProposer,
    draft_compilation_config,
    draft_identity,
)
from framework.engine.spec.draft_inputs import DraftInputError
from framework.engine.spec.proposer import PROPOSERS, ProposerContext, build_proposer

K = 4
MAX_SEQS = 4
MAX_LEN = 64
# Different lengths; the last crosses a KV block (16 tokens).
PROMPTS = [
    [3, 17, 42, 9, 100, 7, 64, 5, 11],
    [8, 1, 250],
    [77, 12, 5, 90, 31, 2, 44, 61, 9, 13, 200, 1, 5, 6, 7, 8, 9, 10],
]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A 1-layer llama with the test vocabulary (256) and other weights than the target."""
    root = tmp_path_factory.mktemp("draft")
    return str(build_family_checkpoint(root / "draft-llama", "llama", seed=1, num_hidden_layers=1))


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return LLM(
        str(tiny_checkpoint("llama")),
        optimization_level=0,
        max_num_seqs=MAX_SEQS,
        max_model_len=MAX_LEN,
    )


@pytest.fixture(scope="module")
def draft_reference(draft_dir):
    """The draft model run alone by the engine (its greedy continuations are the truth)."""
    return LLM(draft_dir, optimization_level=0, max_num_seqs=MAX_SEQS, max_model_len=MAX_LEN)


def context_of(llm: LLM, cache_dir=None, **changes) -> ProposerContext:
    cc = llm.config.replace(**changes) if changes else llm.config
    return ProposerContext(
        model_config=llm.model_config,
        dtype=llm.dtype,
        device=llm.device,
        max_model_len=llm.max_model_len,
        max_num_seqs=MAX_SEQS,
        compilation_config=cc,
        cache_dir=cache_dir,
    )


def make_proposer(model: str, llm: LLM, k: int = K, **changes) -> DraftModelProposer:
    config = SpeculativeConfig(method="draft_model", model=model, num_speculative_tokens=k)
    proposer = build_proposer(config, context_of(llm, **changes))
    assert isinstance(proposer, DraftModelProposer)
    return proposer


def continuation(llm: LLM, prompts, n: int) -> list[list[int]]:
    return llm.generate([list(p) for p in prompts], n, ignore_eos=True)


def test_registered():
    assert "draft_model" in PROPOSERS.names()


def test_drafts_follow_the_accepted_tokens(draft_dir, target, draft_reference):
    """Batched drafts of prompts of different lengths equal the draft's own greedy
    continuation; after a verify accepted some drafts (or all, plus a bonus token, or none)
    the next drafts continue the accepted tokens, and only the 1-2 new tokens are fed."""
    proposer = make_proposer(draft_dir, target)
    reqs = [Request(i, list(p), max_new_tokens=32) for i, p in enumerate(PROMPTS)]
    cont = continuation(draft_reference, PROMPTS, K + 1)
    assert proposer.propose(reqs) == [c[:K] for c in cont]
    assert proposer.draft_probs() is None  # greedy: q is one-hot
    assert proposer.stats()["draft_catch_up_tokens"] == sum(len(p) for p in PROMPTS)

    reqs[0].output = cont[0][:2] + [(cont[0][2] + 1) % 256]  # 2 accepted, then a correction
    reqs[1].output = cont[1][: K + 1]  # all K accepted plus the bonus token
    reqs[2].output = [(cont[2][0] + 7) % 256]  # none accepted
    before = proposer.stats()["draft_catch_up_tokens"]
    got = proposer.propose(reqs)
    assert got == continuation(draft_reference, [r.all_tokens() for r in reqs], K)
    assert proposer.stats()["draft_catch_up_tokens"] - before == 1 + 2 + 1

    # Released (finished or preempted): the state goes, a new sight recomputes it all.
    free = proposer.allocator.num_free
    proposer.release(1)
    assert proposer.allocator.num_free > free
    assert proposer.propose(reqs[1:2]) == [got[1]]
    proposer.release(0), proposer.release(1), proposer.release(2)
    assert proposer.allocator.num_free == proposer.allocator.num_usable
    proposer.allocator.check()


def test_drafts_stop_at_the_request_budget(draft_dir, target, draft_reference):
    """No more drafts than the request can still take (the verify adds a bonus token)."""
    proposer = make_proposer(draft_dir, target)
    reqs = [Request(0, list(PROMPTS[0]), max_new_tokens=3), Request(1, list(PROMPTS[1]), 1)]
    got = proposer.propose(reqs)
    assert got[0] == continuation(draft_reference, PROMPTS[:1], 2)[0]
    assert got[1] == []


def test_step_loop_crosses_blocks_budgets_differ_and_stops_at_eos(
    draft_dir, target, draft_reference
):
    """The draft's single-token steps run in one loop with the inputs advanced in place: a
    request whose drafts cross a KV block, requests with smaller budgets in the same batch
    (the loop runs in segments) and one that stops at its EOS draft all get the draft's own
    greedy continuation, cut where the one-step-at-a-time rule cuts it."""
    prompts = [list(range(20, 34)), list(range(40, 55)), PROMPTS[0], PROMPTS[1]]  # 14, 15, ...
    cont = continuation(draft_reference, prompts, K)
    reqs = [
        Request(0, prompts[0], max_new_tokens=32),
        Request(1, prompts[1], max_new_tokens=3),  # budget 2
        Request(2, prompts[2], max_new_tokens=32, eos_token_ids=frozenset({cont[2][1]})),
        Request(3, prompts[3], max_new_tokens=4),  # budget 3
    ]
    proposer = make_proposer(draft_dir, target)
    got = proposer.propose(reqs)
    eos_at = cont[2].index(cont[2][1])
    assert got == [cont[0], cont[1][:2], cont[2][: eos_at + 1], cont[3][:3]]
    # The next call continues from the accepted tokens (all drafts accepted + a correction).
    for r, d in zip(reqs, got):
        r.output = list(d) + [(d[-1] + 1) % 256]
    again = continuation(draft_reference, [r.all_tokens() for r in reqs], K)
    budgets = [K, 0, K, 0]  # 1 and 3 are at their max_tokens (no drafts: they finish)
    got = proposer.propose(reqs)
    assert got[0] == again[0][: budgets[0]] and got[1] == [] and got[3] == []
    eos = reqs[2].eos_token_ids
    cut = next((j + 1 for j, t in enumerate(again[2]) if t in eos), K)
    assert got[2] == again[2][:cut]


def test_catch_up_split_over_the_token_budget(draft_dir, target, draft_reference):
    """Catch-up chunks longer than the draft's token budget run over several steps."""
    proposer = make_proposer(
        draft_dir, target, max_num_tokens=16, cudagraph_capture_sizes=[1, 2, 4, 8, 16]
    )
    assert proposer.max_num_tokens == 16
    reqs = [Request(i, list(p), max_new_tokens=32) for i, p in enumerate(PROMPTS)]
    assert proposer.propose(reqs) == [c[:K] for c in continuation(draft_reference, PROMPTS, K)]


def test_sampled_drafts_return_q_and_are_reproducible(draft_dir, target):
    """Sampling requests draft from q (returned per request, rows summing to 1, the drafted
    token likely under it); a seeded request drafts the same tokens alone or in a batch."""
    proposer = make_proposer(draft_dir, target)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=32)
    reqs = [
        Request(0, list(PROMPTS[0]), 32, params=params, seed=5),
        Request(1, list(PROMPTS[1]), 32),  # greedy
        Request(2, list(PROMPTS[2]), 32, params=params, seed=9),
    ]
    got = proposer.propose(reqs)
    probs = proposer.draft_probs()
    assert probs is not None and probs[1] is None
    for i in (0, 2):
        q = probs[i]
        assert q.shape == (len(got[i]), 256) and q.dtype == torch.float32
        assert torch.allclose(q.sum(-1), torch.ones(len(got[i])), atol=1e-5)
        assert all(q[j, t] > 0 for j, t in enumerate(got[i]))
    alone = make_proposer(draft_dir, target)
    assert alone.propose([Request(0, list(PROMPTS[0]), 32, params=params, seed=5)]) == [got[0]]


def test_vocab_mismatch_refused(tmp_path, target):
    other = build_family_checkpoint(tmp_path / "v128", "llama", num_hidden_layers=1, vocab_size=128)
    with pytest.raises(
        ValueError, match=r"SpeculativeConfig\.model.*vocab_size=128.*vocab_size=256"
    ):
        make_proposer(str(other), target)


def _stage_int32_ids(proposer: DraftModelProposer) -> None:
    """Fault injection: the draft's runner stages token ids as int32 (vllm#17211's drafter was
    fed ids of another dtype than it was compiled for)."""
    runner = proposer.runner
    runner._np["input_ids"] = np.zeros(runner.max_num_tokens, np.int32)
    runner.input_ids = torch.from_numpy(runner._np["input_ids"])
    runner._views.clear()


def test_wrong_input_dtype_is_an_error(draft_dir, target):
    proposer = make_proposer(draft_dir, target)
    ids, pos = torch.zeros(3, dtype=torch.int64), torch.arange(3)
    proposer.check_inputs(ids, pos)
    with pytest.raises(
        DraftInputError, match=r"input_ids is torch\.int32.*compiled for torch\.int64"
    ):
        proposer.check_inputs(ids.to(torch.int32), pos)
    with pytest.raises(DraftInputError, match="positions"):
        proposer.check_inputs(ids, pos.float())
    with pytest.raises(DraftInputError, match="1-d"):
        proposer.check_inputs(ids[None], pos[None])
    too_many = proposer.max_num_tokens + 1
    with pytest.raises(DraftInputError, match="exceed"):
        proposer.check_inputs(torch.zeros(too_many, dtype=torch.int64), torch.arange(too_many))
    _stage_int32_ids(proposer)
    with pytest.raises(DraftInputError, match="input_ids is torch.int32"):
        proposer.propose([Request(0, list(PROMPTS[0]), 8)])


def test_draft_config_has_its_own_sizes(target):
    """The draft compiles without the target's verify sizes and captures its own
    single-token batch sizes."""
    cc = target.config.replace(compile_sizes=[5, 10], cudagraph_capture_sizes=[5, 10, 15])
    draft = draft_compilation_config(cc, None, max_num_seqs=6)
    assert draft.compile_sizes is None and draft.max_num_tokens is None
    assert draft.cudagraph_capture_sizes == [1, 2, 4, 6]
    assert draft.level == cc.level
    over = draft_compilation_config(cc, {"level": 1}, max_num_seqs=6)
    assert over.level == 1 and over.mode is None  # level 1's defaults, not the target's
    assert over.cudagraph_capture_sizes == [1, 2, 4, 6]
    assert draft_compilation_config(cc, {"compiler": "eager"}, 6).compiler == "eager"
    with pytest.raises(ValueError, match="draft_compile"):
        draft_compilation_config(cc, {"no_such_field": 1}, max_num_seqs=6)


def test_draft_identity(draft_dir, tmp_path):
    a = draft_identity(draft_dir, "float32")
    assert a == draft_identity(draft_dir, torch.float32)
    assert a != draft_identity(draft_dir, "bfloat16")
    wider = build_family_checkpoint(tmp_path / "wide", "llama", seed=1, num_hidden_layers=2)
    assert draft_identity(str(wider), "float32") != a


@pytest.mark.slow
def test_changed_draft_new_cache_key_nothing_stale(
    draft_dir, tiny_checkpoint, tmp_path, draft_reference
):
    """Compiled (O1): the draft's artifacts live in a folder of their own, beside none of the
    target's; a second draft of another shape gets a new key and compiles (loads nothing),
    while the same draft again loads its own; drafts stay the draft's continuation."""
    cache = str(tmp_path / "cache")
    llm = LLM(
        str(tiny_checkpoint("llama")),
        optimization_level=1,
        max_num_seqs=MAX_SEQS,
        max_model_len=MAX_LEN,
        cache_dir=cache,
    )

    def build(model):
        config = SpeculativeConfig(method="draft_model", model=model, num_speculative_tokens=K)
        return build_proposer(config, context_of(llm, cache_dir=cache))

    a = build(draft_dir)
    a_dir = a.stats()["draft_cache_dir"]
    assert "draft-" in a_dir and a_dir != str(llm.compiled.store.dir)
    assert a.worker.compiled.backend.stats.compiles > 0
    reqs = [Request(i, list(p), max_new_tokens=32) for i, p in enumerate(PROMPTS)]
    assert a.propose(reqs) == [c[:K] for c in continuation(draft_reference, PROMPTS, K)]

    other = str(build_family_checkpoint(tmp_path / "d2", "llama", seed=2, num_hidden_layers=2))
    b = build(other)
    b_dir = b.stats()["draft_cache_dir"]
    assert b.worker.compiled.store.key != a.worker.compiled.store.key
    assert b.worker.compiled.backend.stats.loads == 0
    assert b.worker.compiled.backend.stats.compiles > 0
    ref_b = LLM(other, optimization_level=0, max_num_seqs=MAX_SEQS, max_model_len=MAX_LEN)
    reqs = [Request(i, list(p), max_new_tokens=32) for i, p in enumerate(PROMPTS)]
    assert b.propose(reqs) == [c[:K] for c in continuation(ref_b, PROMPTS, K)]
    assert b_dir != a_dir

    again = build(draft_dir)
    assert again.stats()["draft_cache_dir"] == a_dir
    assert again.worker.compiled.backend.stats.compiles == 0
    reqs = [Request(i, list(p), max_new_tokens=32) for i, p in enumerate(PROMPTS)]
    assert again.propose(reqs) == [c[:K] for c in continuation(draft_reference, PROMPTS, K)]
