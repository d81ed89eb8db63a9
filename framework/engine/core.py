"""The engine core: requests, the scheduler and one engine step, over an executor.

:class:`EngineCore` owns the requests of one engine; every step it asks the scheduler for
chunks, hands them to its executor (``framework.engine.executor``: in-process, or rank 0 of
a tensor-parallel group) and applies the sampled tokens.  ``LLM`` is a facade over it.

Concurrency contract: every public method holds the engine's lock, and :meth:`generate`
holds it for the whole call, so calls from several threads are serialised: each caller gets
its own requests' outputs, never another's, and never tokens from an interleaved batch.  A
thread that calls ``step`` while another runs ``generate`` waits until it returns.

No output is dropped: requests queued with :meth:`add_request` run inside a ``generate``
call too (together with its prompts); those that finish (or, streaming, grow) there are kept
and returned by the next :meth:`step`, and :meth:`has_unfinished` stays True until they are.

Observers (:class:`StepObserver`, e.g. ``framework.engine.observers.FirstTokenLogits``)
see every executed step's chunks, sampled tokens and logits; with none attached a step does
no such bookkeeping.
"""

from __future__ import annotations

import random
import threading
import time
import warnings
from typing import Any, Optional, Protocol, Sequence

import torch

from framework.engine.executor import Executor
from framework.engine.outputs import RequestOutput, output_of
from framework.engine.request import (
    Request,
    ScheduledChunk,
    validate_max_tokens,
    validate_token_ids,
)
from framework.engine.sampling_params import SamplingParams, params_per_prompt
from framework.engine.scheduler import Scheduler
from framework.engine.spec.decoder import SpecDecoder
from framework.engine.tokenizer import encode_prompt
from models.config import ModelConfig


class StepObserver(Protocol):
    def on_step(
        self, chunks: list[ScheduledChunk], sampled: list[Optional[int]], logits: torch.Tensor
    ) -> None:
        """After the forward, before the tokens are applied: ``logits`` holds one row per
        sampling chunk, in chunk order (a request whose ``output`` is still empty is
        sampling its first new token); a verify chunk (speculative decoding: ``c.spec``) has
        ``1 + len(c.spec)`` rows and its ``sampled`` entry is the list of kept tokens."""


class EngineCore:
    def __init__(
        self,
        executor: Executor,
        scheduler: Scheduler,
        *,
        model_config: ModelConfig,
        tokenizer: Any,
        seed: int = 0,
        spec: Optional[SpecDecoder] = None,
    ):
        self.executor = executor
        self.spec = spec
        """Speculative decoding (None: off): drafts each step, verified in the forward."""
        self.scheduler = scheduler
        self.model_config = model_config
        self.tokenizer = tokenizer
        self._lock = threading.RLock()
        self._next_id = 0
        self._rng = random.Random(seed)
        self._requests: dict[int, Request] = {}
        self._streaming: set[int] = set()
        self._undelivered: list[RequestOutput] = []
        """Outputs of step-API requests that finished (or grew) inside a ``generate`` call:
        the next ``step`` returns them first."""
        self.observers: list[StepObserver] = []

    # ------------------------------------------------------------------ observers
    def add_observer(self, observer: StepObserver) -> None:
        with self._lock:
            self.observers.append(observer)

    def remove_observer(self, observer: StepObserver) -> None:
        with self._lock:
            self.observers.remove(observer)

    # ------------------------------------------------------------------ step API
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: Optional[SamplingParams] = None,
        *,
        stream: bool = False,
        chat_template: bool = False,
    ) -> int:
        with self._lock:
            req = self._make_request(prompt, params, chat_template, f"request {self._next_id}")
            self.scheduler.add(req)
            self._next_id += 1
            self._requests[req.req_id] = req
            if stream:
                self._streaming.add(req.req_id)
            return req.req_id

    def _make_request(self, prompt, params, chat_template: bool, name: str) -> Request:
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise TypeError(f"{name}: params must be a SamplingParams, got {type(params).__name__}")
        params.check_for_model(self.model_config.vocab_size, name)
        if self.spec is not None:
            self.spec.check_params(params, name)
        text = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"{name}: a text prompt needs a tokenizer, and the model "
                    f"folder has no tokenizer.json / tokenizer_config.json"
                )
            text, prompt = (
                prompt,
                encode_prompt(self.tokenizer, prompt, chat_template=chat_template),
            )
        elif chat_template:
            raise ValueError(f"{name}: chat_template applies to text prompts only")
        ids = validate_token_ids(prompt, self.model_config.vocab_size, f"{name} prompt")
        eos = frozenset() if params.ignore_eos else frozenset(self.model_config.eos_token_ids)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        return Request(
            self._next_id,
            ids,
            params.max_tokens,
            eos,
            params=params,
            seed=seed,
            logprobs=[] if params.logprobs is not None else None,
            text_prompt=text,
        )

    def step(self) -> list[RequestOutput]:
        with self._lock:
            pending, self._undelivered = self._undelivered, []
            if not self.scheduler.has_work():
                return pending
            try:
                outs = self._step()
            except BaseException:
                self._undelivered = pending + self._undelivered
                raise
            return pending + outs

    def _step(self) -> list[RequestOutput]:
        """One engine step (the lock is held): schedule, execute, apply the tokens."""
        try:
            spec = self.spec
            drafts = None
            if spec is not None:
                drafts = spec.propose(self.scheduler.draft_candidates(spec.k))
            chunks = self.scheduler.schedule(drafts)
            if not chunks:
                raise RuntimeError("scheduler produced an empty step with work queued")
            if spec is not None:
                spec.attach(chunks)
            t0 = time.perf_counter()
            sampled, logits, logprobs = self.executor.execute(chunks)
            if spec is not None:
                spec.record(chunks, sampled, time.perf_counter() - t0)
        except BaseException:
            self.scheduler.recover()
            raise
        for observer in self.observers:
            observer.on_step(chunks, sampled, logits)
        row = 0
        grown = []
        for c, tok in zip(chunks, sampled):
            if not c.samples:
                continue
            if tok is None:  # it failed alone in the sampler (finish_reason "error")
                row += 1
                continue
            req = c.req
            if req.logprobs is not None and logprobs is not None:
                req.logprobs.append(logprobs[row])
            row += 1
            grown.append(req)
        done = self.scheduler.update(chunks, sampled)
        outs = [self._output(r) for r in done]
        for r in done:
            self._requests.pop(r.req_id, None)
            self._streaming.discard(r.req_id)
        outs += [self._output(r) for r in grown if r.req_id in self._streaming and not r.finished]
        return outs

    def abort(self, request_id: int) -> bool:
        with self._lock:
            req = self.scheduler.abort(request_id)
            self._requests.pop(request_id, None)
            self._streaming.discard(request_id)
            return req is not None

    def has_unfinished(self) -> bool:
        with self._lock:
            return self.scheduler.has_work() or bool(self._undelivered)

    def _output(self, req: Request) -> RequestOutput:
        return output_of(req, self.tokenizer)

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_new_tokens: Optional[int] = None,
        *,
        sampling_params: Optional[SamplingParams | Sequence[SamplingParams]] = None,
        ignore_eos: bool = False,
        return_outputs: bool = False,
        chat_template: bool = False,
    ) -> list:
        """See :meth:`framework.engine.llm.LLM.generate`.  ``prompts`` may be any iterable (a
        generator is read once).  A request that fails alone in a step (``finish_reason``
        "error") does not stop the others: its ``RequestOutput.error`` says why, and without
        ``return_outputs`` a warning names it."""
        if not isinstance(prompts, (str, bytes, list, tuple)) and hasattr(prompts, "__iter__"):
            prompts = list(prompts)
        if isinstance(prompts, (str, bytes)) or not all(
            isinstance(p, (list, tuple, str)) for p in prompts
        ):
            raise TypeError(
                "generate takes a list of prompts, each a list of token ids or a string"
            )
        if max_new_tokens is not None:
            validate_max_tokens(max_new_tokens)
        with self._lock:  # the whole call: concurrent callers run one after another
            params = params_per_prompt(sampling_params, len(prompts), max_new_tokens, ignore_eos)
            reqs = [
                self._make_request(p, sp, chat_template, f"prompt {i}")
                for i, (p, sp) in enumerate(zip(prompts, params))
            ]
            for i, r in enumerate(reqs):  # all or nothing: none starts when one can never fit
                r.req_id = self._next_id + i
                try:
                    self.scheduler.check_fits(r)
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}") from None
            self._next_id += len(reqs)
            for r in reqs:
                self.scheduler.add(r)
                self._requests[r.req_id] = r
            mine = {r.req_id for r in reqs}
            try:
                while any(not r.finished for r in reqs):
                    outs = self._step()
                    # Step-API requests that ran along: their outputs wait for ``step``.
                    self._undelivered += [o for o in outs if o.request_id not in mine]
            except BaseException:
                for r in reqs:
                    if not r.finished:
                        self.abort(r.req_id)
                raise
            if return_outputs:
                return [self._output(r) for r in reqs]
            for i, r in enumerate(reqs):
                if r.error is not None:
                    warnings.warn(f"prompt {i}: {r.error}", RuntimeWarning, stacklevel=3)
            if all(isinstance(p, str) for p in prompts) and prompts:
                return [self._output(r).text for r in reqs]
            return [list(r.output) for r in reqs]
