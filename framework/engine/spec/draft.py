"""The draft-model proposer: a second, smaller model with the target's vocabulary, compiled in
this process, that drafts up to k tokens per request for every verify step.

    LLM(target_dir, speculative_config={"method": "draft_model", "model": draft_dir,
                                        "num_speculative_tokens": 4})

The draft is built by the same :class:`framework.engine.worker.Worker` the target is (weights,
compiled forward, KV cache, block manager, CUDA-graph set-up, runner), so it owns:

* its own compile-cache namespace: its artifacts live under ``<cache>/<key>/rank_0/draft-...``
  (its own model tag, and its own key: the key covers its model config and sources), never
  beside the target's;
* its own paged KV cache and :class:`~framework.engine.block_manager.BlockManager`, sized for
  ``max_num_seqs`` sequences of the target's ``max_model_len``;
* its own dispatcher, whose capture sizes are the batch sizes of its single-token steps (query
  length 1, up to ``max_num_seqs``), not the target's multiples of ``1 + k``.

One :meth:`DraftModelProposer.propose` runs, for the whole batch, a *catch-up* step over the
tokens the draft has no KV for (the prompt on first sight; after a verify the one or two tokens
that were accepted since) and then ``k - 1`` single-token steps, each feeding back the draft
token just sampled.  Those steps are one tight loop: their KV blocks are reserved up front,
the inputs are staged once and advanced in place between the forwards
(``ModelRunner.advance``), the next token is picked on the device (an argmax for greedy
requests, no sampler), and the tokens come back to the host once, at the end.

Per request the draft keeps the token ids its KV covers and, on every call, keeps only their
common prefix with ``req.all_tokens()`` (the rollback contract of
``framework.engine.spec.proposer``): rejected drafts are simply recomputed over.

Greedy requests draft by argmax.  Sampling requests draft from the draft's own distribution q
under the request's temperature, top-k, top-p and min-p (penalties are not applied to q: any
q keeps rejection sampling exact, only acceptance changes); :meth:`draft_probs` returns q for
them, in float32.  The draft's noise is counter-based like the sampler's, keyed by a mix of the
request's seed that differs from the target's, so drafts are reproducible whatever else is in
the batch and independent of the target's own draws.

Every draft forward checks its inputs against what the draft was compiled for (dtype, rank,
token count): a mismatch is a
:class:`~framework.engine.spec.draft_inputs.DraftInputError`, never wrong drafts.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from framework.core.config import CompilationConfig, default_capture_sizes
from framework.core.forward_context import ForwardContext, set_forward_context
from framework.core.parallel_state import tp_state
from framework.engine.block_manager import OutOfBlocks
from framework.engine.request import Request, ScheduledChunk
from framework.engine.spec.config import SpeculativeConfig
from framework.engine.spec.draft_inputs import CheckedForward, input_spec_of
from framework.engine.spec.draft_loop import CatchUp, DraftStepLoop, Recording
from framework.engine.spec.draft_sampler import DraftSampler
from framework.engine.spec.proposer import ProposerContext, register_proposer
from framework.engine.worker import Worker
from models.config import ModelConfig, parse_dtype

_DRAFT_SEED_MIX = 0x5851F42D4C957F2D
"""Mixed into a request's seed for its draft noise (the target's draws use the seed itself)."""
_SEED_MASK = (1 << 63) - 1


# ---------------------------------------------------------------------- draft identity
def draft_identity(model_dir: str | Path, dtype: str | torch.dtype) -> str:
    """What identifies a draft for the cache keys: its model config, dtype and the names,
    shapes and dtypes of its checkpoint tensors (the safetensors headers).  Weight *values*
    are not compiled into any artifact (they are inputs of the pieces), so they are left out
    and a retrained draft of the same shape reuses its artifacts."""
    model_dir = Path(model_dir)
    mc = ModelConfig.from_hf_dir(model_dir)
    h = hashlib.sha256()
    h.update(
        json.dumps({"model_config": mc.compute_hash(), "dtype": str(parse_dtype(dtype))}).encode()
    )
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(f.name.encode() + fh.read(min(n, 1 << 26)))
    return h.hexdigest()[:16]


def check_draft_vocab(config: SpeculativeConfig, target: ModelConfig, draft: ModelConfig) -> None:
    """A draft must share the target's vocabulary: one ``ValueError`` naming the field."""
    if target.vocab_size != draft.vocab_size:
        raise ValueError(
            f"SpeculativeConfig.model: the draft {config.model} has vocab_size="
            f"{draft.vocab_size} but the target has vocab_size={target.vocab_size}; a draft "
            f"model must share the target's vocabulary (config.json field 'vocab_size')"
        )


def draft_compilation_config(
    target: CompilationConfig, overrides: Optional[dict[str, Any]], max_num_seqs: int
) -> CompilationConfig:
    """The draft's config: the target's (level, mode, backend, passes, kernels, cache
    settings) without the target's sizes -- its compile sizes, ranges, token budget and
    capture sizes are those of verify steps -- and with capture sizes for the draft's own
    single-token steps (batch sizes up to ``max_num_seqs``).  ``overrides`` (the
    ``draft_compile`` field) replace fields; one naming ``level`` starts from that level's
    defaults instead of the target's resolved fields (keeping the cache settings)."""
    sizes = sorted(set(default_capture_sizes(max_num_seqs)) | {max_num_seqs})
    dump = str(Path(target.debug_dump_path) / "draft") if target.debug_dump_path else None
    overrides = dict(overrides or {})
    if "level" in overrides:
        cc = CompilationConfig(
            use_cache=target.use_cache,
            cache_dir=target.cache_dir,
            progress_bar=target.progress_bar,
            debug_dump_path=dump,
            cudagraph_capture_sizes=sizes,
        )
    else:
        cc = target.replace(
            compile_sizes=None,
            compile_ranges_endpoints=None,
            max_num_tokens=None,
            cudagraph_capture_sizes=sizes,
            debug_dump_path=dump,
        )
    if overrides:
        data = cc.to_dict()
        data.update(overrides)
        cc = CompilationConfig.from_dict(data, _prefix="SpeculativeConfig.draft_compile")
    return cc


# ---------------------------------------------------------------------- per-request state
@dataclass
class _DraftSeq:
    """One request as the draft sees it: ``req.prompt`` + ``req.output`` are the tokens it
    knows (accepted ones, then its own drafts), the first ``req.num_computed`` of which have
    KV in the draft's cache, in ``req.block_ids``."""

    req: Request
    last_used: int = 0
    drafts: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)
    budget: int = 0
    """Drafts still wanted in this propose call."""
    done: bool = False


def _common_prefix(a: list[int], b: list[int], n: int) -> int:
    """Length of the common prefix of ``a[:n]`` and ``b[:n]``."""
    n = min(n, len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


# ---------------------------------------------------------------------- the proposer
@register_proposer("draft_model")
class DraftModelProposer:
    """Drafts from a second compiled model (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig, context: ProposerContext):
        if not config.model:
            raise ValueError(
                "SpeculativeConfig.model: method 'draft_model' needs the draft's Hugging "
                "Face folder"
            )
        self.num_speculative_tokens = config.num_speculative_tokens
        self.model_dir = str(config.model)
        self.context = context
        t0 = time.perf_counter()
        draft_mc = ModelConfig.from_hf_dir(self.model_dir)
        check_draft_vocab(config, context.model_config, draft_mc)
        config.validate_for(context.model_config, context.max_model_len, draft_mc)
        dtype = parse_dtype(config.draft_dtype) if config.draft_dtype else context.dtype
        self.draft_hash = draft_identity(self.model_dir, dtype)
        """The draft's identity (:func:`draft_identity`).  Not written into ``config``: the
        target is compiled before its proposer is built, and its compiled code does not
        depend on the draft (the draft's own cache key covers the draft)."""
        self.max_len = context.max_model_len
        """Positions the draft may hold (the target's max_model_len: drafts never go past it)."""
        target_cc = context.compilation_config
        cc = draft_compilation_config(target_cc, config.draft_compile, context.max_num_seqs)
        cache_dir = context.cache_dir if context.cache_dir is not None else target_cc.cache_dir
        self.model_tag = (
            f"draft-{draft_mc.architecture}-{draft_mc.num_layers}l-{draft_mc.hidden_size}h"
        )
        self.worker = Worker(
            self.model_dir,
            dtype=dtype,
            compilation_config=cc,
            max_num_seqs=context.max_num_seqs,
            max_model_len=self.max_len,
            cache_dir=cache_dir,
            seed=context.seed,
            max_num_batched_tokens=target_cc.max_num_tokens or context.max_model_len,
            block_size=context.block_size,
            device=str(context.device),
            model_tag=self.model_tag,
        )
        self.model_config = self.worker.model_config
        self.allocator = self.worker.block_manager
        self.runner = self.worker.runner
        self.sampler = DraftSampler()
        self.runner.sampler = self.sampler
        self.input_spec = input_spec_of(self.worker, self.model_dir)
        self._forward = self.runner.forward
        """The unchecked forward: the step loop checks its input buffers once per call."""
        self.runner.forward = CheckedForward(self._forward, self.input_spec)
        self.step_loop = DraftStepLoop.for_runner(
            self.runner, self.worker.forward_replay, self.runner.model
        )
        """The greedy single-token steps replayed as one native tape (``draft_loop.py``), or
        None where they cannot be (then the Python loop of :meth:`_decode` runs)."""
        self.max_num_tokens = self.runner.max_num_tokens
        self._seqs: dict[int, _DraftSeq] = {}
        self._calls = 0
        self._last_probs: Optional[list[Optional[torch.Tensor]]] = None
        self._stats = {
            "draft_propose_calls": 0,
            "draft_proposed_tokens": 0,
            "draft_forward_steps": 0,
            "draft_catch_up_tokens": 0,
            "draft_propose_time_s": 0.0,
            "draft_evictions": 0,
        }
        self.build_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ protocol
    def propose(self, reqs: Sequence[Request]) -> list[list[int]]:
        t0 = time.perf_counter()
        self._calls += 1
        active = set(r.req_id for r in reqs)
        seqs: list[Optional[_DraftSeq]] = [self._sync(r, active) for r in reqs]
        live = [s for s in seqs if s is not None and s.budget > 0]
        if live:
            with torch.inference_mode(), tp_state(self.worker.tp):
                rec = self._catch_up(live)
                while True:
                    step = [s for s in live if not s.done and len(s.drafts) < s.budget]
                    if not step:
                        break
                    self._decode(step, min(s.budget - len(s.drafts) for s in step), rec)
                    rec = None
        out = [list(s.drafts) if s is not None else [] for s in seqs]
        probs: list[Optional[torch.Tensor]] = []
        for r, s in zip(reqs, seqs):
            if s is None or r.params.greedy or not s.probs:
                probs.append(None)
            else:
                probs.append(torch.stack(s.probs[: len(s.drafts)]))
        self._last_probs = probs if any(p is not None for p in probs) else None
        st = self._stats
        st["draft_propose_calls"] += 1
        st["draft_proposed_tokens"] += sum(len(d) for d in out)
        st["draft_propose_time_s"] += time.perf_counter() - t0
        return out

    def draft_probs(self) -> Optional[list[Optional[torch.Tensor]]]:
        return self._last_probs

    def release(self, req_id: int) -> None:
        seq = self._seqs.pop(req_id, None)
        if seq is not None and seq.req.block_ids:
            self.allocator.free(seq.req.block_ids)
            seq.req.block_ids = []

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self._stats)
        out["draft_model"] = self.model_dir
        out["draft_cache_dir"] = (
            str(self.worker.compiled.store.dir) if self.worker.compiled.store is not None else None
        )
        out["draft_startup_s"] = self.build_s
        out["draft_identity"] = self.draft_hash
        out["draft_tracked_requests"] = len(self._seqs)
        replay = self.worker.forward_replay
        if replay is not None:
            out.update({f"draft_{k}": v for k, v in replay.stats().items()})
        if self.step_loop is not None:
            out.update({f"draft_{k}": v for k, v in self.step_loop.stats().items()})
        return out

    def check_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Raise :class:`~framework.engine.spec.draft_inputs.DraftInputError` unless the draft
        was compiled for these inputs."""
        self.input_spec.check(input_ids, positions)

    # ------------------------------------------------------------------ state
    def _sync(self, req: Request, active: set[int]) -> Optional[_DraftSeq]:
        """The request's draft state, rolled back to the common prefix with its accepted
        tokens, with KV blocks for this call's drafts and its draft budget set."""
        tokens = req.all_tokens()
        n = len(tokens)
        seq = self._seqs.get(req.req_id)
        if seq is not None and seq.req.prompt != req.prompt:
            self.release(req.req_id)
            seq = None
        if seq is None:
            shadow = Request(
                req.req_id,
                list(req.prompt),
                max_new_tokens=1 << 30,
                eos_token_ids=req.eos_token_ids,
                params=req.params,
                seed=(req.seed ^ _DRAFT_SEED_MIX) & _SEED_MASK,
            )
            seq = self._seqs[req.req_id] = _DraftSeq(shadow)
        shadow = seq.req
        shadow.params = req.params
        # Keep the KV of the common prefix; the last accepted token is always recomputed (its
        # logits give the first draft).
        nc = _common_prefix(shadow.all_tokens(), tokens, shadow.num_computed)
        shadow.num_computed = min(nc, n - 1)
        shadow.output = tokens[len(req.prompt) :]
        seq.last_used = self._calls
        seq.drafts, seq.probs, seq.done = [], [], False
        remaining = req.max_new_tokens - len(req.output)
        # The verify step yields up to len(drafts) + 1 tokens: no more drafts than the request
        # can still take, and none past max_model_len.
        seq.budget = max(0, min(self.num_speculative_tokens, remaining - 1, self.max_len - n))
        if seq.budget == 0:
            return seq
        # KV for positions up to n + budget - 2 (the last draft is sampled, never fed back).
        need = -(-(n + seq.budget - 1) // self.allocator.block_size) - len(shadow.block_ids)
        if need > 0:
            try:
                shadow.block_ids = shadow.block_ids + self._allocate(need, active)
            except OutOfBlocks:
                seq.budget = 0
        return seq

    def _allocate(self, n: int, active: set[int]) -> list[int]:
        """``n`` blocks, evicting the draft state of requests not in this call (least recently
        used first) when the draft's cache is full."""
        while n > self.allocator.num_free:
            idle = [s for rid, s in self._seqs.items() if rid not in active and s.req.block_ids]
            if not idle:
                break
            victim = min(idle, key=lambda s: s.last_used)
            self.release(victim.req.req_id)
            self._stats["draft_evictions"] += 1
        return self.allocator.allocate(n)

    # ------------------------------------------------------------------ steps
    def _catch_up(self, live: list[_DraftSeq]) -> Optional[Recording]:
        """Feed every token the draft has no KV for (in as many steps as the token budget
        needs) and sample the first draft of each request.  Where the catch-up is one forward
        the step loop can join (:meth:`_joins_step_loop`), the whole call replays as one tape
        (``draft_loop.py``: all its drafts are then drawn), or its Python run is recorded:
        the recording is returned for :meth:`_decode` to finish."""
        joined = self._joins_step_loop(live)
        if joined is not None:
            chunks, steps = joined
            ctx, tokens, _ = self.runner.build_context(chunks, record=False)
            ids, positions = self.runner.inputs_of(ctx)
            self.input_spec.check(ids, positions)
            self._stats["draft_catch_up_tokens"] += tokens
            if not ctx.cpu_replay:  # its forward never replays: the Python catch-up
                self._run(chunks, live, (ctx, ids, positions))
                return None
            qsl = ctx.attn_metadata[self.runner.layer_names[0]].query_start_loc_cpu
            rows = tuple(qsl[i + 1] - 1 for i in range(len(chunks)))
            catch_up = CatchUp(ctx, ids, positions, tokens, rows, [c.end for c in chunks])
            loop = self.step_loop
            assert loop is not None
            got = loop.run_after_catch_up(catch_up, steps)
            if got is not None:
                self._stats["draft_forward_steps"] += 1 + steps
                for s, c, tokens_i, finite_i in zip(live, chunks, *got):
                    self._keep(s, c.end, tokens_i, finite_i)
                return None
            rec = loop.recording(len(live), steps, catch_up)
            self._run(chunks, live, (ctx, ids, positions), rec)
            return rec
        # [sequence, next position to feed, end of its catch-up]; the end is fixed before the
        # first step (a sampled draft extends the sequence but is fed by the decode steps).
        pending = [[s, s.req.num_computed, s.req.num_tokens] for s in live]
        while pending:
            chunks, owners, budget = [], [], self.max_num_tokens
            for item in pending:
                if budget <= 0 or len(chunks) >= self.runner.max_num_seqs:
                    break
                s, start, end = item
                take = min(end - start, budget)
                chunks.append(ScheduledChunk(s.req, start, take))
                owners.append(s)
                item[1] = start + take
                budget -= take
            self._stats["draft_catch_up_tokens"] += sum(c.num_tokens for c in chunks)
            self._run(chunks, owners)
            pending = [item for item in pending if item[1] < item[2]]
        return None

    def _joins_step_loop(self, live: list[_DraftSeq]) -> Optional[tuple[list[ScheduledChunk], int]]:
        """The catch-up's chunks and the single-token steps after it, where they can run as
        one native loop: the step loop is on, every request is greedy (with the head's greedy
        kernel) and wants the same number (>= 2) of drafts, and the catch-up fits one
        forward."""
        loop = self.step_loop
        if loop is None or not (loop.enabled and loop.joins_catch_up):
            return None
        if self._greedy_head() is None:
            return None
        budget = live[0].budget
        if budget < 2 or any(s.budget != budget or not s.req.params.greedy for s in live):
            return None
        if len(live) > self.runner.max_num_seqs:
            return None
        chunks = [
            ScheduledChunk(s.req, s.req.num_computed, s.req.num_tokens - s.req.num_computed)
            for s in live
        ]
        if sum(c.num_tokens for c in chunks) > self.max_num_tokens:
            return None
        return chunks, budget - 1

    def _keep(
        self,
        s: _DraftSeq,
        start: int,
        tokens: list[int],
        finite: list[bool],
        probs: Optional[list[Optional[torch.Tensor]]] = None,
    ) -> None:
        """Append a request's drafts of consecutive steps (``tokens[j]`` drawn from the step
        that fed position ``start + j - 1``, ``finite[j]``: its maximum was finite) up to its
        first stop token or non-finite row; its KV then covers ``start + j`` positions."""
        req = s.req
        stop = req.eos_token_ids
        for j, t in enumerate(tokens):
            req.num_computed = start + j
            if probs is not None and probs[j] is not None:
                s.probs.append(probs[j])
            if not finite[j]:  # non-finite draft logits: no further drafts
                s.done = True
                return
            s.drafts.append(t)
            req.output.append(t)
            if t in stop or t in req.params.stop_token_ids:
                s.done = True  # the target stops there: drafting past it is wasted
                return

    def _decode(
        self, step: list[_DraftSeq], num_steps: int, rec: Optional[Recording] = None
    ) -> None:
        """``num_steps`` single-token steps of the same requests: the first feeds back each
        request's last draft, every later one the token the step before drew, with the
        inputs advanced in place (:meth:`ModelRunner.advance`) and the tokens kept on the
        device until the end (one host sync per call).  The requests' KV blocks for every
        position were reserved by :meth:`_sync`; a request that drew its EOS or stop token
        (or a non-finite row) keeps the drafts up to there, its later steps are discarded.
        ``rec``: the recording the catch-up started (its steps are recorded into it where
        they are the steps it was started for)."""
        runner = self.runner
        chunks = [ScheduledChunk(s.req, s.req.num_tokens - 1, 1) for s in step]
        starts = [c.start for c in chunks]
        ctx, n, _ = runner.build_context(chunks, record=False)
        ids, positions = runner.inputs_of(ctx)
        self.input_spec.check(ids, positions)  # the same buffers feed every step below
        forward = self._forward
        logits_of = runner.model.compute_logits
        params = [s.req.params for s in step]
        greedy = all(p.greedy for p in params)
        seeds = steps = None
        if not greedy:
            dev = runner.device
            seeds = torch.tensor([s.req.seed for s in step], device=dev)
            steps = torch.tensor([len(s.req.output) for s in step], device=dev)
        self._stats["draft_forward_steps"] += num_steps
        probs: list[Optional[torch.Tensor]] = [None] * num_steps
        head = self._greedy_head() if greedy else None
        loop = self.step_loop if head is not None else None
        if rec is not None and (loop is None or (rec.n, rec.steps) != (n, num_steps)):
            rec = None  # not the steps the catch-up's recording was started for
        replayed = None
        if loop is not None and rec is None:
            replayed = loop.run(ctx, ids, positions, n, num_steps)
        if replayed is not None:
            got, finite = replayed
        else:
            if loop is not None and rec is None:
                rec = loop.recording(n, num_steps)
            if loop is not None and rec is not None:  # this run's heads go into the recording
                head = functools.partial(loop.head, rec)
            tokens: list[torch.Tensor] = []
            maxima: list[torch.Tensor] = []
            for j in range(num_steps):
                if j:
                    ctx = runner.advance(ctx, tokens[-1])
                    if steps is not None:
                        steps = steps + 1
                with set_forward_context(ctx):
                    hidden = forward(ids, positions)
                out = head(hidden[:n]) if head is not None else None
                if out is not None:
                    _, tok, top = out
                else:
                    tok, top, probs[j] = self.sampler.pick(
                        logits_of(hidden[:n]), params, greedy, seeds, steps
                    )
                tokens.append(tok)
                maxima.append(top)
            if rec is not None and loop is not None:
                loop.finish(rec, ctx, ids, positions)
            got = torch.stack(tokens, dim=1).tolist()
            finite = torch.stack(maxima, dim=1).isfinite().tolist()
        for i, s in enumerate(step):
            rows = [p[i] if p is not None else None for p in probs]
            self._keep(s, starts[i] + 1, got[i], finite[i], rows)

    def _greedy_head(self) -> Optional[Any]:
        """The draft's LM head with its greedy kernel (``GreedyLogits``: logits, first-maximum
        index and maximum per row in one call, as the target's decode steps use it), for a
        batch whose drafts are all argmaxes; None where the draft's head has none or the
        runner's ``fuse_greedy_head`` is off (the A/B baseline).  Its call may still return
        None (then ``compute_logits`` and the sampler)."""
        runner = self.runner
        return runner.greedy_logits if runner.fuse_greedy_head else None

    def _run(
        self,
        chunks: list[ScheduledChunk],
        owners: list[_DraftSeq],
        staged: Optional[tuple[ForwardContext, torch.Tensor, torch.Tensor]] = None,
        rec: Optional[Recording] = None,
    ) -> None:
        """One draft forward over ``chunks`` (``owners[i]`` owns chunk i), staged already
        where ``staged`` is given; appends the sampled drafts (and their q) to their
        requests.  ``rec``: a step-loop recording this catch-up's head goes into."""
        runner = self.runner
        # The runner's staging and checked forward, without its step bookkeeping: logits of
        # the sampling rows only, drawn by the draft's sampler.
        if staged is None:
            ctx, _, _ = runner.build_context(chunks, record=False)
            inputs = runner.inputs_of(ctx)
        else:
            ctx, inputs = staged[0], staged[1:]
        with set_forward_context(ctx):
            hidden = runner.forward(*inputs)
        qsl = ctx.attn_metadata[runner.layer_names[0]].query_start_loc_cpu
        rows = [qsl[i + 1] - 1 for i, c in enumerate(chunks) if c.samples]
        sampled: list[Optional[int]] = []
        if rows:
            reqs = [c.req for c in chunks if c.samples]
            head = self._greedy_head() if all(r.params.greedy for r in reqs) else None
            if head is not None and rec is not None and self.step_loop is not None:
                got = self.step_loop.catch_up_head(rec, hidden)
            else:
                got = head(hidden[rows]) if head is not None else None
            if got is not None:
                sampled = self.sampler.from_argmax(got[1], got[2])
            else:
                logits = runner.model.compute_logits(hidden[rows])
                sampled, _ = self.sampler(logits, reqs)
        self._stats["draft_forward_steps"] += 1
        probs = self.sampler.last_probs
        row = 0
        it = iter(sampled)
        for c, s in zip(chunks, owners):
            c.req.num_computed = c.end
            if not c.samples:
                continue
            tok = next(it)
            if probs is not None:
                s.probs.append(probs[row])
            row += 1
            if tok is None:  # non-finite draft logits: no further drafts for this request
                s.done = True
                continue
            s.drafts.append(tok)
            s.req.output.append(tok)
            if tok in s.req.eos_token_ids or tok in s.req.params.stop_token_ids:
                s.done = True  # the target stops there: drafting past it is wasted


__all__ = [
    "DraftModelProposer",
    "check_draft_vocab",
    "draft_compilation_config",
    "draft_identity",
]
