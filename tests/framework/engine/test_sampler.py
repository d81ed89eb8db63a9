"""The batched sampler: masks and penalties equal transformers' logits processors, seeded
draws do not depend on the batch, temperature sampling has the right distribution."""

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from framework import LLM, SamplingParams
from framework.engine.request import Request
from framework.engine.sampler import (
    Sampler,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    token_counts,
    uniform_noise,
)

V = 50


@pytest.fixture
def logits():
    return torch.randn(4, V, generator=torch.Generator().manual_seed(0)) * 3


def same(a, b):
    assert torch.equal(torch.isinf(a), torch.isinf(b))
    torch.testing.assert_close(a[~torch.isinf(a)], b[~torch.isinf(b)], rtol=0, atol=1e-6)


@pytest.mark.parametrize("k", [1, 3, 17])
def test_top_k_matches_transformers(logits, k):
    same(apply_top_k(logits, torch.full((4,), k)), TopKLogitsWarper(k)(None, logits.clone()))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_matches_transformers(logits, p):
    same(apply_top_p(logits, torch.full((4,), p)), TopPLogitsWarper(p)(None, logits.clone()))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_top_p_after_top_k_sorts_only_the_candidates(logits, p):
    k = apply_top_k(logits, torch.full((4,), 12))
    same(
        apply_top_p(k, torch.full((4,), p), max_candidates=12),
        TopPLogitsWarper(p)(None, TopKLogitsWarper(12)(None, logits.clone())),
    )


@pytest.mark.parametrize("p", [0.05, 0.3, 0.9])
def test_min_p_matches_transformers(logits, p):
    same(apply_min_p(logits, torch.full((4,), p)), MinPLogitsWarper(p)(None, logits.clone()))


def test_temperature_matches_transformers(logits):
    same(logits / 0.7, TemperatureLogitsWarper(0.7)(None, logits.clone()))


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(logits, penalty):
    g = torch.Generator().manual_seed(1)
    history = torch.randint(V, (4, 12), generator=g)
    prompt, output = history[:, :7].tolist(), history[:, 7:].tolist()
    ours = apply_penalties(
        logits,
        token_counts(prompt, V, "cpu") > 0,
        token_counts(output, V, "cpu"),
        torch.full((4,), penalty),
        torch.zeros(4),
        torch.zeros(4),
    )
    same(ours, RepetitionPenaltyLogitsProcessor(penalty)(history, logits.clone()))


def test_presence_and_frequency_penalties(logits):
    out = [[3, 3, 5], [], [7], [1, 1, 1]]
    counts = token_counts(out, V, "cpu")
    got = apply_penalties(
        logits,
        torch.zeros(4, V, dtype=torch.bool),
        counts,
        torch.ones(4),
        torch.full((4,), 0.5),
        torch.full((4,), 0.25),
    )
    want = logits.clone()
    for i, row in enumerate(out):
        for t in set(row):
            want[i, t] -= 0.5 + 0.25 * row.count(t)
    same(got, want)


def req(i, params, output=(), prompt=(1, 2, 3)):
    r = Request(
        i,
        list(prompt),
        params.max_tokens,
        params=params,
        seed=params.seed if params.seed is not None else 1000 + i,
    )
    r.output = list(output)
    return r


def test_top_k_1_equals_greedy(logits):
    reqs = [req(i, SamplingParams(temperature=1.3, top_k=1, seed=i)) for i in range(4)]
    assert Sampler()(logits, reqs)[0] == logits.argmax(-1).tolist()


def test_greedy_fast_path_and_mixed_batch(logits):
    greedy = [req(i, SamplingParams()) for i in range(4)]
    tokens, lp = Sampler()(logits, greedy)
    assert tokens == logits.argmax(-1).tolist() and lp is None
    mixed = greedy[:2] + [req(2, SamplingParams(temperature=1.0, seed=5)), greedy[3]]
    tokens = Sampler()(logits, mixed)[0]
    assert [tokens[i] for i in (0, 1, 3)] == logits.argmax(-1)[[0, 1, 3]].tolist()


def test_seeded_rows_do_not_depend_on_the_batch(logits):
    sp = SamplingParams(temperature=1.5, top_p=0.95, seed=1234)
    target = logits[2:3]
    alone = [Sampler()(target, [req(0, sp, output=[0] * s)])[0][0] for s in range(20)]
    other = SamplingParams(temperature=0.8, top_k=5, seed=9)
    for s in range(20):
        batch = torch.cat([logits[:2], target, logits[3:]])
        reqs = [
            req(1, other, output=[1] * s),
            req(7, SamplingParams()),
            req(0, sp, output=[0] * s),
            req(3, SamplingParams(temperature=2.0)),
        ]
        assert Sampler()(batch, reqs)[0][2] == alone[s]
    assert len(set(alone)) > 1  # the step index changes the draw


def test_noise_is_uniform_and_keyed():
    u = uniform_noise(torch.tensor([1, 2]), torch.tensor([0, 0]), 100_000)
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.005
    assert not torch.equal(u[0], u[1])
    assert torch.equal(u, uniform_noise(torch.tensor([1, 2]), torch.tensor([0, 0]), 100_000))


def chi_square_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = observed.numel() - 1
    return float(
        torch.special.gammaincc(
            torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
        )
    )


def test_chi_square_rejects_a_wrong_distribution():
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    noise = uniform_noise(torch.full((10_000,), 42), torch.arange(10_000), 8)
    counts = torch.bincount((base.softmax(-1) / -noise.log()).argmax(-1), minlength=8)
    assert chi_square_pvalue(counts.double(), (base / 2).softmax(-1).double() * 1e4) < 1e-6


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.8])
def test_temperature_sampling_chi_square(temperature):
    """10,000 draws (different steps of one seeded request) from a fixed 8-way logit vector
    follow softmax(logits / T) (chi-square goodness of fit, p > 0.001)."""
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    n = 10_000
    # One batched race: row i is output step i of the request seeded 42.
    noise = uniform_noise(torch.full((n,), 42), torch.arange(n), 8)
    race = (base / temperature).softmax(-1) / -noise.log()
    counts = torch.bincount(race.argmax(-1), minlength=8).double()
    expected = (base / temperature).softmax(-1).double() * n
    assert chi_square_pvalue(counts, expected) > 1e-3
    sp = SamplingParams(temperature=temperature, seed=42)
    # and the Sampler itself draws the same tokens as this race
    few = [req(0, sp, output=[0] * s) for s in range(16)]
    got = Sampler()(base.expand(16, 8).clone(), few)[0]
    assert got == race[:16].argmax(-1).tolist()


def test_seeded_generate_reproducible_across_batch_mixes(llama_checkpoint):
    llm = LLM(str(llama_checkpoint), optimization_level=0, max_num_seqs=4, max_model_len=64)
    sp = SamplingParams(temperature=1.0, top_k=40, seed=7, max_tokens=10, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], sampling_params=sp)[0]
    mixed = llm.generate(
        [[9, 9], [5, 6, 7], [1]],
        sampling_params=[
            SamplingParams(temperature=0.5, max_tokens=4),
            sp,
            SamplingParams(max_tokens=12, repetition_penalty=1.2),
        ],
    )
    assert mixed[1] == alone
    other_seed = llm.generate([[5, 6, 7]], sampling_params=sp.replace(seed=8))[0]
    assert other_seed != alone


def test_top_k_candidates_race_equals_the_full_race(logits):
    """With top_k set the race runs over the k candidates only; the noise is keyed by
    vocabulary index, so the draw is the one the full-vocabulary race makes."""
    sp = SamplingParams(temperature=1.2, top_k=7, seed=3)
    for step in range(30):
        r = [req(0, sp, output=[0] * step)]
        masked = apply_top_k(logits[:1] / 1.2, torch.tensor([7]))
        noise = uniform_noise(torch.tensor([3]), torch.tensor([step]), V)
        full = (masked.softmax(-1) / -noise.log()).argmax(-1).item()
        assert Sampler()(logits[:1], r)[0] == [full]


def test_greedy_fast_path_equals_the_full_sampler_with_ties_and_bf16():
    """The greedy fast path (the native pass over bf16 rows) picks what torch picks and
    what the full sampler picks, ties included (bf16 logits tie often: the first index wins),
    and fails exactly the rows that are not finite."""
    from framework.engine.sampler import greedy_argmax

    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(8, 32000, generator=gen) * 4).bfloat16()
    top = x.float().amax(dim=-1)
    for r, cols in enumerate([(5, 31999), (0, 17), (12000, 12001, 20000)]):
        x[r, list(cols)] = top[r].bfloat16()  # ties with each other (and maybe the old max)
    x[3, 100] = x[3, 200] = float("inf")  # +inf wins, first one
    want = x.float().argmax(dim=-1).tolist()
    assert want == x.float().max(dim=-1).indices.tolist()
    got, maxima = greedy_argmax(x)
    assert got == want and maxima == x.float().amax(dim=-1).tolist()
    fast = Sampler()(x, [req(i, SamplingParams()) for i in range(8)])[0]
    full = Sampler()(x, [req(i, SamplingParams(logprobs=0)) for i in range(8)])[0]
    assert fast[:3] == want[:3] and fast[4:] == want[4:] and fast == full
    assert fast[3] is None  # +inf: not finite, failed alone

    y = x.clone()
    y[1, 7] = float("nan")
    y[2] = float("-inf")
    reqs = [req(i, SamplingParams()) for i in range(8)]
    tokens = Sampler()(y, reqs)[0]
    assert [i for i, t in enumerate(tokens) if t is None] == [1, 2, 3]
    assert all(reqs[i].finish_reason == "error" for i in (1, 2, 3))
    assert [tokens[i] for i in (0, 4, 5, 6, 7)] == [want[i] for i in (0, 4, 5, 6, 7)]
    assert greedy_argmax(y)[0][1] == 7  # a NaN is the row's maximum, as in torch.max
