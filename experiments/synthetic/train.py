"""Train a small Llama on a synthetic task and save it as a Hugging Face checkpoint.

    python -m experiments.synthetic.train --task addition --out models/synthetic/addition

The model is transformers' own ``LlamaForCausalLM`` (so ``models.loader.load_model`` and
``framework.LLM`` load it like any HF folder), trained from scratch with the loss on the answer
tokens and the EOS only.  Training is deterministic: fixed seeds for weights and data,
``torch.use_deterministic_algorithms``, and a fixed thread count (1 by default; the float sums
of a matmul depend on how it is split across threads).  It stops after ``--max-steps`` or,
earlier, once greedy exact match on a validation batch of training-split keys reaches
``--target`` at two consecutive checks -- a step-count rule, never a wall-clock one, so a rerun
stops at the same step.

A draft model for speculative decoding is trained the same way with fewer layers, and
``--draft-of`` records its greedy acceptance by the target in metrics.json (``draft``)::

    python -m experiments.synthetic.train --task addition --num-layers 1 \
        --out models/synthetic/addition-draft --draft-of models/synthetic/addition

Writes ``config.json`` + ``model.safetensors`` (float32) and ``metrics.json``: the recipe,
training curve, wall time, and exact match through ``framework.LLM`` at O0 on held-out prompts
(plus each int8 quantization shorthand when ``framework.core.quantization`` is available).  Written
into a temporary folder and renamed, so a reader never sees a half-written checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from experiments.synthetic.task import (
    EOS_ID,
    SYMBOLS,
    VOCAB_SIZE,
    SyntheticTask,
    evaluate,
    exact_match,
    get_task,
    task_names,
)
from framework.core.files import publish_dir

EVAL_N = 200
EVAL_SEED = 1234
SMOKE_N = 50
QUANT_SHORTHANDS = ("int8_per_token", "int8_per_channel_weight_only")


@dataclass
class TrainRecipe:
    """Everything that determines the trained weights (recorded in metrics.json)."""

    task: str = "addition"
    seed: int = 0
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 2
    num_heads: int = 4
    batch_size: int = 128
    max_steps: int = 1500
    lr: float = 1e-3
    """3e-3 leaves this model stuck at chance on the sum digits (loss ~1.38) for 600+ steps."""
    warmup_steps: int = 100
    weight_decay: float = 0.0
    eval_every: int = 100
    val_size: int = 512
    target: float = 0.995
    """Stop once validation exact match reaches this at two consecutive checks."""
    threads: int = 1


def build_model(recipe: TrainRecipe, task: SyntheticTask):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_heads,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=EOS_ID,
        pad_token_id=None,
    )
    if task.seq_len > config.max_position_embeddings:
        raise ValueError(
            f"task {task.name!r}: sequences of {task.seq_len} tokens exceed "
            f"max_position_embeddings={config.max_position_embeddings}"
        )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(recipe.seed)
    return LlamaForCausalLM(config).float()


def answer_loss(model, seqs: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Next-token cross entropy on the answer tokens and the EOS (the prompt is given)."""
    logits = model(input_ids=seqs[:, :-1]).logits[:, prompt_len - 1 :]
    targets = seqs[:, prompt_len:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def greedy_exact_match(model, seqs: torch.Tensor, prompt_len: int) -> float:
    """Exact match of greedy decoding, in one teacher-forced forward: greedy decoding yields
    the answer iff the argmax at every answer position is the answer token."""
    logits = model(input_ids=seqs[:, :-1]).logits[:, prompt_len - 1 :]
    return float((logits.argmax(-1) == seqs[:, prompt_len:]).all(dim=1).float().mean())


def _lr_at(step: int, recipe: TrainRecipe) -> float:
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.max_steps - recipe.warmup_steps)
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(recipe: TrainRecipe, log=print) -> tuple[Any, dict[str, Any]]:
    """Train per ``recipe``; returns ``(hf_model, training record)``.  The thread count and
    deterministic-algorithms flag are process-wide, so they are restored afterwards."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(recipe.threads)
    torch.use_deterministic_algorithms(True)
    try:
        return _train(recipe, get_task(recipe.task), log)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _train(recipe: TrainRecipe, task: SyntheticTask, log) -> tuple[Any, dict[str, Any]]:
    model = build_model(recipe, task)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(
        model.parameters(), lr=recipe.lr, betas=(0.9, 0.98), weight_decay=recipe.weight_decay
    )
    data = torch.Generator().manual_seed(recipe.seed + 1)
    val = task.sequences(
        task.sample_keys(recipe.val_size, torch.Generator().manual_seed(recipe.seed + 2), "train")
    )
    curve, hits, t0 = [], 0, time.perf_counter()
    log(
        f"training {task.name} ({task.description}): {params:,} parameters, "
        f"batch {recipe.batch_size}, up to {recipe.max_steps} steps"
    )
    step = 0
    for step in range(1, recipe.max_steps + 1):
        model.train()
        for group in opt.param_groups:
            group["lr"] = _lr_at(step - 1, recipe)
        seqs = task.sequences(task.sample_keys(recipe.batch_size, data, "train"))
        loss = answer_loss(model, seqs, task.prompt_len)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % recipe.eval_every == 0 or step == recipe.max_steps:
            model.eval()
            em = greedy_exact_match(model, val, task.prompt_len)
            curve.append({"step": step, "loss": round(loss.item(), 5), "val_exact_match": em})
            log(
                f"step {step:5d}  loss {loss.item():.4f}  val exact match {em:.3f}  "
                f"({time.perf_counter() - t0:.0f} s)"
            )
            hits = hits + 1 if em >= recipe.target else 0
            if hits >= 2:
                break
    model.eval()
    record = {
        "parameters": params,
        "steps": step,
        "train_seconds": time.perf_counter() - t0,
        "curve": curve,
        "val_exact_match": curve[-1]["val_exact_match"],
    }
    return model, record


def evaluate_checkpoint(
    model_dir: Path, task: str, n: int = EVAL_N, seed: int = EVAL_SEED, log=print
) -> dict[str, Any]:
    """Exact match through ``framework.LLM`` at O0: unquantized and per int8 shorthand.

    Also records the exact match over the first ``SMOKE_N`` prompts (a prefix of the same
    set: see ``SyntheticTask.held_out_keys``), which the test suite reproduces cheaply."""
    base = evaluate(model_dir, None, 0, n=n, seed=seed, task=task)
    t = get_task(task)
    _, answers = t.split(t.sequences(t.held_out_keys(n, seed)))

    def summary(res: dict[str, Any]) -> dict[str, Any]:
        k = min(SMOKE_N, n)
        return {
            "exact_match": res["exact_match"],
            "exact_match_first_smoke_n": exact_match(res["outputs"][:k], answers[:k]),
            "quantized_layers": res["quantized_layers"],
            "token_agreement_vs_unquantized_O0": res["token_agreement_vs"]["unquantized_O0"],
            "max_first_token_logit_diff_vs_unquantized_O0": res["max_logit_diff_vs"][
                "unquantized_O0"
            ],
        }

    out = {
        "n": n,
        "seed": seed,
        "smoke_n": min(SMOKE_N, n),
        "dtype": "float32",
        "optimization_level": 0,
        "unquantized": summary(base),
    }
    log(f"held-out exact match through framework.LLM (O0, n={n}): {base['exact_match']:.3f}")
    for name in QUANT_SHORTHANDS:
        res = evaluate(model_dir, name, 0, n=n, seed=seed, task=task, reference=base)
        out[name] = summary(res)
        log(
            f"  {name}: exact match {res['exact_match']:.3f}, token agreement "
            f"{res['token_agreement_vs']['unquantized_O0']:.4f}, max first-token logit diff "
            f"{res['max_logit_diff_vs']['unquantized_O0']:.3g} ({res['quantized_layers']} "
            f"layers quantized)"
        )
    return out


def draft_metrics(
    draft_dir: Path, target_dir: Path, task: str, n: int = EVAL_N, seed: int = EVAL_SEED, log=print
) -> dict[str, Any]:
    """A draft model's greedy acceptance by its target
    (``experiments.synthetic.draft_acceptance``) on ``n`` held-out prompts, for k = 1, 2 and 4,
    at O0."""
    from experiments.synthetic.draft_acceptance import draft_acceptance

    t = get_task(task)
    prompts, _ = t.split(t.sequences(t.held_out_keys(n, seed)))
    out: dict[str, Any] = {"target": Path(target_dir).name, "n": n, "seed": seed, "by_k": {}}
    for k in (1, 2, 4):
        res = draft_acceptance(str(target_dir), str(draft_dir), prompts, t.answer_len + 1, k)
        res = {key: v for key, v in res.items() if key not in ("target", "draft")}
        out["by_k"][str(k)] = res
        log(
            f"  draft for {out['target']}, k={k}: acceptance {res['acceptance_rate']:.3f}, "
            f"per position {[round(x, 3) for x in res['per_position_acceptance'] if x is not None]}"
            f", mean accepted length {res['mean_accepted_length']:.2f}"
        )
    return out


def save(
    model,
    record: dict[str, Any],
    recipe: TrainRecipe,
    out: Path,
    log=print,
    eval_n: int = EVAL_N,
    draft_of: Optional[Path] = None,
) -> Path:
    """Write the checkpoint and metrics.json into ``out`` atomically (temp dir + rename).
    ``draft_of``: the target this checkpoint drafts for; its acceptance goes into
    metrics.json (``draft``)."""
    task = get_task(recipe.task)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        # safetensors (the only format of transformers >= 5); config.json and
        # generation_config.json carry eos_token_id, so greedy decoding stops after the answer.
        model.save_pretrained(tmp)
        metrics = {
            "task": task.name,
            "description": task.description,
            "format": {
                "symbols": SYMBOLS,
                "eos_token_id": EOS_ID,
                "vocab_size": VOCAB_SIZE,
                "prompt_len": task.prompt_len,
                "answer_len": task.answer_len,
            },
            "recipe": asdict(recipe),
            "torch": torch.__version__,
            "training": record,
            "eval": evaluate_checkpoint(tmp, task.name, n=eval_n, log=log),
        }
        if draft_of is not None:
            metrics["draft"] = draft_metrics(tmp, Path(draft_of), task.name, n=eval_n, log=log)
        (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        for f in tmp.iterdir():
            f.chmod(0o644)
        publish_dir(tmp, out, replace=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(f.stat().st_size for f in out.iterdir())
    log(f"wrote {out} ({size / 1e6:.2f} MB)")
    return out


def main(argv: Optional[list[str]] = None) -> int:
    defaults = TrainRecipe()
    p = argparse.ArgumentParser(
        prog="python -m experiments.synthetic.train",
        description="Train a small Llama on a synthetic task",
    )
    p.add_argument("--task", default=defaults.task, choices=task_names())
    p.add_argument("--out", required=True, help="checkpoint folder, e.g. models/synthetic/addition")
    p.add_argument(
        "--draft-of",
        default=None,
        help="a trained target this checkpoint is a draft model for (same task): its greedy "
        "acceptance by that target goes into metrics.json",
    )
    for field in (
        "seed",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "batch_size",
        "max_steps",
        "warmup_steps",
        "eval_every",
        "val_size",
        "threads",
    ):
        p.add_argument("--" + field.replace("_", "-"), type=int, default=getattr(defaults, field))
    for field in ("lr", "weight_decay", "target"):
        p.add_argument("--" + field.replace("_", "-"), type=float, default=getattr(defaults, field))
    args = vars(p.parse_args(argv))
    out = Path(args.pop("out"))
    draft_of = args.pop("draft_of")
    recipe = TrainRecipe(**args)
    model, record = train(recipe)
    save(model, record, recipe, out, draft_of=None if draft_of is None else Path(draft_of))
    return 0


if __name__ == "__main__":
    sys.exit(main())
