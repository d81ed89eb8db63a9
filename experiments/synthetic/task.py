"""Synthetic tasks with an exact-match metric, and their evaluation through our ``LLM``.

A model whose outputs mean something lets a quantization or compiler change be judged by
accuracy, not only by token agreement with a reference.  The project trains one
(``experiments/synthetic/train.py``) and ships it in ``models/synthetic/<task>/``.

Tasks are tokenizer-free: a fixed 16-symbol vocabulary (digits, ``+``, ``=``, EOS) shared by
every task.  Every example is identified by an integer *key* (e.g. ``a * 1000 + b`` for
``a+b``); a fixed integer hash of the key puts 1/16 of all examples in a held-out split that
training never sees, so evaluation measures generalisation, not memorisation.

* ``addition`` -- ``"321+654="`` -> ``"9750"`` + EOS, i.e. 123 + 456 = 0579: 3-digit operands
  and the 4-digit sum, zero-padded, every number written least-significant digit first.  Then
  each answer digit depends only on two operand digits and the carry from the digit before,
  and those sit at fixed *relative* offsets from the position predicting it, which a 2-layer
  RoPE model learns in a few CPU minutes (cf. Lee et al. 2023, "Teaching arithmetic to small
  transformers"); in written order the first sum digit needs the whole carry chain.
* ``reversal`` -- ``"012345="`` -> ``"543210"`` + EOS.

    python -m experiments.synthetic.task models/synthetic/addition --quantization int8_per_token
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from framework.core.registry import Registry

# --- vocabulary ---------------------------------------------------------------------------

SYMBOLS = "0123456789+="
EOS_ID = len(SYMBOLS)  # 12
VOCAB_SIZE = 16  # ids 13..15 unused (a round size; never a target)
_SYMBOL_IDS = {c: i for i, c in enumerate(SYMBOLS)}
PLUS_ID, EQUALS_ID = _SYMBOL_IDS["+"], _SYMBOL_IDS["="]

_DRAW = 4096  # keys per random draw in SyntheticTask.sample_keys
HELD_OUT_BUCKETS = 16
"""One key in HELD_OUT_BUCKETS (by :func:`is_held_out`) is reserved for evaluation."""


def encode(text: str) -> list[int]:
    """``"12+3="`` -> token ids; every character must be one of :data:`SYMBOLS`."""
    try:
        return [_SYMBOL_IDS[c] for c in text]
    except KeyError as e:
        raise ValueError(
            f"encode: character {e.args[0]!r} in {text!r} is not in the "
            f"synthetic vocabulary {SYMBOLS!r}"
        ) from None


def decode(ids: Sequence[int]) -> str:
    """Token ids -> text; EOS is shown as ``$`` and ids outside the vocabulary as ``?``."""
    return "".join(
        SYMBOLS[i] if 0 <= i < len(SYMBOLS) else "$" if i == EOS_ID else "?" for i in ids
    )


def _hash32(keys: torch.Tensor) -> torch.Tensor:
    # Knuth's multiplicative hash; keys < 2**31 so the int64 product cannot overflow.
    return (keys * 2654435761) & 0xFFFFFFFF


def is_held_out(keys: torch.Tensor) -> torch.Tensor:
    """Bool mask: which keys belong to the evaluation split (hash in the lowest bucket)."""
    return (_hash32(keys) * HELD_OUT_BUCKETS) >> 32 == 0


def _digits(values: torch.Tensor, width: int) -> torch.Tensor:
    """``[n]`` non-negative ints -> ``[n, width]`` decimal digits, most significant first."""
    powers = 10 ** torch.arange(width - 1, -1, -1, dtype=torch.int64)
    return (values.unsqueeze(1) // powers) % 10


# --- tasks ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SyntheticTask:
    """Fixed-length prompts and answers; ``sequences(keys)`` gives prompt + answer + EOS."""

    name: str
    num_keys: int
    prompt_len: int
    answer_len: int
    """Answer tokens before the EOS."""
    build: Callable[[torch.Tensor], torch.Tensor]
    """``[n] keys -> [n, prompt_len + answer_len]`` token ids (no EOS)."""
    description: str

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.answer_len + 1

    def sequences(self, keys: torch.Tensor) -> torch.Tensor:
        keys = torch.as_tensor(keys, dtype=torch.int64)
        if keys.numel() and (keys.min() < 0 or keys.max() >= self.num_keys):
            raise ValueError(f"task {self.name!r}: keys must lie in [0, {self.num_keys})")
        body = self.build(keys)
        eos = torch.full((keys.shape[0], 1), EOS_ID, dtype=torch.int64)
        return torch.cat([body, eos], dim=1)

    def sample_keys(self, n: int, generator: torch.Generator, split: str) -> torch.Tensor:
        """``n`` keys drawn uniformly (with replacement) from ``split`` ("train"/"test")."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        out, have = [], 0
        while have < n:
            # Fixed-size draws, so the first n keys of a stream do not depend on n.
            keys = torch.randint(0, self.num_keys, (_DRAW,), generator=generator)
            keep = is_held_out(keys) == (split == "test")
            out.append(keys[keep])
            have += int(keep.sum())
        return torch.cat(out)[:n]

    def held_out_keys(self, n: int, seed: int) -> torch.Tensor:
        """``n`` distinct evaluation keys, the same for the same ``seed``; the keys for a
        smaller ``n`` are a prefix of those for a larger one."""
        g = torch.Generator().manual_seed(seed)
        keys = self.sample_keys(2 * n, g, "test")
        unique = list(dict.fromkeys(keys.tolist()))  # in order of first appearance
        if len(unique) < n:
            raise ValueError(f"task {self.name!r}: cannot draw {n} distinct held-out keys")
        return torch.tensor(unique[:n], dtype=torch.int64)

    def split(self, sequences: torch.Tensor) -> tuple[list[list[int]], list[list[int]]]:
        """``[n, seq_len]`` -> (prompts, answers with EOS) as lists of token ids."""
        return (sequences[:, : self.prompt_len].tolist(), sequences[:, self.prompt_len :].tolist())


TASKS: Registry[SyntheticTask] = Registry("synthetic task")


def register_task(task: SyntheticTask) -> SyntheticTask:
    if task.num_keys >= 2**31:
        raise ValueError(f"task {task.name!r}: num_keys must be < 2**31 (hash range)")
    return TASKS.add(task.name, task)


def get_task(name: str) -> SyntheticTask:
    return TASKS.get(name)


def task_names() -> list[str]:
    return TASKS.names()


def _addition(digits: int) -> SyntheticTask:
    base = 10**digits

    def build(keys: torch.Tensor) -> torch.Tensor:
        a, b = keys // base, keys % base
        n = keys.shape[0]
        plus = torch.full((n, 1), PLUS_ID, dtype=torch.int64)
        equals = torch.full((n, 1), EQUALS_ID, dtype=torch.int64)
        return torch.cat(
            [
                _digits(a, digits).flip(1),
                plus,
                _digits(b, digits).flip(1),
                equals,
                _digits(a + b, digits + 1).flip(1),
            ],
            dim=1,
        )

    return SyntheticTask(
        "addition",
        base * base,
        prompt_len=2 * digits + 2,
        answer_len=digits + 1,
        build=build,
        description=f"{digits}-digit a+b = {digits + 1}-digit sum, every "
        f"number zero-padded, least-significant digit first",
    )


def _reversal(length: int) -> SyntheticTask:
    def build(keys: torch.Tensor) -> torch.Tensor:
        d = _digits(keys, length)
        equals = torch.full((keys.shape[0], 1), EQUALS_ID, dtype=torch.int64)
        return torch.cat([d, equals, d.flip(1)], dim=1)

    return SyntheticTask(
        "reversal",
        10**length,
        prompt_len=length + 1,
        answer_len=length,
        build=build,
        description=f"reverse {length} digits",
    )


register_task(_addition(3))
register_task(_reversal(6))


# --- scoring -------------------------------------------------------------------------------


def exact_match(outputs: Sequence[Sequence[int]], answers: Sequence[Sequence[int]]) -> float:
    """Fraction of outputs equal to their answer, EOS included: the model must also stop."""
    if len(outputs) != len(answers):
        raise ValueError(f"exact_match: {len(outputs)} outputs for {len(answers)} answers")
    if not answers:
        raise ValueError("exact_match: nothing to score")
    return sum(list(o) == list(a) for o, a in zip(outputs, answers)) / len(answers)


def token_agreement(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> float:
    """Greedy-token agreement as in ``experiments.run.job``: tokens equal to the reference's up to
    the first divergence, over the longer of each pair."""
    total = same = 0
    for out, ref in zip(outputs, reference, strict=True):
        total += max(len(out), len(ref))
        for a, b in zip(out, ref):
            if a != b:
                break
            same += 1
    return same / total if total else 1.0


# --- evaluation through the framework ---------------------------------------------------------


def read_task_name(model_dir: str | Path) -> str:
    """The task a shipped checkpoint was trained on (``metrics.json``, else the folder name)."""
    metrics = Path(model_dir) / "metrics.json"
    if metrics.is_file():
        return json.loads(metrics.read_text())["task"]
    return Path(model_dir).name


@dataclass
class GenerationRun:
    outputs: list[list[int]]
    """Greedy new tokens per prompt (ending with EOS when the model stopped)."""
    first_token_logits: torch.Tensor
    """``[n, vocab]`` float32 logits that chose each prompt's first new token."""
    quantized_layers: int
    """Linear layers the quantization config rewrote (0 unquantized): proof it applied."""


def generate(
    model_dir: str | Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    quantization: Any = None,
    optimization_level: int = 0,
    **llm_kwargs: Any,
) -> GenerationRun:
    """Greedy outputs of ``framework.LLM`` for ``prompts`` (one batched ``generate``)."""
    from framework.engine.llm import LLM

    llm_kwargs.setdefault("max_num_seqs", 64)
    llm_kwargs.setdefault("max_model_len", 64)
    llm = LLM(
        str(model_dir),
        dtype="float32",
        optimization_level=optimization_level,
        quantization=quantization,
        **llm_kwargs,
    )
    from framework.engine.observers import FirstTokenLogits

    with FirstTokenLogits.attached(llm) as first:
        outputs = llm.generate(prompts, max_new_tokens=max_new_tokens)
    return GenerationRun(
        outputs,
        torch.stack(first.take()),
        len(getattr(llm, "quantized_layers", None) or {}),
    )


def evaluate(
    model_dir: str | Path,
    quantization: Any = None,
    optimization_level: int = 0,
    n: int = 200,
    seed: int = 1234,
    task: Optional[str] = None,
    reference: Optional[dict[str, Any]] = None,
    **llm_kwargs: Any,
) -> dict[str, Any]:
    """Exact match of ``LLM(model_dir, quantization=..., optimization_level=...)`` on ``n``
    held-out prompts, and its greedy-token agreement with the unquantized O0 model.

    ``task``: default from the folder's ``metrics.json``.  ``reference``: an earlier result of
    this function for the unquantized O0 model with the same ``n``/``seed``, so a sweep runs
    the reference once; computed when needed and not given.  ``llm_kwargs`` go to ``LLM``.

    Returns ``{"task", "n", "seed", "exact_match", "correct", "quantization",
    "optimization_level", "quantized_layers", "token_agreement_vs": {"unquantized_O0": float},
    "max_logit_diff_vs": {"unquantized_O0": float}`` (first new token), ``"outputs",
    "first_token_logits", "examples", "seconds"}``.
    """
    t = get_task(task or read_task_name(model_dir))
    prompts, answers = t.split(t.sequences(t.held_out_keys(n, seed)))
    t0 = time.perf_counter()
    run = generate(
        model_dir, prompts, t.answer_len + 1, quantization, optimization_level, **llm_kwargs
    )
    seconds = time.perf_counter() - t0
    if quantization is None and optimization_level == 0:
        ref_outputs, ref_logits = run.outputs, run.first_token_logits
    elif reference is not None:
        if reference["n"] != n or reference["seed"] != seed or reference["task"] != t.name:
            raise ValueError("evaluate: reference was computed for another task, n or seed")
        ref_outputs, ref_logits = reference["outputs"], reference["first_token_logits"]
    else:
        ref = generate(model_dir, prompts, t.answer_len + 1, None, 0, **llm_kwargs)
        ref_outputs, ref_logits = ref.outputs, ref.first_token_logits
    em = exact_match(run.outputs, answers)
    return {
        "task": t.name,
        "n": n,
        "seed": seed,
        "exact_match": em,
        "correct": round(em * n),
        "quantization": quantization,
        "optimization_level": optimization_level,
        "quantized_layers": run.quantized_layers,
        "token_agreement_vs": {"unquantized_O0": token_agreement(run.outputs, ref_outputs)},
        "max_logit_diff_vs": {
            "unquantized_O0": float((run.first_token_logits - ref_logits).abs().max())
        },
        "outputs": run.outputs,
        "first_token_logits": run.first_token_logits,
        "examples": [
            f"{decode(p)}{decode(o)}  (want {decode(a)})"
            for p, o, a in list(zip(prompts, run.outputs, answers))[:3]
        ],
        "seconds": seconds,
    }


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.synthetic.task",
        description="Exact-match accuracy of a synthetic-task checkpoint through framework.LLM",
    )
    p.add_argument("model_dir", help="e.g. models/synthetic/addition")
    p.add_argument(
        "--quantization",
        default=None,
        help="a shorthand such as int8_per_token or int8_per_channel_weight_only",
    )
    p.add_argument("-O", "--optimization-level", type=int, default=0)
    p.add_argument("-n", type=int, default=200, help="held-out prompts (default 200)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    res = evaluate(args.model_dir, args.quantization, args.optimization_level, args.n, args.seed)
    if args.json:
        print(
            json.dumps({k: v for k, v in res.items() if k not in ("outputs", "first_token_logits")})
        )
        return 0
    agree = res["token_agreement_vs"]["unquantized_O0"]
    print(
        f"task {res['task']}  n={res['n']}  quantization={res['quantization']}  "
        f"O{res['optimization_level']}"
    )
    print(
        f"exact match: {res['exact_match']:.3f} ({res['correct']}/{res['n']})  "
        f"quantized layers: {res['quantized_layers']}  ({res['seconds']:.1f} s)"
    )
    print(
        f"vs unquantized O0: token agreement {agree:.4f}, max first-token logit diff "
        f"{res['max_logit_diff_vs']['unquantized_O0']:.4g}"
    )
    for line in res["examples"]:
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
