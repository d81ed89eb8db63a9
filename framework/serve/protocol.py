"""OpenAI request bodies → engine requests, and OpenAI-style errors naming the field.

Only what the engine can do is accepted; anything else is a 400 that names the parameter
(``n`` > 1, ``echo``, ``best_of``, ``logit_bias``, ``suffix``, tools, non-text response
formats). Extensions (``extra_body`` in the openai client): ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``return_token_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from framework.engine.sampling_params import SamplingParams

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: Optional[str] = None,
        type_: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or _ERROR_TYPES.get(status, "invalid_request_error")
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


_ERROR_TYPES = {
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


def bad(param: str, need: str, got: Any = ...) -> APIError:
    msg = f"{param}: {need}" + ("" if got is ... else f", got {got!r}")
    return APIError(400, msg, param=param)


@dataclass
class ParsedRequest:
    """What a handler submits: the prompt (text or ids), the sampling params and the
    server-side options (stop strings, streaming, logprobs, usage)."""

    prompt_text: Optional[str]
    prompt_ids: Optional[list[int]]
    messages: Optional[list[dict[str, str]]]
    params: SamplingParams
    max_tokens_given: bool
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: Optional[int] = None
    """Completions: top-N per token. Chat: top_logprobs (0 when logprobs=true alone)."""
    return_token_ids: bool = False


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _Body:
    def __init__(self, body: Any):
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        self.body = body

    def get(self, name: str, default: Any = None) -> Any:
        v = self.body.get(name, default)
        return default if v is None else v

    def number(self, name: str, default: float, lo: float, hi: float) -> float:
        v = self.get(name, default)
        if not _is_number(v) or not lo <= v <= hi:
            raise bad(name, f"must be a number in [{lo}, {hi}]", v)
        return float(v)

    def integer(self, name: str, default: Optional[int], lo: int, hi: int) -> Optional[int]:
        v = self.get(name, default)
        if v is None:
            return None
        if not _is_int(v) or not lo <= v <= hi:
            raise bad(name, f"must be an integer in [{lo}, {hi}]", v)
        return v

    def boolean(self, name: str, default: bool = False) -> bool:
        v = self.get(name, default)
        if not isinstance(v, bool):
            raise bad(name, "must be a boolean", v)
        return v


def _unsupported(b: _Body) -> None:
    n = b.get("n", 1)
    if n != 1:
        raise bad("n", "only n=1 is supported", n)
    best_of = b.get("best_of", 1)
    if best_of != 1:
        raise bad("best_of", "only best_of=1 is supported", best_of)
    if b.get("logit_bias"):
        raise bad("logit_bias", "is not supported")


def _stop(b: _Body) -> list[str]:
    stop = b.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", "must be a non-empty string or a list of them", stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings", len(stop))
    return stop


def _sampling(b: _Body, max_tokens: int, logprobs: Optional[int]) -> SamplingParams:
    stop_ids = b.get("stop_token_ids", [])
    if not isinstance(stop_ids, list) or not all(_is_int(t) and t >= 0 for t in stop_ids):
        raise bad("stop_token_ids", "must be a list of non-negative integers", stop_ids)
    top_k = b.get("top_k", 0)
    if not _is_int(top_k) or top_k < -1:
        raise bad("top_k", "must be an integer, -1 or 0 (off) or >= 1", top_k)
    seed = b.get("seed")
    if seed is not None and not _is_int(seed):
        raise bad("seed", "must be an integer", seed)
    try:
        return SamplingParams(
            temperature=b.number("temperature", 1.0, 0.0, 2.0),
            top_p=b.number("top_p", 1.0, 0.0, 1.0) or 1e-9,
            top_k=top_k,
            min_p=b.number("min_p", 0.0, 0.0, 1.0),
            repetition_penalty=b.number("repetition_penalty", 1.0, 1e-6, 10.0),
            presence_penalty=b.number("presence_penalty", 0.0, -2.0, 2.0),
            frequency_penalty=b.number("frequency_penalty", 0.0, -2.0, 2.0),
            seed=seed,
            stop_token_ids=tuple(stop_ids),
            max_tokens=max_tokens,
            ignore_eos=b.boolean("ignore_eos"),
            logprobs=logprobs,
        )
    except ValueError as e:  # SamplingParams names its field: "SamplingParams.x: ..."
        msg = str(e)
        name = msg.split(":")[0].rsplit(".", 1)[-1]
        raise APIError(400, msg, param=name) from None


def _stream_options(b: _Body, stream: bool) -> bool:
    opts = b.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise bad("stream_options", "is only allowed when stream is true")
    if not isinstance(opts, dict):
        raise bad("stream_options", "must be an object", opts)
    usage = opts.get("include_usage", False)
    if not isinstance(usage, bool):
        raise bad("stream_options.include_usage", "must be a boolean", usage)
    return usage


def _max_tokens(b: _Body, names: tuple[str, ...], default: Optional[int]) -> tuple[int, bool]:
    for name in names:
        v = b.get(name)
        if v is not None:
            if not _is_int(v) or v < 1:
                raise bad(name, "must be a positive integer", v)
            return v, True
    return default or 1, False


def parse_completion(body: Any) -> ParsedRequest:
    b = _Body(body)
    prompt = b.get("prompt")
    text, ids = None, None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt", "must not be empty")
        text = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise bad("prompt", "one prompt per request is supported (a string or a list of ids)")
    else:
        raise bad("prompt", "must be a non-empty string or list of token ids", prompt)
    if b.boolean("echo"):
        raise bad("echo", "is not supported")
    if b.get("suffix"):
        raise bad("suffix", "is not supported")
    _unsupported(b)
    max_tokens, given = _max_tokens(b, ("max_tokens",), 16)
    logprobs = b.integer("logprobs", None, 0, MAX_LOGPROBS)
    stream = b.boolean("stream")
    return ParsedRequest(
        prompt_text=text,
        prompt_ids=ids,
        messages=None,
        params=_sampling(b, max_tokens, logprobs),
        max_tokens_given=given,
        stop=_stop(b),
        stream=stream,
        include_usage=_stream_options(b, stream),
        logprobs=logprobs,
        return_token_ids=b.boolean("return_token_ids"),
    )


def _content(m: dict, i: int) -> str:
    c = m.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # content parts: text only
        out = []
        for j, part in enumerate(c):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad(f"messages[{i}].content[{j}]", "only text content parts are supported")
            t = part.get("text")
            if not isinstance(t, str):
                raise bad(f"messages[{i}].content[{j}].text", "must be a string", t)
            out.append(t)
        return "".join(out)
    raise bad(f"messages[{i}].content", "must be a string or a list of text parts", c)


def parse_chat(body: Any) -> ParsedRequest:
    b = _Body(body)
    messages = b.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of {role, content}", messages)
    msgs = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "must be an object with role and content", m)
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise bad(f"messages[{i}].role", "must be system, developer, user or assistant", role)
        msgs.append({"role": role, "content": _content(m, i)})
    for name in ("tools", "functions"):
        if b.get(name):
            raise bad(name, "tool calling is not supported")
    fmt = b.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad("response_format", 'only {"type": "text"} is supported', fmt)
    _unsupported(b)
    max_tokens, given = _max_tokens(b, ("max_completion_tokens", "max_tokens"), None)
    want = b.boolean("logprobs")
    top = b.integer("top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not want:
        raise bad("top_logprobs", "needs logprobs=true")
    stream = b.boolean("stream")
    logprobs = (top or 0) if want else None
    return ParsedRequest(
        prompt_text=None,
        prompt_ids=None,
        messages=msgs,
        params=_sampling(b, max_tokens, logprobs),
        max_tokens_given=given,
        stop=_stop(b),
        stream=stream,
        include_usage=_stream_options(b, stream),
        logprobs=logprobs,
        return_token_ids=b.boolean("return_token_ids"),
    )
