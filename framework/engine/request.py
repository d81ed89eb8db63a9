"""A request's state in the engine, and one scheduled chunk of it."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Optional

from framework.engine.sampling_params import SamplingParams


@dataclass
class Request:
    req_id: int
    prompt: list[int]
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    output: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    """Tokens whose K/V are in the cache (reset to 0 when preempted: recomputed later)."""
    finished: bool = False
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    """Key of the request's sampling noise (the params' seed, or one drawn by the engine)."""
    finish_reason: Optional[str] = None
    logprobs: Optional[list[dict[int, float]]] = None
    block_hashes: list[bytes] = field(default_factory=list)
    """Hash chain of the request's full blocks (prefix caching), one per full block."""
    num_cached_blocks: int = 0
    """Leading entries of ``block_ids`` registered in (or taken from) the prefix cache."""
    num_preemptions: int = 0
    text_prompt: Optional[str] = None
    num_emitted: int = 0
    """New tokens already returned by an incremental step output."""
    error: Optional[str] = None
    """Why the request failed alone inside a step (``finish_reason`` "error")."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def token_at(self, i: int) -> int:
        p = len(self.prompt)
        return self.prompt[i] if i < p else self.output[i - p]

    def all_tokens(self) -> list[int]:
        return self.prompt + self.output

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens ``start:end`` of prompt + output, without building the whole list."""
        p = len(self.prompt)
        if end <= p:
            return self.prompt[start:end]
        if start >= p:
            return self.output[start - p : end - p]
        return self.prompt[start:] + self.output[: end - p]

    def append(self, token: int) -> None:
        self.output.append(token)
        if token in self.eos_token_ids or token in self.params.stop_token_ids:
            self.finish("stop")
        elif len(self.output) >= self.max_new_tokens:
            self.finish("length")

    def finish(self, reason: str) -> None:
        self.finished = True
        self.finish_reason = reason

    def fail(self, message: str) -> None:
        """End this request alone with ``finish_reason`` "error" and ``message`` (naming the
        request); the other requests of the step go on."""
        self.error = f"request {self.req_id}: {message}"
        self.finish("error")


@dataclass
class ScheduledChunk:
    req: Request
    start: int
    """First position of the chunk (== req.num_computed when scheduled)."""
    num_tokens: int
    """Query tokens, the draft tokens included."""
    spec: tuple[int, ...] = ()
    """Draft tokens verified in this chunk (speculative decoding): they follow the
    request's known tokens, at positions ``req.num_tokens ...``, and are the chunk's last
    ``len(spec)`` query tokens."""
    draft_probs: Any = None
    """The ``[len(spec), vocab]`` probabilities the drafts were sampled from, or None
    (deterministic drafts: one-hot)."""

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """The chunk reaches the last known token, so its logits give the next token."""
        return self.end - len(self.spec) == self.req.num_tokens

    @property
    def is_decode(self) -> bool:
        """THE definition of a decode chunk: one new token after a non-empty context (a
        one-token prompt is a prefill). Step kinds and the trace's counts derive from it."""
        return self.num_tokens - len(self.spec) == 1 and self.start > 0


def step_kind(chunks: list[ScheduledChunk]) -> str:
    """``"decode"`` (every chunk decodes), ``"verify"`` (every chunk decodes and some verify
    draft tokens), ``"prefill"`` (every chunk starts a prompt), or ``"mixed"``: the key of
    ``ModelRunner.step_times``."""
    if all(c.is_decode for c in chunks):
        return "verify" if any(c.spec for c in chunks) else "decode"
    if all(c.start == 0 for c in chunks):
        return "prefill"
    return "mixed"


def single_token_batch(chunks: list[ScheduledChunk]) -> bool:
    """Every chunk has query length 1: the batch is *uniform* for the CUDA-graph dispatcher
    (decode chunks, and one-token prompts, which a decode graph runs just as well). Not
    the same as "decode": see :attr:`ScheduledChunk.is_decode`."""
    return all(c.num_tokens == 1 for c in chunks)


def uniform_batch(chunks: list[ScheduledChunk], query_len: int) -> bool:
    """Every chunk has ``query_len`` query tokens: the batch is uniform for a dispatcher whose
    uniform query length is ``query_len`` (1; or 1 + k with speculative decoding, where a
    verify chunk holds the last token and k drafts)."""
    return all(c.num_tokens == query_len for c in chunks)


def validate_token_ids(prompt, vocab_size: int, name: str = "prompt") -> list[int]:
    """A prompt of token ids as a list of ints, or one ``ValueError`` naming the bad entry
    (bools and floats are rejected, not truncated)."""
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, (list, tuple)):
        raise TypeError(f"{name}: expected a list of token ids, got {type(prompt).__name__}")
    out = []
    for j, t in enumerate(prompt):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):  # numpy ints pass
            raise ValueError(f"{name}[{j}]: token ids must be ints, got {t!r} ({type(t).__name__})")
        t = int(t)
        if not 0 <= t < vocab_size:
            raise ValueError(
                f"{name}[{j}]: token id {t} is outside the vocabulary (0..{vocab_size - 1})"
            )
        out.append(int(t))
    return out


def validate_max_tokens(value, name: str = "max_new_tokens") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: must be a positive int, got {value!r}")
    return value
