"""The OpenAI-compatible HTTP application (FastAPI) over an :class:`EngineLoop`.

Endpoints: ``GET /health`` (never needs a key), ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (streamed as server-sent events in the OpenAI chunk format,
ending with ``data: [DONE]``), ``GET /metrics`` (Prometheus text). Every error is an
OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from framework.engine.outputs import RequestOutput
from framework.engine.tokenizer import encode_prompt
from framework.serve.detokenize import IncrementalDetokenizer
from framework.serve.engine_loop import EngineLoop, Failure, Stream
from framework.serve.protocol import APIError, ParsedRequest, bad, parse_chat, parse_completion

logger = logging.getLogger(__name__)

API_KEY_ENV = "PIECEWISE_API_KEY"


@dataclass(frozen=True)
class ServerConfig:
    """What the HTTP layer enforces (the engine's own limits come from the LLM)."""

    model_name: str
    max_model_len: int
    api_key: Optional[str] = None
    """Bearer key required on every endpoint but /health (None: open)."""
    max_waiting: int = 256
    """Requests with no token yet beyond which new ones are refused (``overload_status``)."""
    overload_status: int = 429
    """429 (Too Many Requests) or 503 (Service Unavailable); both carry Retry-After."""
    retry_after_s: int = 1
    max_body_bytes: int = 1 << 20
    """Request bodies above this get a 413 (checked while reading, not after)."""
    max_prompt_tokens: Optional[int] = None
    """Prompts above this many tokens get a 400 (None: max_model_len - 1)."""

    def __post_init__(self):
        for name in ("max_model_len", "max_waiting", "retry_after_s", "max_body_bytes"):
            v, low = getattr(self, name), 0 if name == "max_waiting" else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"ServerConfig.{name}: must be an int >= {low}, got {v!r}")
        if self.overload_status not in (429, 503):
            raise ValueError(
                f"ServerConfig.overload_status: must be 429 or 503, got {self.overload_status!r}"
            )
        if self.api_key is not None and not (isinstance(self.api_key, str) and self.api_key):
            raise ValueError("ServerConfig.api_key: must be a non-empty string or None")
        mpt = self.max_prompt_tokens
        if mpt is not None and (isinstance(mpt, bool) or not isinstance(mpt, int) or mpt < 1):
            raise ValueError(f"ServerConfig.max_prompt_tokens: must be a positive int, got {mpt!r}")

    @property
    def prompt_limit(self) -> int:
        return self.max_prompt_tokens or max(1, self.max_model_len - 1)


class _Gone(Exception):
    """The client disconnected before its response started."""


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class BearerAuth:
    """ASGI middleware: ``Authorization: Bearer <key>`` on every path but /health; a missing
    or wrong key is answered with 401 before anything runs."""

    def __init__(self, app: Any, api_key: Optional[str]):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if self.expected is None or scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        got = b""
        for k, v in scope.get("headers") or ():
            if k == b"authorization":
                got = v
                break
        if not hmac.compare_digest(got, self.expected):
            msg = "missing API key" if not got else "invalid API key"
            err = APIError(
                401,
                f"{msg}: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            return await _error_response(err)(scope, receive, send)
        return await self.app(scope, receive, send)


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON; 413 beyond ``limit`` bytes (by Content-Length or while reading)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body of {int(length)} bytes exceeds the {limit}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the {limit}-byte limit")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None


class OpenAIServer:
    """The routes; holds the loop, the tokenizer (its own instance: the engine thread's
    stays the engine's) and the config."""

    def __init__(self, loop: EngineLoop, tokenizer: Any, config: ServerConfig):
        self.loop = loop
        self.tokenizer = tokenizer
        self.config = config
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}

    # ------------------------------------------------------------------ app
    def build(self) -> Any:
        app = FastAPI(title="piecewise", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(APIError)
        async def _api_error(request: Request, e: APIError):
            return _error_response(e)

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request: Request, e: StarletteHTTPException):
            code = "not_found" if e.status_code == 404 else None
            msg = f"{request.method} {request.url.path}: {e.detail}"
            return _error_response(APIError(e.status_code, msg, code=code))

        @app.exception_handler(Exception)
        async def _internal(request: Request, e: Exception):
            logger.exception("unhandled error in %s", request.url.path)
            return _error_response(APIError(500, f"internal error: {type(e).__name__}: {e}"))

        @app.get("/health")
        async def health():
            if not self.loop.alive:
                raise APIError(503, "the engine loop is not running")
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [self._model_card()]}

        @app.get("/v1/models/{name:path}")
        async def model(name: str):
            if name != self.config.model_name:
                raise self._unknown_model(name)
            return self._model_card()

        @app.get("/metrics")
        async def metrics():
            if not self.loop.alive:
                raise APIError(503, "the engine loop is not running")
            engine = await self.loop.engine_stats()
            text = self.loop.metrics.render(
                self.loop.num_running, self.loop.num_waiting, engine, self.config.model_name
            )
            return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._handle(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await self._handle(request, chat=True)

        return BearerAuth(app, self.config.api_key)

    def _model_card(self) -> dict:
        return {
            "id": self.config.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "piecewise",
            "max_model_len": self.config.max_model_len,
        }

    def _unknown_model(self, name: Any) -> APIError:
        return APIError(
            404,
            f"model {name!r} does not exist; this server serves {self.config.model_name!r}",
            param="model",
            code="model_not_found",
        )

    # ------------------------------------------------------------------ requests
    def _prompt_ids(self, req: ParsedRequest, chat: bool) -> list[int]:
        tok = self.tokenizer
        if chat:
            if tok is None or not getattr(tok, "chat_template", None):
                raise bad("messages", "this model folder has no tokenizer with a chat template")
            ids = tok.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            ids, name = list(ids), "messages"
        elif req.prompt_text is not None:
            if tok is None:
                raise bad("prompt", "this model folder has no tokenizer: send token ids")
            ids, name = encode_prompt(tok, req.prompt_text), "prompt"
        else:
            ids, name = list(req.prompt_ids), "prompt"
        if not ids:
            raise bad(name, "encodes to no tokens")
        limit = self.config.prompt_limit
        if len(ids) > limit:
            raise bad(name, f"is {len(ids)} tokens; the limit is {limit}")
        return ids

    async def _handle(self, request: Request, chat: bool) -> Response:
        cfg = self.config
        body = await read_json(request, cfg.max_body_bytes)
        req = parse_chat(body) if chat else parse_completion(body)
        model = body.get("model")
        if model is None:
            raise bad("model", "is required")
        if model != cfg.model_name:
            raise self._unknown_model(model)
        if req.stop and self.tokenizer is None:
            raise bad("stop", "stop strings need a tokenizer; this model folder has none")
        ids = self._prompt_ids(req, chat)
        params = req.params
        if not req.max_tokens_given and chat:
            params = params.replace(max_tokens=max(1, cfg.max_model_len - len(ids)))
        if len(ids) + params.max_tokens > cfg.max_model_len:
            raise bad(
                "max_tokens",
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's max_model_len ({cfg.max_model_len})",
            )
        if self.loop.num_waiting >= cfg.max_waiting:
            self.loop.metrics.reject(cfg.overload_status)
            raise APIError(
                cfg.overload_status,
                f"server overloaded: {self.loop.num_waiting} requests waiting "
                f"(limit {cfg.max_waiting}); retry after {cfg.retry_after_s} s",
                code="overloaded",
                headers={"Retry-After": str(cfg.retry_after_s)},
            )
        s = self.loop.submit(ids, params)
        job = _Job(self, req, s, ids, chat)
        watcher = asyncio.ensure_future(_watch_disconnect(request, self.loop, s))
        streaming = False
        try:
            first = await _next(s, chat)
            if not req.stream:
                item = first
                while True:
                    job.absorb(item)
                    if job.finish_reason is not None:
                        break
                    item = await _next(s, chat)
                return JSONResponse(job.response())
            streaming = True
        except _Gone:
            return Response(status_code=499)
        finally:
            watcher.cancel()
            if not streaming:  # whatever ended the handler, the request must not linger
                self.loop.abort(s, "client")
        return _SSEResponse(job.events(first), media_type="text/event-stream")

    def token_text(self, tok: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{tok}"
        t = self._token_text.get(tok)
        if t is None:
            t = self._token_text[tok] = self.tokenizer.decode([tok])
        return t


def _by_text(top: list[tuple[int, float]], text) -> dict[str, float]:
    """Completions' top_logprobs are keyed by token text: two ids with the same text keep
    the higher log-probability."""
    out: dict[str, float] = {}
    for tok, v in top:
        out.setdefault(text(tok), v)
    return out


class _GoneMarker:
    pass


GONE = _GoneMarker()


async def _next(s: Stream, chat: bool) -> RequestOutput:
    """The request's next output; a failure raises its APIError, a disconnect ``_Gone``."""
    item = await s.queue.get()
    if isinstance(item, _GoneMarker):
        raise _Gone()
    if isinstance(item, Failure):
        param = None
        if item.status == 400:
            param = (
                "max_tokens"
                if "max_new_tokens" in item.message
                else ("messages" if chat else "prompt")
            )
        raise APIError(item.status, item.message, param=param)
    return item


async def _watch_disconnect(request: Request, loop: EngineLoop, s: Stream) -> None:
    """Until cancelled: when the client disconnects, abort its request and wake its
    handler (the body has been read, so the only message left is the disconnect)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            loop.abort(s, "client")
            s.queue.put_nowait(GONE)
            return


class _SSEResponse(StreamingResponse):
    """Closes its event generator whichever way the response ends (the generator's
    ``finally`` aborts an unfinished request)."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class _Job:
    """One request's progress: text so far (through the incremental detokenizer), tokens,
    logprobs, and the OpenAI objects built from them."""

    def __init__(self, server: OpenAIServer, req: ParsedRequest, s: Stream, ids, chat: bool):
        self.server = server
        self.req = req
        self.s = s
        self.prompt_ids = ids
        self.chat = chat
        self.detok = IncrementalDetokenizer(server.tokenizer, req.stop)
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []
        self.finish_reason: Optional[str] = None
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    @property
    def stopped(self) -> bool:
        return self.detok.stopped is not None

    def absorb(self, out: RequestOutput) -> tuple[str, list[int], list[dict[int, float]]]:
        """Take a new output; returns the new text, token ids and logprobs to send."""
        if self.finish_reason is not None:
            return "", [], []
        delta = self.detok.push(out.token_ids, out.finished)
        n = self.detok.num_tokens
        new_ids = list(out.token_ids[len(self.token_ids) : n])
        self.token_ids.extend(new_ids)
        new_lps: list[dict[int, float]] = []
        if self.req.logprobs is not None and out.logprobs is not None:
            new_lps = list(out.logprobs[len(self.logprobs) : n])
            self.logprobs.extend(new_lps)
        if self.stopped:
            self.finish_reason = "stop"
            self.server.loop.abort(self.s, "stop")
        elif out.finished:
            self.finish_reason = "length" if out.finish_reason == "length" else "stop"
        return delta, new_ids, new_lps

    def usage(self) -> dict[str, int]:
        n = len(self.token_ids)
        p = len(self.prompt_ids)
        return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}

    # ------------------------------------------------------------------ logprobs
    def _top(self, lp: dict[int, float]) -> list[tuple[int, float]]:
        k = self.req.logprobs or 0
        return sorted(lp.items(), key=lambda kv: -kv[1])[:k]

    def _logprobs(self, ids: list[int], lps: list[dict[int, float]], offset: int) -> Any:
        if self.req.logprobs is None:
            return None
        text = self.server.token_text
        if self.chat:

            def entry(t: int, v: float) -> dict:
                s = text(t)
                return {"token": s, "logprob": v, "bytes": list(s.encode())}

            return {
                "content": [
                    {
                        **entry(t, lp.get(t, float("-inf"))),
                        "top_logprobs": [entry(a, v) for a, v in self._top(lp)],
                    }
                    for t, lp in zip(ids, lps)
                ]
            }
        tokens = [text(t) for t in ids]
        offsets, pos = [], offset
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.get(t, float("-inf")) for t, lp in zip(ids, lps)],
            "top_logprobs": [_by_text(self._top(lp), text) for lp in lps],
            "text_offset": offsets,
        }

    # ------------------------------------------------------------------ bodies
    def response(self) -> dict:
        text = self.detok.text
        lp = self._logprobs(self.token_ids, self.logprobs, 0)
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": lp,
                "finish_reason": self.finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": self.finish_reason}
        body = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.server.config.model_name,
            "choices": [choice],
            "usage": self.usage(),
        }
        if self.req.return_token_ids:
            choice["token_ids"] = list(self.token_ids)
            body["prompt_token_ids"] = list(self.prompt_ids)
        return body

    def _chunk(self, choices: list[dict], usage: Optional[dict] = None) -> str:
        body = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.server.config.model_name,
            "choices": choices,
        }
        if self.req.include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    def _choice(self, delta: str, ids: list[int], lps: list, offset: int, first: bool) -> dict:
        lp = self._logprobs(ids, lps, offset)
        if self.chat:
            d: dict[str, Any] = (
                {"role": "assistant", "content": delta} if first else {"content": delta}
            )
            choice = {"index": 0, "delta": d, "logprobs": lp, "finish_reason": self.finish_reason}
        else:
            choice = {
                "index": 0,
                "text": delta,
                "logprobs": lp,
                "finish_reason": self.finish_reason,
            }
        if self.req.return_token_ids:
            choice["token_ids"] = ids
        return choice

    async def events(self, first: RequestOutput) -> AsyncIterator[str]:
        """The SSE stream: one chunk per engine output, the usage chunk, ``[DONE]``."""
        s = self.s
        try:
            item: Any = first
            sent_first = False
            while True:
                if isinstance(item, _GoneMarker):
                    return
                if isinstance(item, Failure):
                    yield f"data: {json.dumps(APIError(item.status, item.message).body())}\n\n"
                    break
                offset = len(self.detok.text)
                delta, ids, lps = self.absorb(item)
                if delta or ids or self.finish_reason is not None or not sent_first:
                    yield self._chunk([self._choice(delta, ids, lps, offset, not sent_first)])
                    sent_first = True
                if self.finish_reason is not None:
                    if self.req.include_usage:
                        yield self._chunk([], self.usage())
                    break
                item = await s.queue.get()
            yield "data: [DONE]\n\n"
        finally:
            if self.finish_reason is None:
                self.server.loop.abort(s, "client")
