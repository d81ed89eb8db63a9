"""Size chooser: exact against brute force; beats the truncated default list on a trace."""

import itertools
import json
import random

import pytest

from experiments.run.trace import TraceStep, read_trace, token_histogram, write_trace
from experiments.tools.size_chooser import (
    choose_sizes,
    compare_with_default,
    default_sizes_truncated,
    main,
    to_override,
    waste,
    waste_fraction,
)
from framework.core.config import default_capture_sizes


def _random_hist(seed, max_count=14):
    rng = random.Random(seed)
    return {rng.randint(1, max_count): rng.randint(1, 9) for _ in range(rng.randint(1, 9))}


def _brute_force(hist, k, limit):
    """Least waste over *every* set of <= k integer sizes in [1, limit] covering ``hist``
    (not only sets of occurring counts: this also checks that restriction is lossless)."""
    top = max(hist)
    best = None
    for r in range(1, k + 1):
        for combo in itertools.combinations(range(1, limit + 1), r):
            if combo[-1] < top:
                continue
            value = waste(combo, hist)
            best = value if best is None else min(best, value)
    return best


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_matches_brute_force(seed, k):
    hist = _random_hist(seed)
    chosen = choose_sizes(hist, k)
    assert len(chosen) == min(k, len(hist)) and chosen == sorted(set(chosen))
    assert chosen[-1] == max(hist)
    assert waste(chosen, hist) == _brute_force(hist, k, limit=max(hist) + 2)


@pytest.mark.parametrize("seed", range(4))
def test_float_weights_match_brute_force(seed):
    rng = random.Random(100 + seed)
    hist = {c: rng.random() for c in rng.sample(range(1, 13), 6)}
    for k in (1, 2, 3):
        assert waste(choose_sizes(hist, k), hist) == pytest.approx(
            _brute_force(hist, k, limit=max(hist))
        )


@pytest.mark.parametrize("seed", range(4))
def test_cover_max_false_leaves_counts_above_max_size_unpadded(seed):
    hist = _random_hist(200 + seed, max_count=20)
    hist[19] = 5  # guarantee counts above the cap
    cap = 12
    with pytest.raises(ValueError, match="above max_size=12"):
        choose_sizes(hist, 3, max_size=cap)
    covered = {c: w for c, w in hist.items() if c <= cap}
    for k in (1, 2, 3):
        chosen = choose_sizes(hist, k, max_size=cap, cover_max=False)
        assert chosen[-1] == max(covered) and chosen[-1] <= cap
        assert waste(chosen, hist, cover_max=False) == waste(chosen, covered)
        assert waste(chosen, covered) == _brute_force(covered, k, limit=cap)


def test_waste_definitions():
    hist = {1: 10, 3: 2, 7: 1}
    assert waste([4, 8], hist) == 10 * 3 + 2 * 1 + 1 * 1
    assert waste([1, 3, 7], hist) == 0
    with pytest.raises(ValueError, match="token count 7 is above the largest size 4"):
        waste([4], hist)
    assert waste([4], hist, cover_max=False) == 10 * 3 + 2 * 1
    # 32 padded of 10 + 6 + 7 = 23 real tokens
    assert waste_fraction([4, 8], hist) == pytest.approx(33 / (23 + 33))
    assert choose_sizes(hist, 5) == [1, 3, 7]  # fewer sizes than k: every count exact
    for bad in ({0: 1}, {3: -1}, {}):
        with pytest.raises(ValueError):
            choose_sizes(bad, 2)
    with pytest.raises(ValueError, match="k must be a positive integer"):
        choose_sizes(hist, 0)


def test_to_override():
    assert to_override([24, 1, 8]) == "compile.cudagraph_capture_sizes=[1,8,24]"
    assert to_override([2, 4], field="compile_sizes") == "compile.compile_sizes=[2,4]"
    with pytest.raises(ValueError, match="field must be one of"):
        to_override([1], field="sizes")
    with pytest.raises(ValueError, match="duplicates"):
        to_override([1, 1])


def test_default_truncation_is_k_minus_1_smallest_plus_covering_size():
    assert default_sizes_truncated(512, 4, max_count=300) == [1, 2, 4, 304]
    assert default_sizes_truncated(512, 1, max_count=5) == [8]
    assert default_sizes_truncated(100, 3, max_count=99) == [1, 2, 96]  # nothing covers 99
    assert default_sizes_truncated(16, 10, max_count=16) == default_capture_sizes(16)


def _synthetic_trace(seed=0, max_num_tokens=512, num_steps=600):
    """Decode-heavy serving: up to 24 running requests decoding one token per step, new
    requests arriving in bursts whose prompts are prefilled together with the decodes."""
    rng = random.Random(seed)
    steps, running = [], []
    for step in range(num_steps):
        burst = rng.random() < 0.08
        prompts = [rng.randint(16, 160) for _ in range(rng.randint(1, 3))] if burst else []
        while prompts and sum(prompts) + len(running) > max_num_tokens:
            prompts.pop()
        decode = len(running)
        if decode + sum(prompts) == 0:
            prompts = [rng.randint(16, 160)]
        steps.append(
            TraceStep(step, decode + sum(prompts), decode + len(prompts), decode, sum(prompts))
        )
        running = [r - 1 for r in running if r > 1] + [rng.randint(20, 200) for _ in prompts]
        running = running[:24]
    return steps


@pytest.mark.parametrize("k", [2, 4, 8, 16])
def test_chosen_sizes_beat_truncated_default_on_synthetic_trace(tmp_path, k):
    path = write_trace(tmp_path / "trace.jsonl", _synthetic_trace(), max_num_tokens=512)
    trace = read_trace(path)
    hist = token_histogram(trace)
    assert sum(hist.values()) == 600 and max(hist) > 100  # bursts of prefills are there
    result = compare_with_default(hist, k, trace.max_num_tokens)
    assert result.cover_max and len(result.chosen) == k and len(result.default) == k
    assert result.chosen_waste <= result.default_waste
    assert result.chosen_waste == waste(result.chosen, hist)
    if k >= 4:  # the default's fixed grid is far from this workload's counts
        assert result.chosen_waste < 0.8 * result.default_waste


def test_cli_prints_sizes_waste_and_override(tmp_path, capsys):
    path = write_trace(tmp_path / "trace.jsonl", _synthetic_trace(seed=3), max_num_tokens=512)
    assert main([str(path), "-k", "6", "--target", "both"]) == 0
    out = capsys.readouterr().out
    assert "chosen sizes (K=6): [" in out and "default list truncated to K=6" in out
    assert "'compile.cudagraph_capture_sizes=[" in out and "'compile.compile_sizes=[" in out
    assert main([str(path), "-k", "6", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    hist = token_histogram(read_trace(path))
    assert payload["chosen"] == choose_sizes(hist, 6)
    assert payload["chosen_waste"] <= payload["default_waste"]
    assert payload["overrides"] == [to_override(payload["chosen"])]


def test_large_histogram_is_fast():
    import time

    rng = random.Random(7)
    hist = {rng.randint(1, 4096): rng.randint(1, 50) for _ in range(3000)}
    start = time.perf_counter()
    chosen = choose_sizes(hist, 8)
    assert time.perf_counter() - start < 5.0
    assert len(chosen) == 8 and chosen[-1] == max(hist)


def test_comparison_with_uncovered_tail_scores_both_sets_alike(tmp_path, capsys):
    hist = token_histogram(
        read_trace(write_trace(tmp_path / "t.jsonl", _synthetic_trace(1), max_num_tokens=512))
    )
    result = compare_with_default(hist, 6, 512, max_size=64, cover_max=False)
    assert max(result.default) <= 64 and max(result.chosen) <= 64
    assert result.chosen[-1] == max(c for c in hist if c <= 64)
    assert result.chosen_waste <= result.default_waste
    with pytest.raises(ValueError, match="above max_size=64"):
        compare_with_default(hist, 6, 512, max_size=64)
    with pytest.raises(SystemExit):
        main([str(tmp_path / "t.jsonl"), "-k", "6", "--max-size", "64"])
    assert "--no-cover-max" in capsys.readouterr().err
    # max_num_tokens=100: the default list stops at 96, so neither set covers 97..100
    capped = compare_with_default({3: 5, 50: 2, 99: 1}, 2, 100)
    assert not capped.cover_max and capped.default == [1, 96] and capped.chosen == [3, 50]
