"""Per-request sampling parameters, validated at construction (one ``ValueError`` naming the
field; every float must be finite) and against the model when a request is added
(:meth:`SamplingParams.check_for_model`: ``logprobs`` within the vocabulary).
``temperature=0`` (the default) is greedy decoding."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Optional


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    """A finite int or float (NaN and infinities are refused, not compared)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


SEED_RANGE = (-(2**63), 2**63)
"""Seeds are 64-bit signed ints (the sampler's noise key): ``SEED_RANGE[0] <= seed <
SEED_RANGE[1]``."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    """0: greedy (argmax).  > 0: sample from softmax(logits / temperature)."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1: all.  A k larger than the model's vocabulary
    keeps every token (clamped to the vocabulary size)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p (0 < top_p <= 1)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's (0 <= min_p <= 1)."""
    repetition_penalty: float = 1.0
    """transformers' rule over prompt and output tokens: logit / p if > 0 else logit * p."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence from the logit of every token already generated."""
    seed: Optional[int] = None
    """Same seed, same tokens, whatever else is in the batch (None: drawn from the engine)."""
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    max_tokens: int = 16
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    """Return the top-N log-probabilities (of the model's distribution) per new token
    (N at most the vocabulary size: checked when the request is added)."""

    def __post_init__(self):
        def bad(name, need):
            raise ValueError(f"SamplingParams.{name}: {need}, got {getattr(self, name)!r}")

        if not _is_number(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a finite number >= 0")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "must be an int, -1 or 0 (off) or >= 1")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be a number in (0, 1]")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be a number in [0, 1]")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be a finite number > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2 <= v <= 2:
                bad(name, "must be a number in [-2, 2]")
        if self.seed is not None and (
            not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]
        ):
            bad("seed", "must be None or an int in [-2**63, 2**63)")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be a positive int")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "must be a bool")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            bad("logprobs", "must be None or an int >= 0")
        stop = self.stop_token_ids
        if (
            isinstance(stop, (str, bytes))
            or not hasattr(stop, "__iter__")
            or not all(_is_int(t) and t >= 0 for t in stop)
        ):
            bad("stop_token_ids", "must be a sequence of non-negative ints")
        object.__setattr__(self, "stop_token_ids", tuple(stop))

    def check_for_model(self, vocab_size: int, name: str) -> None:
        """Refuse (``ValueError`` naming ``name``, e.g. "request 3", and the field) what the
        model cannot honour: ``logprobs`` beyond the vocabulary, stop tokens outside it."""
        if self.logprobs is not None and self.logprobs > vocab_size:
            raise ValueError(
                f"{name}: SamplingParams.logprobs={self.logprobs} exceeds the model's "
                f"vocabulary ({vocab_size} tokens)"
            )
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise ValueError(
                    f"{name}: SamplingParams.stop_token_ids has {t}, outside the model's "
                    f"vocabulary (0..{vocab_size - 1})"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def replace(self, **changes) -> "SamplingParams":
        return replace(self, **changes)


def params_per_prompt(
    sp, n: int, max_new_tokens: Optional[int], ignore_eos: bool
) -> list[SamplingParams]:
    """``generate``'s sampling params per prompt: one for all or one each (greedy with 16 new
    tokens when None); ``max_new_tokens`` / ``ignore_eos``, when given, override them."""
    changes: dict[str, Any] = {}
    if max_new_tokens is not None:
        changes["max_tokens"] = max_new_tokens
    if ignore_eos:
        changes["ignore_eos"] = True
    if sp is None:  # one greedy SamplingParams for every prompt (frozen: shared)
        return [SamplingParams(**{"max_tokens": 16, **changes})] * n
    if isinstance(sp, SamplingParams):
        return [sp.replace(**changes) if changes else sp] * n
    sps = list(sp)
    if len(sps) != n or not all(isinstance(p, SamplingParams) for p in sps):
        raise ValueError(f"sampling_params: one SamplingParams or a list of {n} (one per prompt)")
    return [p.replace(**changes) if changes else p for p in sps]
