"""What a job runs: the model folder its config names and its prompts (random ones of the
workload, or a synthetic-task checkpoint's held-out prompts with their answers)."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

logger = logging.getLogger("experiments.run")

SYNTHETIC_DIR = Path(__file__).resolve().parent.parent / "models" / "synthetic"


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


def prompt_seed(cfg: DictConfig) -> int:
    """The prompts' seed: ``workload.seed`` (the top-level ``seed`` seeds the LLM: sampling
    and calibration), so an A/A sweep over ``seed`` under greedy decoding sees the same
    prompts."""
    seed = cfg.workload.get("seed")
    return int(cfg.seed if seed is None else seed)


def synthetic_task_of(model_path: str):
    """The synthetic task a trained checkpoint was made for (experiments.train_synthetic writes
    it into the folder's metrics.json), or None for any other model."""
    metrics = Path(model_path) / "metrics.json"
    if not metrics.is_file():
        return None
    try:
        name = json.loads(metrics.read_text()).get("task")
    except (OSError, ValueError, AttributeError):
        return None
    from experiments.synthetic_task import get_task, task_names

    return get_task(name) if name in task_names() else None


def job_prompts(
    cfg: DictConfig, model_path: str, vocab_size: int
) -> tuple[list[list[int]], int, bool, Optional[list[list[int]]]]:
    """(prompts, max_new_tokens, ignore_eos, answers). A synthetic-task checkpoint gets
    ``workload.num_prompts`` held-out prompts of its task (answers known, so exact match is
    measured); any other model the workload's random prompts (answers None)."""
    task = synthetic_task_of(model_path)
    if task is None:
        return (
            make_prompts(cfg.workload, vocab_size, prompt_seed(cfg)),
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
        from experiments.synthetic_tokenizer import from_model_notation, to_model_notation

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
