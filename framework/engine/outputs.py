"""What the engine hands back per request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from framework.engine.request import Request
from framework.engine.tokenizer import decode


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    """New tokens so far (all of them when ``finished``)."""
    text: Optional[str] = None
    """The new tokens decoded, when the model folder has a tokenizer."""
    logprobs: Optional[list[dict[int, float]]] = None
    """Per new token: {token id: log-probability} for the top-N tokens and the chosen one."""
    finish_reason: Optional[str] = None
    """None while running; "stop" (EOS or a stop token), "length" (max_tokens), "abort", or
    "error" (the request failed alone in a step: see ``error``)."""
    prompt: Optional[str] = None
    stats: dict = field(default_factory=dict)
    error: Optional[str] = None
    """With ``finish_reason`` "error": what failed, naming the request and the cause."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def output_of(req: Request, tokenizer: Any) -> RequestOutput:
    """A snapshot of ``req`` (copies of its lists); ``text`` when there is a tokenizer."""
    return RequestOutput(
        req.req_id,
        list(req.prompt),
        list(req.output),
        decode(tokenizer, req.output) if tokenizer is not None else None,
        list(req.logprobs) if req.logprobs is not None else None,
        req.finish_reason,
        req.text_prompt,
        {"preemptions": req.num_preemptions},
        req.error,
    )
