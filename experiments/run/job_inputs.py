"""What a job runs: the model folder its config names and its prompts (random ones of the
workload, or a synthetic-task checkpoint's held-out prompts with their answers)."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Callable, Optional, Sequence

from omegaconf import DictConfig

logger = logging.getLogger("experiments.run.job")

SYNTHETIC_DIR = Path(__file__).resolve().parents[2] / "models" / "synthetic"


def resolve_model_path(model_cfg: DictConfig) -> str:
    if model_cfg.source == "hf":
        return str(model_cfg.path)
    if model_cfg.source == "synthetic":
        path = SYNTHETIC_DIR / str(model_cfg.name)
        if not (path / "config.json").is_file():
            raise ValueError(f"model.name={model_cfg.name!r}: no checkpoint in {path}")
        return str(path)
    from models.tiny import ensure_tiny_model

    return str(ensure_tiny_model(preset=model_cfg.preset))


def make_prompts(workload: DictConfig, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lo, hi = int(workload.prompt_len_min), int(workload.prompt_len_max)
    if not 0 < lo <= hi:
        raise ValueError(f"workload.prompt_len_min/max: need 0 < min <= max, got {lo}, {hi}")
    return [
        [rng.randrange(vocab_size) for _ in range(rng.randint(lo, hi))]
        for _ in range(int(workload.num_prompts))
    ]


EchoFn = Callable[[list[list[int]], int], list[list[int]]]
"""``echo(prompts, n)``: each prompt's greedy continuation of ``n`` tokens, by a plain engine
(no speculation) of the job's own configuration."""


def copy_prompts(workload: DictConfig, vocab_size: int, seed: int, echo: EchoFn) -> list[list[int]]:
    """Copy-heavy prompts (``workload.kind: copy``): a random seed text of
    ``prompt_len_min..max`` tokens followed by the model's own greedy continuation of it
    (``workload.echo_len`` tokens).  Greedy decoding of a small (or random-weight) model falls
    into a loop, so the echo ends inside one and the prompt's continuation repeats text the
    prompt already holds -- what prompt lookup (n-gram) drafting is for, as with a real model
    asked to quote, edit or summarise a document.  :func:`copy_fraction` measures how much of
    a continuation is such a repeat."""
    seeds = make_prompts(workload, vocab_size, seed)
    return [s + e for s, e in zip(seeds, echo(seeds, int(workload.echo_len)))]


def copy_fraction(
    prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], n: int = 3
) -> Optional[float]:
    """Fraction of the output tokens that an ``n``-gram lookup would have drafted: the ``n``
    tokens before it occur earlier in prompt + output, and the most recent such occurrence is
    followed by this very token."""
    hit = total = 0
    for p, o in zip(prompts, outputs):
        seq = list(p) + list(o)
        for i in range(max(len(p), n), len(seq)):
            total += 1
            gram = seq[i - n : i]
            for j in range(i - 1, n - 1, -1):
                if seq[j - n : j] == gram:
                    hit += seq[j] == seq[i]
                    break
    return hit / total if total else None


def prompt_seed(cfg: DictConfig) -> int:
    """The prompts' seed: ``workload.seed`` (the top-level ``seed`` seeds the LLM: sampling
    and calibration), so an A/A sweep over ``seed`` under greedy decoding sees the same
    prompts."""
    seed = cfg.workload.get("seed")
    return int(cfg.seed if seed is None else seed)


def synthetic_task_of(model_path: str):
    """The synthetic task a trained checkpoint was made for (experiments.synthetic.train writes
    it into the folder's metrics.json), or None for any other model."""
    metrics = Path(model_path) / "metrics.json"
    if not metrics.is_file():
        return None
    try:
        name = json.loads(metrics.read_text()).get("task")
    except (OSError, ValueError, AttributeError):
        return None
    from experiments.synthetic.task import get_task, task_names

    return get_task(name) if name in task_names() else None


def job_prompts(
    cfg: DictConfig, model_path: str, vocab_size: int, echo: Optional[EchoFn] = None
) -> tuple[list[list[int]], int, bool, Optional[list[list[int]]]]:
    """(prompts, max_new_tokens, ignore_eos, answers). A synthetic-task checkpoint gets
    ``workload.num_prompts`` held-out prompts of its task (answers known, so exact match is
    measured); any other model the workload's random prompts (answers None), or with
    ``workload.kind: copy`` the copy-heavy prompts of :func:`copy_prompts` (``echo``
    required)."""
    task = synthetic_task_of(model_path)
    kind = cfg.workload.get("kind") or "random"
    if kind not in ("random", "copy"):
        raise ValueError(f"workload.kind: expected 'random' or 'copy', got {kind!r}")
    if task is None:
        if kind == "copy":
            if echo is None:
                raise ValueError("workload.kind=copy: the job must pass an echo engine")
            prompts = copy_prompts(cfg.workload, vocab_size, prompt_seed(cfg), echo)
        else:
            prompts = make_prompts(cfg.workload, vocab_size, prompt_seed(cfg))
        return (
            prompts,
            int(cfg.workload.max_new_tokens),
            bool(cfg.workload.ignore_eos),
            None,
        )
    logger.info(
        "%s is a %r synthetic-task checkpoint: %d held-out prompts, exact match recorded",
        model_path,
        task.name,
        int(cfg.workload.num_prompts),
    )
    keys = task.held_out_keys(int(cfg.workload.num_prompts), prompt_seed(cfg))
    prompts, answers = task.split(task.sequences(keys))
    # The answer ends with EOS: the model must stop by itself for an exact match.
    return prompts, task.answer_len + 1, False, answers


def text_examples(
    llm, model_path: str, prompts: list[list[int]], outputs: list[list[int]]
) -> Optional[list[dict[str, str]]]:
    """With a tokenizer: a few prompts and answers as text (None without one).  A synthetic
    addition checkpoint answers ``123+456=`` in the usual notation (its own writes numbers
    least significant digit first)."""
    if llm.tokenizer is None:
        return None
    task = synthetic_task_of(model_path)
    if task is not None and task.name == "addition":
        from experiments.synthetic.tokenizer import from_model_notation, to_model_notation

        shown = ["123+456=", "999+1=", "500+500="]
        answers = llm.generate(
            [to_model_notation(p) for p in shown], max_new_tokens=task.answer_len + 1
        )
        return [{"prompt": p, "answer": from_model_notation(a)} for p, a in zip(shown, answers)]
    dec = llm.tokenizer.decode
    return [
        {"prompt": dec(p, skip_special_tokens=True), "answer": dec(o, skip_special_tokens=True)}
        for p, o in zip(prompts[:3], outputs)
    ]
