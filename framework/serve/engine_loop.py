"""One thread owns the ``LLM`` and steps it while work exists.

Handlers never touch the engine: they :meth:`EngineLoop.submit` a request and read their own
:class:`Stream` (an asyncio queue the engine thread fills, one hand-off per step per event
loop), and :meth:`EngineLoop.abort` it when the client goes away or a stop string matched.
Commands (add, abort, stats snapshot) run on the engine thread between steps, in order, so
an abort frees the request's KV blocks before the next step.

An engine has exactly one loop: a second loop stepping the same ``LLM`` would take the
first one's outputs.

Failures: ``ValueError``/``TypeError`` from ``add_request`` (a request that can never fit, a
bad token id) fail that request alone as a 400. An output whose ``finish_reason`` is
``"error"`` fails its request alone as a 500. A step that raises fails the requests in
flight as 500s (they are aborted, freeing their blocks) and the loop keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence

from framework.engine.outputs import RequestOutput
from framework.engine.sampling_params import SamplingParams
from framework.serve.metrics import ServingMetrics

logger = logging.getLogger(__name__)


class EngineProtocol(Protocol):
    """What the loop uses of ``framework.engine.llm.LLM``: its public step API."""

    def add_request(self, prompt: Any, params: Any = None, *, stream: bool = False) -> int: ...
    def step(self) -> list[RequestOutput]: ...
    def abort(self, request_id: int) -> bool: ...
    def has_unfinished(self) -> bool: ...

    @property
    def stats(self) -> dict[str, Any]: ...


@dataclass
class Failure:
    """A request that failed: ``status`` 400 (rejected by the engine) or 500."""

    status: int
    message: str


@dataclass
class Stream:
    """One request's outputs, read by its handler: :class:`RequestOutput` snapshots (the
    whole output so far), then a last one that is ``finished``, or one :class:`Failure`."""

    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    req_id: Optional[int] = None
    submitted: float = field(default_factory=time.monotonic)
    last_output: Optional[float] = None
    num_tokens: int = 0
    done: bool = False
    aborted: Optional[str] = None
    """Why the handler stopped it (see :meth:`EngineLoop.abort`)."""


class EngineLoop:
    def __init__(self, llm: EngineProtocol, metrics: Optional[ServingMetrics] = None):
        self.llm = llm
        self.metrics = metrics or ServingMetrics()
        self._cmds: deque[tuple[str, Any]] = deque()
        self._wake = threading.Event()
        self._stop = False
        self._live: dict[int, Stream] = {}
        self._lock = threading.Lock()
        self._waiting = 0
        self._running = 0
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.steps = 0
        self._warned_foreign = False

    # ------------------------------------------------------------------ handler side
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def num_waiting(self) -> int:
        """Submitted requests with no token yet (queued here, or waiting / prefilling in the
        engine)."""
        return self._waiting

    @property
    def num_running(self) -> int:
        """Requests that have produced a token and have not finished."""
        return self._running

    def submit(self, prompt: list[int], params: SamplingParams) -> Stream:
        """Queue a request for the engine thread (call from the handler's event loop)."""
        s = Stream(prompt, params, asyncio.get_running_loop())
        with self._lock:
            self._waiting += 1
        self._command("add", s)
        return s

    def abort(self, s: Stream, reason: str = "client") -> None:
        """Stop a request: ``reason`` "client" (it went away; counted as a client abort) or
        "stop" (a stop string matched; counted as finished). No-op once it finished."""
        if not s.done and s.aborted is None:
            s.aborted = reason
            self._command("abort", s)

    async def engine_stats(self) -> dict[str, Any]:
        """A snapshot of ``LLM.stats`` taken on the engine thread between steps."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._command("stats", (loop, fut))
        return await fut

    def _command(self, kind: str, arg: Any) -> None:
        self._cmds.append((kind, arg))
        self._wake.set()

    # ------------------------------------------------------------------ engine thread
    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop:
            self._wake.clear()
            deliveries: dict[asyncio.AbstractEventLoop, list] = {}
            try:
                self._drain(deliveries)
                if self.llm.has_unfinished():
                    self._step(deliveries)
            except Exception:  # noqa: BLE001 - a bug here must not silence every handler
                logger.exception("engine loop iteration failed")
            self._deliver(deliveries)
            if not self._cmds and not self.llm.has_unfinished():
                self._wake.wait(timeout=1.0)

    def _drain(self, deliveries: dict) -> None:
        while self._cmds:
            kind, arg = self._cmds.popleft()
            if kind == "add":
                self._add(arg, deliveries)
            elif kind == "abort":
                self._abort(arg)
            elif kind == "stats":
                loop, fut = arg
                try:
                    stats = dict(self.llm.stats)
                except Exception as e:  # noqa: BLE001 - reported to the one caller
                    loop.call_soon_threadsafe(_set_exception, fut, e)
                else:
                    loop.call_soon_threadsafe(_set_result, fut, stats)

    def _add(self, s: Stream, deliveries: dict) -> None:
        if s.aborted is not None:  # the client left before it reached the engine
            self._retire(s, waiting=True)
            self.metrics.client_abort()
            return
        try:
            s.req_id = self.llm.add_request(s.prompt, s.params, stream=True)
        except (ValueError, TypeError) as e:  # the request's own fault: it can never run
            self._retire(s, waiting=True)
            self._put(deliveries, s, Failure(400, str(e)))
            return
        except Exception as e:  # noqa: BLE001 - fails this request, not the loop
            logger.exception("add_request failed")
            self._retire(s, waiting=True)
            self._put(deliveries, s, Failure(500, f"the engine could not add the request: {e}"))
            return
        self._live[s.req_id] = s

    def _abort(self, s: Stream) -> None:
        if s.done or s.req_id is None or s.req_id not in self._live:
            return
        self.llm.abort(s.req_id)
        del self._live[s.req_id]
        self._retire(s, waiting=s.last_output is None)
        if s.aborted == "stop":
            self.metrics.finish("stop", len(s.prompt))
        else:
            self.metrics.client_abort()

    def _retire(self, s: Stream, waiting: bool) -> None:
        s.done = True
        with self._lock:
            if waiting:
                self._waiting -= 1
            else:
                self._running -= 1

    def _step(self, deliveries: dict) -> None:
        try:
            outs = self.llm.step()
        except Exception as e:  # noqa: BLE001 - the engine stays usable; in-flight fail
            logger.exception(
                "engine step failed; failing the %d requests in flight", len(self._live)
            )
            self.metrics.step_error()
            for rid, s in list(self._live.items()):
                self.llm.abort(rid)
                del self._live[rid]
                self._retire(s, waiting=s.last_output is None)
                self._put(deliveries, s, Failure(500, f"engine step failed: {e}"))
            return
        self.steps += 1
        now = time.monotonic()
        for out in outs:
            s = self._live.get(out.request_id)
            if s is None:  # not submitted here: something else adds requests to this engine
                if not self._warned_foreign:
                    self._warned_foreign = True
                    logger.warning(
                        "engine output for request %d, which this loop did not submit: an "
                        "engine must have one loop and no other caller",
                        out.request_id,
                    )
                continue
            new = len(out.token_ids) - s.num_tokens
            if new > 0:
                if s.last_output is None:
                    self.metrics.first_token(now - s.submitted)
                    self.metrics.tokens(new, None, now)
                    with self._lock:
                        self._waiting -= 1
                        self._running += 1
                else:
                    self.metrics.tokens(new, now - s.last_output, now)
                s.last_output = now
                s.num_tokens = len(out.token_ids)
            if out.finished:
                del self._live[out.request_id]
                self._retire(s, waiting=s.last_output is None)
                self.metrics.finish(out.finish_reason or "", len(out.prompt_token_ids))
                if out.finish_reason == "error":
                    self._put(deliveries, s, Failure(500, _error_message(out)))
                    continue
            self._put(deliveries, s, out)

    @staticmethod
    def _put(deliveries: dict, s: Stream, item: Any) -> None:
        deliveries.setdefault(s.loop, []).append((s.queue, item))

    @staticmethod
    def _deliver(deliveries: dict) -> None:
        for loop, items in deliveries.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the handler's event loop is closed (server shutting down)
                pass


def _error_message(out: RequestOutput) -> str:
    msg = getattr(out, "error", None)  # the engine's message, where RequestOutput carries one
    return str(msg) if msg else f"request {out.request_id} failed inside an engine step"


def _put_all(items: Sequence[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(e)
