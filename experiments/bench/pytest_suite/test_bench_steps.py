"""Decode and prefill step latency of the benchmarked LLM (one ``runner.execute`` per call:
input staging, forward, logits, argmax, tokens to the host)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.bench, pytest.mark.slow]

ROUNDS = 30
WARMUP_ROUNDS = 3


def _describe(benchmark, llm, **extra) -> None:
    benchmark.extra_info.update(
        level=llm.config.level,
        dtype=str(llm.dtype),
        num_layers=llm.model_config.num_layers,
        hidden_size=llm.model_config.hidden_size,
        **extra,
    )


@pytest.mark.parametrize("batch", [1, 8])
def test_decode_step(benchmark, bench_llm, step_harness, batch):
    h = step_harness(batch, decode=True)
    _describe(benchmark, bench_llm, batch=batch, context_len=len(h.reqs[0].prompt) + 1)
    sampled, logits = benchmark.pedantic(h.step, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS)
    assert len(sampled) == batch and all(isinstance(t, int) for t in sampled)
    assert logits.shape == (batch, bench_llm.model_config.vocab_size)


def test_prefill_step(benchmark, bench_llm, step_harness):
    h = step_harness(1, decode=False)
    _describe(benchmark, bench_llm, batch=1, prompt_len=len(h.reqs[0].prompt))
    sampled, _ = benchmark.pedantic(h.step, rounds=ROUNDS // 3, warmup_rounds=1)
    assert len(sampled) == 1 and isinstance(sampled[0], int)
