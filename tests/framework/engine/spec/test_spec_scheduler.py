"""The scheduler's side of verification: verify chunks of 1 + k tokens, KV rollback of the
rejected drafts, and EOS / max_tokens inside an accepted run."""

from framework.engine.block_manager import BlockManager
from framework.engine.request import Request
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
