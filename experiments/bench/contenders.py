"""The contenders of the side-by-side benchmark (``experiments.bench.vs_hf``): each runs
``generate(prompts, steps) -> (tokens per prompt [steps + 1], decode step seconds)`` and times
a decode step the same way (build the step's inputs, forward, argmax, read tokens back).

  HFLoop     (a) transformers eager / (b) ``torch.compile(hf, dynamic=True)``, DynamicCache
  HFStatic   (c) StaticCache + ``torch.compile(fullgraph)`` of the decode step with freezing
  Piecewise  (d) this project's ``LLM``
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from framework import LLM, CompilationConfig
from framework.compat import inductor as compat_inductor


class Contender:
    """``generate(prompts, steps) -> (tokens per prompt [steps + 1], decode step seconds)``."""

    name: str

    def generate(self, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[float]]:
        raise NotImplementedError


class HFLoop(Contender):
    """(a)/(b): greedy loop over a transformers model with a DynamicCache."""

    def __init__(self, name: str, model: torch.nn.Module, forward: Callable):
        self.name, self.model, self.forward = name, model, forward

    @torch.no_grad()
    def generate(self, prompts, steps):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        logits = self.forward(
            input_ids=torch.tensor(prompts), cache=cache, use_cache=True, logits_to_keep=1
        ).logits
        toks = logits[:, -1].argmax(-1).tolist()
        out, times = [[t] for t in toks], []
        for _ in range(steps):
            t0 = time.perf_counter()
            ids = torch.tensor(toks).unsqueeze(1)
            logits = self.forward(
                input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1
            ).logits
            toks = logits[:, -1].argmax(-1).tolist()
            times.append(time.perf_counter() - t0)
            for row, t in zip(out, toks):
                row.append(t)
        return out, times


class HFStatic(Contender):
    """(c): StaticCache; eager prefill, compiled (fullgraph, freezing) decode step + argmax."""

    name = "hf_static"

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.caches: dict[tuple[int, int], Any] = {}
        """One StaticCache per (batch, prompt + steps + 1): static-cache attention spans the
        whole cache, so each workload gets a cache just long enough for it."""

        def decode(ids: torch.Tensor, cache: Any) -> torch.Tensor:
            logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
            return logits[:, -1].argmax(-1)

        # dynamic=False: one specialised graph per batch size, the fastest stock variant.
        self.decode = torch.compile(decode, fullgraph=True, dynamic=False)

    @torch.no_grad()
    def generate(self, prompts, steps):
        from transformers import StaticCache

        key = (len(prompts), len(prompts[0]) + steps + 1)
        if key not in self.caches:  # one cache per shape: no re-allocation, no guard miss
            self.caches[key] = StaticCache(config=self.model.config, max_cache_len=key[1])
        cache = self.caches[key]
        cache.reset()
        # freezing is read when Inductor compiles (the first call per batch size); the patch
        # costs nothing measurable and keeps the global config untouched for other contenders.
        with compat_inductor.config_patch(freezing=True):
            logits = self.model(
                input_ids=torch.tensor(prompts), cache=cache, use_cache=True, logits_to_keep=1
            ).logits
            toks = logits[:, -1].argmax(-1).tolist()
            out, times = [[t] for t in toks], []
            for _ in range(steps):
                t0 = time.perf_counter()
                toks = self.decode(torch.tensor(toks).unsqueeze(1), cache).tolist()
                times.append(time.perf_counter() - t0)
                for row, t in zip(out, toks):
                    row.append(t)
        return out, times


class Piecewise(Contender):
    """(d): this project's LLM; per-step times from ``llm.runner.step_times['decode']``."""

    def __init__(self, name: str, llm: Any):
        self.name, self.llm = name, llm

    def generate(self, prompts, steps):
        for times in self.llm.runner.step_times.values():
            times.clear()
        out = self.llm.generate(prompts, max_new_tokens=steps + 1, ignore_eos=True)
        times = list(self.llm.runner.step_times["decode"])
        if len(times) != steps:
            raise RuntimeError(
                f"{self.name}: expected {steps} decode steps, the runner timed "
                f"{len(times)} (mixed steps: "
                f"{len(self.llm.runner.step_times['mixed'])})"
            )
        return out, times

    def time_generate(self, prompts: list[list[int]], new_tokens: int) -> float:
        """Wall seconds of one ``LLM.generate`` of ``new_tokens`` (host work included)."""
        t0 = time.perf_counter()
        self.llm.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True)
        return time.perf_counter() - t0


def load_hf(path: str, dtype: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()


def build_llm(
    level: int, path: str, dtype: str, cache_dir: str, max_num_seqs: int, max_model_len: int
):
    return LLM(
        path,
        dtype=dtype,
        cache_dir=cache_dir,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        compilation_config=CompilationConfig(level=level, progress_bar=False),
    )
