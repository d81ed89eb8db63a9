"""The n-gram proposer: the longest suffix match, its most recent earlier occurrence."""

import numpy as np
import pytest

from framework.engine.request import Request
from framework.engine.spec.config import SpeculativeConfig
from framework.engine.spec.ngram import NgramProposer, ngram_lookup
from framework.engine.spec.proposer import PROPOSERS, build_proposer


def look(tokens, k=3, lo=1, hi=3, periodic=False):
    return ngram_lookup(np.asarray(tokens, dtype=np.int64), k, lo, hi, periodic)


def brute(tokens, k, lo, hi):
    """The rule, spelled out: for n = hi..lo, the latest i < len - n with
    tokens[i:i+n] == the last n tokens; propose what follows it."""
    L = len(tokens)
    for n in range(hi, lo - 1, -1):
        if n >= L:
            continue
        suffix = tokens[L - n :]
        for i in range(L - n - 1, -1, -1):
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


def test_longest_match_wins_over_a_more_recent_shorter_one():
    #        0  1  2  3  4  5  6  7  8  9
    toks = [1, 2, 3, 7, 8, 9, 3, 5, 1, 2, 3]
    # suffix [1,2,3] occurs at 0 (followed by 7 8 9); [3] alone occurs later at 6 (-> 5 1 2).
    assert look(toks, k=3) == [7, 8, 9]
    assert look(toks, k=3, hi=1) == [5, 1, 2]


def test_most_recent_occurrence_and_short_tails():
    toks = [4, 5, 6, 4, 5, 9, 4, 5]
    assert look(toks, k=2, hi=2) == [9, 4]  # [4,5] at 0 and 3: the later one (3) wins
    assert look([4, 5, 4], k=5) == [5, 4]  # only two tokens follow
    assert look([1, 2, 3], k=3) == []  # no earlier occurrence
    assert look([7], k=3) == []
    assert look([1, 2, 1, 2], k=2, lo=3, hi=3) == []  # a 3-gram is needed, only a 2-gram matches


def test_periodic_drafts_continue_a_loop_shorter_than_k():
    # The suffix [7, 8] last occurred 3 tokens back: 9 7 8 follow it, then the sequence ends.
    toks = [1, 7, 8, 9, 7, 8]
    assert look(toks, k=5) == [9, 7, 8]
    assert look(toks, k=5, periodic=True) == [9, 7, 8, 9, 7]  # the loop of period 3 goes on
    assert look([4, 5, 4], k=5) == [5, 4]
    assert look([4, 5, 4], k=5, periodic=True) == [5, 4, 5, 4, 5]
    assert look([3, 3], k=3, periodic=True) == [3, 3, 3]
    assert look([1, 2, 1, 2, 9, 1, 2], k=2, periodic=True) == [9, 1]  # enough tokens: as cut
    assert look([1, 2, 3], k=3, periodic=True) == []  # no match: nothing to repeat


def test_periodic_drafts_are_the_cut_drafts_extended_by_their_own_period():
    rng = np.random.default_rng(1)
    for _ in range(300):
        toks = rng.integers(0, 4, size=int(rng.integers(2, 30))).tolist()
        k = int(rng.integers(1, 7))
        cut, ext = look(toks, k), look(toks, k, periodic=True)
        assert ext[: len(cut)] == cut and len(ext) == (k if cut else 0), (toks, k)
        # Cut short, the drafts ran to the sequence's end: they are its last len(cut) tokens.
        if 0 < len(cut) < k:
            assert cut == toks[-len(cut) :]
            assert all(ext[t] == ext[t - len(cut)] for t in range(len(cut), k))


def test_matches_the_spelled_out_rule_on_random_sequences():
    rng = np.random.default_rng(0)
    for _ in range(300):
        toks = rng.integers(0, 4, size=int(rng.integers(1, 30))).tolist()
        lo = int(rng.integers(1, 3))
        hi = lo + int(rng.integers(0, 3))
        k = int(rng.integers(1, 5))
        assert look(toks, k, lo, hi) == brute(toks, k, lo, hi), (toks, k, lo, hi)


def test_proposer_reads_prompt_and_output():
    prop = build_proposer(SpeculativeConfig(num_speculative_tokens=2), None)
    assert isinstance(prop, NgramProposer) and "ngram" in PROPOSERS
    r = Request(0, [1, 2, 3, 1], max_new_tokens=8)
    r.output = [2]
    other = Request(1, [9, 8], max_new_tokens=8)
    assert prop.propose([r, other]) == [[3, 1], []]
    assert prop.draft_probs() is None
    assert prop.stats()["ngram_hit_rate"] == pytest.approx(0.5)
    # Default: a loop shorter than k continues; off, the drafts stop at the sequence's end.
    r.output = [2, 3]  # [1, 2, 3, 1, 2, 3]: the match [1, 2, 3] at 0 is followed by 1 2 3
    four = SpeculativeConfig(num_speculative_tokens=4)
    assert build_proposer(four, None).propose([r]) == [[1, 2, 3, 1]]
    cut = build_proposer(four.replace(prompt_lookup_periodic=False), None)
    assert cut.propose([r]) == [[1, 2, 3]]
