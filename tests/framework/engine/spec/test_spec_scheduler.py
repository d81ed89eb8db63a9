"""The scheduler's side of verification: verify chunks of 1 + k tokens, KV rollback of the
rejected drafts, and EOS / max_tokens inside an accepted run."""

from framework.engine.block_manager import BlockManager
from framework.engine.request import Request
from framework.engine.sampling_params import SamplingParams
from framework.engine.scheduler import Scheduler

BS = 4


def setup(num_blocks=32, budget=64, prompt=(1, 2, 3, 4, 5, 6), max_new=16, eos=frozenset()):
    released = []
    s = Scheduler(
        BlockManager(num_blocks, BS),
        block_size=BS,
        max_num_seqs=4,
        max_num_tokens=budget,
        max_model_len=64,
        on_release=released.append,
    )
    r = Request(0, list(prompt), max_new, eos)
    s.add(r)
    chunks = s.schedule()
    s.update(chunks, [7])  # the prefill samples the first token
    return s, r, released


def test_verify_chunk_and_rollback_of_rejected_drafts():
    s, r, _ = setup()
    assert (r.num_tokens, r.num_computed, len(r.block_ids)) == (7, 6, 2)
    (c,) = s.schedule({0: [8, 9, 10, 11, 12]})
    assert (c.start, c.num_tokens, c.spec) == (6, 6, (8, 9, 10, 11, 12))
    assert len(r.block_ids) == 3  # positions 6..11
    s.update([c], [[8, 9, 42]])  # two drafts accepted, the third replaced
    assert r.output == [7, 8, 9, 42] and r.num_computed == 9
    assert len(r.block_ids) == 3  # ceil(9 / 4): nothing rejected lived past block 2
    (c,) = s.schedule({0: [1, 2, 3, 4, 5, 6]})
    s.update([c], [[50]])  # every draft rejected
    assert r.num_computed == 10 and len(r.block_ids) == 3
    s.block_manager.check()
    assert s.block_manager.num_free == s.block_manager.num_usable - 3


def test_drafts_cut_to_budget_max_tokens_and_free_blocks():
    s, r, _ = setup(budget=4, prompt=(1, 2, 3))
    (c,) = s.schedule({0: [8, 9, 10, 11, 12]})
    assert c.spec == (8, 9, 10)  # 1 + 3 = the step's budget
    s, r, _ = setup(max_new=4)
    (c,) = s.schedule({0: [8, 9, 10, 11, 12]})
    assert c.spec == (8, 9)  # output 1 + 2 drafts + 1 token = max_tokens
    s, r, _ = setup()
    taken = s.block_manager.allocate(s.block_manager.num_free)  # another holds every free block
    (c,) = s.schedule({0: [8, 9, 10]})  # position 6 fits block 1; the drafts would need block 2
    assert c.spec == () and c.num_tokens == 1 and s.stats.preemptions == 0  # plain decode
    s.block_manager.free(taken)


def test_eos_and_max_tokens_inside_an_accepted_run():
    s, r, released = setup(eos=frozenset({99}))
    (c,) = s.schedule({0: [8, 99, 10]})
    done = s.update([c], [[8, 99, 10, 11]])
    assert done == [r] and r.output == [7, 8, 99] and r.finish_reason == "stop"
    assert released == [0] and s.block_manager.num_free == s.block_manager.num_usable
    s, r, _ = setup(max_new=3)
    (c,) = s.schedule({0: [8, 9, 10]})
    done = s.update([c], [[8, 9]])
    assert done == [r] and r.output == [7, 8, 9] and r.finish_reason == "length"


def test_preemption_and_abort_release_the_proposer_state():
    s, r, released = setup()
    other = Request(1, [1, 2, 3], 8)
    s.add(other)
    s.update(s.schedule(), [8, 4])  # r decodes, the other is prefilled
    s._preempt(s.running.pop())  # what schedule does to the newest request under pressure
    assert released == [1] and other.num_computed == 0 and other.block_ids == []
    s.abort(0)
    assert released == [1, 0] and s.block_manager.num_free == s.block_manager.num_usable


def test_drafts_verified_in_the_prefill_chunk():
    """A request admitted with its whole prompt verifies its drafts in the prefill chunk: the
    chunk is the prompt plus the drafts (cut to max_tokens and the blocks free), and the kept
    tokens are its first new tokens; a prompt split over steps gets none."""
    s = Scheduler(BlockManager(32, BS), block_size=BS, max_num_seqs=4, max_num_tokens=64,
                  max_model_len=64)  # fmt: skip
    r = Request(0, [1, 2, 3, 4, 5, 6], 4)
    s.add(r)
    assert s.draft_candidates() == [r]
    (c,) = s.schedule({0: [7, 8, 9, 10]})
    assert (c.start, c.num_tokens, c.spec, c.samples) == (0, 9, (7, 8, 9), True)
    assert len(r.block_ids) == 3  # positions 0..8
    s.update([c], [[7, 8, 42]])  # two drafts accepted, the third replaced
    assert r.output == [7, 8, 42] and r.num_computed == 8 and len(r.block_ids) == 2
    assert s.draft_candidates() == [r]  # it decodes next

    # No free blocks for the drafts: a plain prefill, admitted all the same.
    s = Scheduler(BlockManager(4, BS), block_size=BS, max_num_seqs=4, max_num_tokens=64,
                  max_model_len=64)  # fmt: skip
    r = Request(0, [1] * 8, 4)
    s.add(r)
    taken = s.block_manager.allocate(1)  # 2 blocks left: the prompt's, none for drafts
    (c,) = s.schedule({0: [7, 8, 9]})
    assert c.spec == () and c.num_tokens == 8 and s.running == [r]
    s.block_manager.free(taken)

    # The token budget splits the prompt: no drafts (and no candidate) until it ends.
    s = Scheduler(BlockManager(32, BS), block_size=BS, max_num_seqs=4, max_num_tokens=4,
                  max_model_len=64)  # fmt: skip
    r = Request(0, [1, 2, 3, 4, 5, 6], 8)
    s.add(r)
    assert s.draft_candidates() == []
    (c,) = s.schedule({0: [7, 8, 9]})
    assert c.spec == () and c.num_tokens == 4


def test_draft_candidates_respect_slots_and_budget():
    """Waiting requests are candidates only when all the step would admit fit whole with k
    drafts each (after the running ones' 1 + k)."""
    s, r, _ = setup(budget=32)  # r decodes (1 token)
    waiting = [Request(i, [1] * n, 8) for i, n in ((1, 5), (2, 9), (3, 2))]
    for w in waiting:
        s.add(w)
    assert s.draft_candidates(3) == [r, *waiting]  # 16 + 3 x 3 <= 32 - (1 + 3)
    assert s.draft_candidates(4) == [r]  # 16 + 3 x 4 > 32 - (1 + 4): none of them
    s.max_num_seqs = 2  # one admission: 5 + 4 fits
    assert s.draft_candidates(4) == [r, waiting[0]]
    # A sampling request drafts from its first decode step on (batch-independent draws).
    s, r, _ = setup(budget=32)
    s.add(Request(9, [1, 2], 8, params=SamplingParams(temperature=0.8)))
    assert s.draft_candidates(4) == [r]


def test_drafts_keep_the_step_within_the_row_independent_kernels():
    """``draft_rows_limit``: a step with drafts stays within the rows the small-M linears
    take, where a row's bits do not depend on the rows beside it.  Above it the linears switch
    kernel, and a draft row would part from the decode step it stands for (greedy tokens with
    speculation parted from those without on the AVX2 machine: a 208-token prompt's drafts
    rode in its 212-row prefill step)."""
    s, r, _ = setup(budget=512)  # r decodes (1 token)
    s.draft_rows_limit = 16
    long_prompt, short_prompt = Request(1, [1] * 14, 8), Request(2, [1] * 3, 8)
    s.add(long_prompt)
    # 1 + 14 plain rows: no room for 4 drafts anywhere (the prompt is not cut for them)
    assert s.draft_candidates(4) == []
    s.draft_rows_limit = 19
    assert s.draft_candidates(4) == [r]  # 1 + 4 + 14 = 19: r verifies, the prompt plainly
    s.draft_rows_limit = None
    assert s.draft_candidates(4) == [r, long_prompt]  # no limit: drafts follow the prompt too

    s, r, _ = setup(budget=512)
    s.draft_rows_limit = 12
    s.add(short_prompt)
    assert s.draft_candidates(4) == [r, short_prompt]  # 1 + 4 + 3 + 4 = 12: both draft
    s.draft_rows_limit = 11
    assert s.draft_candidates(4) == [r]  # 1 + 4 + 3 = 8 <= 11, but + 4 prefill drafts > 11
    s.draft_rows_limit = 7
    assert s.draft_candidates(4) == []  # 1 + 3 = 4 plain rows, + 4 drafts = 8 > 7
