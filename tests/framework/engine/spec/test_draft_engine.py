"""The draft-model proposer inside the engine: greedy tokens identical with speculation on and
off (batched prompts of different lengths; the four families; O0 and O2; a draft that agrees
with the target and one that does not; under KV pressure that preempts), and the trained
addition draft's acceptance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoints import build_family_checkpoint

from framework import LLM

REPO = Path(__file__).resolve().parents[4]
ADDITION = REPO / "models" / "synthetic" / "addition"
ADDITION_DRAFT = REPO / "models" / "synthetic" / "addition-draft"

PROMPTS = [[3, 17, 42, 9, 100, 7, 64, 5, 11], [8, 1, 250], [77, 12, 5, 90, 31, 2, 44, 61, 9, 13]]
NEW = 12
K = 3


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    """A 1-layer llama with other weights: its drafts are mostly rejected."""
    root = tmp_path_factory.mktemp("draft")
    return str(build_family_checkpoint(root / "d", "llama", seed=3, num_hidden_layers=1))


def spec(draft: str, k: int = K) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}


def generate(model: str, level: int, speculative=None, cache_dir=None, **kw):
    llm = LLM(
        model,
        optimization_level=level,
        max_num_seqs=4,
        max_model_len=64,
        cache_dir=cache_dir,
        speculative_config=speculative,
        **kw,
    )
    return llm, llm.generate(PROMPTS, NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_tokens(tiny_checkpoint):
    """Per family: the plain engine's greedy tokens (O0), computed once."""
    done: dict[str, list[list[int]]] = {}

    def get(family: str) -> list[list[int]]:
        if family not in done:
            done[family] = generate(str(tiny_checkpoint(family)), 0)[1]
        return done[family]

    return get


@pytest.mark.parametrize(
    "family,draft",
    [("llama", "self"), ("llama", "random"), ("mistral", "self"), ("qwen2", "self")]
    + [("qwen3", "self")],
)
def test_greedy_tokens_identical_O0(family, draft, tiny_checkpoint, random_draft, plain_tokens):
    """Drafted by the target itself (every draft accepted: the catch-up of accepted drafts and
    the bonus token) and by an unrelated draft (mostly rejected: the rollback)."""
    target = str(tiny_checkpoint(family))
    llm, got = generate(target, 0, spec(target if draft == "self" else random_draft))
    assert got == plain_tokens(family)
    st = llm.stats
    assert st["spec_method"] == "draft_model" and st["spec_verify_chunks"] > 0
    assert st["spec_draft_propose_calls"] > 0
    if draft == "self":
        assert st["spec_acceptance_rate"] > 0.9, st  # the draft is the target
    else:
        assert st["spec_acceptance_rate"] < 0.5, st  # an unrelated random model


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_tokens_identical_O2(
    family, tiny_checkpoint, random_draft, compile_cache_dir, plain_tokens
):
    target = str(tiny_checkpoint(family))
    plain = plain_tokens(family)
    llm, same = generate(target, 2, spec(target), compile_cache_dir)
    assert same == plain
    assert llm.stats["spec_acceptance_rate"] > 0.9
    assert "draft-" in llm.stats["spec_draft_cache_dir"]
    _, other = generate(target, 2, spec(random_draft), compile_cache_dir)
    assert other == plain


def test_greedy_tokens_identical_under_preemption(tiny_checkpoint, random_draft):
    """A target KV cache too small for every request at once: requests are preempted (their
    draft state released) and recomputed; the tokens stay the plain engine's."""
    target = str(tiny_checkpoint("llama"))
    _, plain = generate(target, 0)
    llm, got = generate(target, 0, spec(target), kv_cache_memory_bytes=_bytes_for_blocks(target, 3))
    assert got == plain
    assert llm.stats["preemptions"] > 0, llm.stats


def _bytes_for_blocks(model: str, blocks: int) -> int:
    config = json.loads((Path(model) / "config.json").read_text())
    heads = config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_block = 2 * config["num_hidden_layers"] * 16 * heads * head_dim * 4
    return (blocks + 1) * per_block


def test_trained_addition_draft_acceptance():
    """The shipped draft loads, leaves the target's answers unchanged, and is worth having:
    its acceptance on held-out addition prompts (recorded in its metrics.json) is high."""
    from experiments.synthetic.task import get_task

    metrics = json.loads((ADDITION_DRAFT / "metrics.json").read_text())
    recorded = metrics["draft"]["by_k"]["4"]["acceptance_rate"]
    task = get_task("addition")
    prompts, answers = task.split(task.sequences(task.held_out_keys(24, 1234)))
    kw = dict(optimization_level=0, max_num_seqs=8, max_model_len=64)
    plain = LLM(str(ADDITION), **kw).generate(prompts, task.answer_len + 1)
    llm = LLM(str(ADDITION), speculative_config=spec(str(ADDITION_DRAFT), 4), **kw)
    got = llm.generate(prompts, task.answer_len + 1)
    assert got == plain
    rate = llm.stats["spec_acceptance_rate"]
    print(f"addition draft: acceptance {rate:.3f} here, {recorded:.3f} in metrics.json (n=200)")
    assert rate >= 0.7 and recorded >= 0.7


def test_first_tokens_verified_in_the_prefill_step():
    """A prompt's drafts follow it in its prefill chunk, so with every draft accepted an
    addition answer (4 digits and EOS) takes one target step instead of five; the tokens stay
    the plain engine's."""
    from experiments.synthetic.task import get_task

    task = get_task("addition")
    prompts, _ = task.split(task.sequences(task.held_out_keys(4, 1234)))
    kw = dict(optimization_level=0, max_num_seqs=1, max_model_len=64)
    plain = LLM(str(ADDITION), **kw)
    llm = LLM(str(ADDITION), speculative_config=spec(str(ADDITION_DRAFT), 4), **kw)
    n = task.answer_len + 1
    one_step = 0
    for p in prompts:
        first = len(llm.runner.trace)
        assert llm.generate([p], n) == plain.generate([p], n)
        steps = llm.runner.trace[first:]
        assert steps[0]["num_draft_tokens"] == 4 and steps[0]["num_tokens"] == len(p) + 4
        one_step += len(steps) == 1  # all four accepted, plus the target's own fifth token
    assert one_step >= len(prompts) - 1, llm.stats  # the draft agrees (acceptance ~1)
    assert llm.stats["spec_mean_accepted_length"] >= 4.0


def test_greedy_verify_takes_its_argmaxes_from_the_heads_greedy_kernel(
    compile_cache_dir, monkeypatch
):
    """bf16 O2: a greedy verify step's rows (the prompt's last token and the four drafts)
    go through the target's LM head greedy kernel once -- logits, first maximum and maximum
    per row -- instead of the logits and a separate argmax; the same tokens with the kernel
    off (``fuse_greedy_head``) and as the plain engine."""
    from experiments.synthetic.task import get_task
    from framework.engine.spec import rejection

    task = get_task("addition")
    prompts, _ = task.split(task.sequences(task.held_out_keys(4, 1234)))
    kw = dict(dtype="bfloat16", optimization_level=2, max_num_seqs=4, max_model_len=64)
    kw["cache_dir"] = compile_cache_dir
    llm = LLM(str(ADDITION), speculative_config=spec(str(ADDITION_DRAFT), 4), **kw)
    runner = llm.runner
    own, separate = rejection.greedy_argmax, []  # the verify's own argmax of the logits

    def counted_argmax(logits):
        separate.append(logits.shape[0])
        return own(logits)

    monkeypatch.setattr(rejection, "greedy_argmax", counted_argmax)
    kernel, rows = runner.greedy_logits, []

    def counted(h):
        out = kernel(h)
        rows.append(h.shape[0] if out is not None else None)  # None: the kernel declined
        return out

    runner.greedy_logits = counted
    n = task.answer_len + 1
    got = [llm.generate([p], n) for p in prompts]
    assert rows.count(5) >= len(prompts) - 1, rows  # one verify step per answer
    assert not separate, separate  # every verify step's argmaxes came from the kernel
    runner.fuse_greedy_head = False
    calls = len(rows)
    assert [llm.generate([p], n) for p in prompts] == got and len(rows) == calls
    assert separate.count(5) >= len(prompts) - 1
    assert got == [LLM(str(ADDITION), **kw).generate([p], n) for p in prompts]


def test_greedy_drafts_come_from_the_draft_heads_greedy_kernel(compile_cache_dir):
    """bf16 O2: the draft's greedy steps (its catch-up and its single-token loop) take each
    draft from its LM head's greedy kernel (one call: logits, first maximum) instead of the
    logits and a separate argmax; the drafts are the same with the kernel off
    (``fuse_greedy_head``, the A/B baseline), and so are the engine's tokens."""
    from experiments.synthetic.task import get_task
    from framework.engine.request import Request

    task = get_task("addition")
    prompts, _ = task.split(task.sequences(task.held_out_keys(4, 1234)))
    kw = dict(dtype="bfloat16", optimization_level=2, max_num_seqs=4, max_model_len=64)
    kw["cache_dir"] = compile_cache_dir
    llm = LLM(str(ADDITION), speculative_config=spec(str(ADDITION_DRAFT), 4), **kw)
    proposer = llm.spec.proposer
    proposer.step_loop.enabled = False  # its own test below: here every step's head is Python's
    runner = proposer.runner
    kernel = runner.greedy_logits
    calls = []

    def counted(h):
        calls.append(h.shape[0])
        return kernel(h)

    runner.greedy_logits = counted
    n = task.answer_len + 1
    got = llm.generate(prompts, n)
    assert calls and llm.stats["spec_acceptance_rate"] >= 0.7, llm.stats

    def drafts():
        reqs = [Request(100 + i, list(p), max_new_tokens=8) for i, p in enumerate(prompts)]
        out = proposer.propose(reqs)
        for r in reqs:
            proposer.release(r.req_id)
        return out

    before = len(calls)
    fused = drafts()
    assert len(calls) - before == 4  # the catch-up and three single-token steps
    runner.fuse_greedy_head = False
    assert drafts() == fused and len(calls) - before == 4
    assert all(len(d) == 4 for d in fused)
    assert llm.generate(prompts, n) == got == LLM(str(ADDITION), **kw).generate(prompts, n)


def self_drafted(tiny_checkpoint, cache_dir) -> tuple[str, dict, LLM]:
    """bf16 O2: the tiny llama drafting for itself (k = 4); its path, the ``LLM`` arguments
    and the engine."""
    target = str(tiny_checkpoint("llama"))
    kw = dict(dtype="bfloat16", optimization_level=2, max_num_seqs=4, max_model_len=64)
    kw["cache_dir"] = cache_dir
    return target, kw, LLM(target, speculative_config=spec(target, 4), **kw)


def keep_maxima(runner) -> list[torch.Tensor]:
    """The maxima of every greedy head call the runner makes from now on, in order."""
    kernel, maxima = runner.greedy_logits, []

    def keeping(h):
        out = kernel(h)
        maxima.append(out[2].clone())
        return out

    runner.greedy_logits = keeping
    return maxima


def test_greedy_draft_steps_replay_as_one_native_loop(tiny_checkpoint, compile_cache_dir):
    """bf16 O2: the draft's single-token greedy steps are recorded once per (requests, steps)
    and then replayed as one native tape (``draft_loop.py``): the same drafts as the Python
    loop, for a batch whose drafts cross a KV block, budgets that differ (the loop runs in
    segments) and a request that stops at its EOS draft; the engine's tokens stay the plain
    engine's."""
    from framework.engine.request import Request

    target, kw, llm = self_drafted(tiny_checkpoint, compile_cache_dir)
    proposer = llm.spec.proposer
    loop = proposer.step_loop
    assert loop is not None
    g = torch.Generator().manual_seed(0)
    # rows 1, 2: drafts past position 16 (a second KV block)
    batch = [torch.randint(3, 250, (m,), generator=g).tolist() for m in (9, 14, 13, 3)]
    eos: dict[int, int] = {}

    def drafts(budgets):
        reqs = [
            Request(200 + i, list(p), m, eos_token_ids=frozenset({eos.get(i, -1)}))
            for i, (p, m) in enumerate(zip(batch, budgets))
            if m
        ]
        out = proposer.propose(reqs)
        for r in reqs:
            proposer.release(r.req_id)
        return out

    shapes = [[8, 8, 8, 8], [8, 3, 8, 2], [8]]
    loop.enabled = False
    eos[3] = drafts(shapes[0])[3][1]  # row 3 stops at its second draft
    maxima = keep_maxima(proposer.runner)
    python = [drafts(b) for b in shapes]
    # the maxima of the first batch's three single-token steps (after its catch-up's)
    python_maxima = maxima[1:4]
    loop.enabled = True
    first = [drafts(b) for b in shapes]  # records
    recorded, replayed = loop.recordings, loop.replays
    assert recorded >= 2
    again = [drafts(b) for b in shapes[:1]]
    # the loop's own buffers after its replay of those steps: the same logits, bit for bit
    loop_maxima = torch.from_numpy(loop._loops[(4, 3, None)].val)
    assert len(python_maxima) == 3 and torch.equal(loop_maxima, torch.stack(python_maxima))
    again += [drafts(b) for b in shapes[1:]]  # replays
    assert loop.recordings == recorded and loop.replays >= replayed + 2
    assert python == first == again
    # the forward's recordings dropped (as when the weights move): the loops record again
    proposer.worker.forward_replay._drop_all()
    assert [drafts(b) for b in shapes] == python and loop.recordings > recorded
    assert [len(d) for d in python[0]] == [4, 4, 4, 2] and python[0][3][1] == eos[3]
    assert [len(d) for d in python[1]] == [4, 2, 4, 1]
    prompts = batch[:3]
    plain = LLM(target, **kw).generate(prompts, 12, ignore_eos=True)
    assert llm.generate(prompts, 12, ignore_eos=True) == plain
    assert llm.stats["spec_draft_step_loop_replays"] > 0


def test_catch_up_and_draft_steps_replay_as_one_native_loop(tiny_checkpoint, compile_cache_dir):
    """bf16 O2: where a propose call's catch-up is one forward that replays whole and every
    request wants as many drafts, the catch-up joins the step loop (``draft_loop.py``): the
    whole call is recorded once per shape and then replayed as one tape, the same drafts as
    the Python catch-up and steps -- every maximum bit for bit -- for one request, for three
    of different prompt lengths and for a request's catch-up of the tokens accepted since
    its last call; the engine's tokens stay the plain engine's."""
    from framework.engine.request import Request

    target, kw, llm = self_drafted(tiny_checkpoint, compile_cache_dir)
    proposer = llm.spec.proposer
    loop = proposer.step_loop
    assert loop is not None
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (m,), generator=g).tolist() for m in (7, 3, 5, 6)]
    batches = [[0], [1, 2, 3]]  # 7 tokens; 14 tokens in rows 2, 4 and 13
    maxima = keep_maxima(proposer.runner)

    def drafts(batch, later=None):
        """Drafts of a call over fresh requests, or (``later``: a token list per request)
        over requests that accepted those tokens since that first call."""
        reqs = [Request(300 + i, list(prompts[i]), 16) for i in batch]
        out = proposer.propose(reqs)
        if later is not None:
            for r, extra in zip(reqs, later):
                r.output += extra
            out = proposer.propose(reqs)
        for r in reqs:
            proposer.release(r.req_id)
        return out

    loop.enabled = False
    python = [drafts(b) for b in batches]
    python_maxima = [torch.stack(maxima[4 * i : 4 * i + 4]) for i in range(2)]
    accepted = [d[:2] for d in python[1]]  # two drafts accepted and the target's own token
    later = [a + [5] for a in accepted]
    python.append(drafts(batches[1], later))
    assert all(len(d) == 4 for ds in python for d in ds)
    loop.enabled = True
    # records (the third call's first propose is the second's shape: it replays)
    first = [drafts(b) for b in batches] + [drafts(batches[1], later)]
    assert loop.recordings == 3 and loop.catch_up_replays == 1
    recorded = loop.recordings
    maxima.clear()
    again = [drafts(b) for b in batches] + [drafts(batches[1], later)]  # replays
    assert not maxima  # no head ran in Python
    assert loop.recordings == recorded and loop.catch_up_replays >= 4
    assert python == first == again
    for i, b in enumerate(batches):
        rows = {0: (6,), 1: (2, 7, 13)}[i]
        tokens = sum(len(prompts[j]) for j in b)
        joined = loop._loops[(len(b), 3, (tokens, rows))]
        assert joined.catch_up is not None
        assert torch.equal(torch.from_numpy(joined.val), python_maxima[i])
    plain = LLM(target, **kw).generate(prompts, 12, ignore_eos=True)
    assert llm.generate(prompts, 12, ignore_eos=True) == plain  # records its shapes
    replays = loop.catch_up_replays
    assert llm.generate(prompts, 12, ignore_eos=True) == plain
    assert llm.stats["spec_draft_step_loop_catch_up_replays"] > replays
