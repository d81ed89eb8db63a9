"""Fixtures of the pytest-benchmark suite (``make bench``; see experiments/bench/pytest_bench.py).

Every test here carries the ``bench`` and ``slow`` markers, so ``make test`` (``-m "not
slow"``) never runs them.  The model under benchmark comes from environment variables that
``python -m experiments.bench`` sets from its flags:

    PIECEWISE_BENCH_PRESET   models.tiny preset       (default: default)
    PIECEWISE_BENCH_DTYPE    float32 | bfloat16       (default: bfloat16)
    PIECEWISE_BENCH_LEVEL    optimization level 0-3   (default: 2)
    PIECEWISE_BENCH_THREADS  torch.set_num_threads    (default: torch's)
    PIECEWISE_BENCH_CACHE_DIR artifact cache dir      (default: the framework's; warm after
                                                       the first run)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

PROMPT_LEN = 64


def pytest_configure(config):
    config.addinivalue_line("markers", "bench: pytest-benchmark suite, run by `make bench`")


@dataclass(frozen=True)
class BenchSettings:
    preset: str
    dtype: str
    level: int
    threads: int | None
    cache_dir: str | None


@pytest.fixture(scope="session")
def bench_settings() -> BenchSettings:
    threads = os.environ.get("PIECEWISE_BENCH_THREADS")
    s = BenchSettings(
        preset=os.environ.get("PIECEWISE_BENCH_PRESET", "default"),
        dtype=os.environ.get("PIECEWISE_BENCH_DTYPE", "bfloat16"),
        level=int(os.environ.get("PIECEWISE_BENCH_LEVEL", "2")),
        threads=int(threads) if threads else None,
        cache_dir=os.environ.get("PIECEWISE_BENCH_CACHE_DIR"),
    )
    if s.threads:
        torch.set_num_threads(s.threads)
    return s


@pytest.fixture(scope="session")
def bench_llm(bench_settings):
    """The benchmarked LLM (compiled once per session; loaded from the artifact cache when
    an earlier run compiled the same configuration)."""
    from framework import LLM, CompilationConfig
    from models.tiny import ensure_tiny_model

    path = ensure_tiny_model(preset=bench_settings.preset)
    return LLM(
        str(path),
        dtype=bench_settings.dtype,
        max_num_seqs=8,
        max_model_len=512,
        cache_dir=bench_settings.cache_dir,
        compilation_config=CompilationConfig(level=bench_settings.level, progress_bar=False),
    )


class StepHarness:
    """Fixed scheduled chunks replayed on an LLM's runner: each call recomputes the same
    positions (rewriting the same KV-cache slots), so every call does identical work."""

    def __init__(self, llm, batch: int, prompt_len: int = PROMPT_LEN, decode: bool = True):
        from framework.engine.scheduler import Request, ScheduledChunk

        self.llm = llm
        vocab = llm.model_config.vocab_size
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(1, vocab, (batch, prompt_len), generator=g).tolist()
        self.reqs = [Request(-1000 - i, p, max_new_tokens=2) for i, p in enumerate(prompts)]
        for r in self.reqs:
            llm.scheduler._reserve(r, prompt_len + 1)
        self.prefill = [ScheduledChunk(r, 0, prompt_len) for r in self.reqs]
        self.chunks = self.prefill
        if decode:
            sampled, _ = llm.runner.execute(self.prefill)
            for r, tok in zip(self.reqs, sampled):
                r.num_computed = prompt_len
                r.output.append(tok)
            self.chunks = [ScheduledChunk(r, prompt_len, 1) for r in self.reqs]

    def step(self):
        return self.llm.runner.execute(self.chunks)

    def close(self) -> None:
        for r in self.reqs:
            self.llm.block_manager.free(r.block_ids)
            r.block_ids = []
        runner = self.llm.runner
        for times in runner.step_times.values():
            times.clear()
        if runner.trace is not None:
            runner.trace.clear()


@pytest.fixture
def step_harness(bench_llm):
    made: list[StepHarness] = []

    def make(batch: int, decode: bool = True, prompt_len: int = PROMPT_LEN) -> StepHarness:
        made.append(StepHarness(bench_llm, batch, prompt_len, decode))
        return made[-1]

    yield make
    for h in made:
        h.close()
