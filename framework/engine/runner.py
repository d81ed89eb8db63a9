"""The model runner: persistent input buffers, attention metadata, one step of the model.

Inputs live in buffers sized for ``max_num_tokens`` / ``max_num_seqs`` whose addresses never
change, so CUDA graphs captured over them replay correctly.  Host-side staging happens in
numpy arrays: on CPU the buffers share their memory (nothing is copied), elsewhere each is
copied in with one ``copy_``.  Padding (to a capture or
compile size) fills token ids and positions with 0, the slot mapping with -1 and block-table
rows with the null block, and clears the padding mask.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import numpy as np
import torch

from framework.core.attention_metadata import AttentionMetadata
from framework.core.forward_context import (
    BatchDescriptor,
    CUDAGraphMode,
    ForwardContext,
    set_forward_context,
)
from framework.engine.kv_cache import NULL_BLOCK
from framework.engine.request import ScheduledChunk, single_token_batch, step_kind, uniform_batch
from framework.engine.sampler import Sampler
from framework.engine.spec.rejection import RejectionSampler
from models.family import GreedyLogits

DispatchFn = Callable[[int, int, bool], tuple[CUDAGraphMode, BatchDescriptor]]


def no_graph_dispatch(
    num_tokens: int, num_reqs: int, uniform: bool
) -> tuple[CUDAGraphMode, BatchDescriptor]:
    return CUDAGraphMode.NONE, BatchDescriptor(num_tokens, num_reqs, uniform)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        forward: Callable[..., torch.Tensor],
        *,
        kv_caches: dict[str, torch.Tensor],
        block_size: int,
        max_num_seqs: int,
        max_num_tokens: int,
        max_model_len: int,
        device: torch.device | str = "cpu",
        attention_backend: str = "torch",
        dispatch: DispatchFn = no_graph_dispatch,
        record_trace: bool = True,
        sampler: Optional[Callable] = None,
        uniform_query_len: int = 1,
        verify: Optional[Callable] = None,
    ):
        self.model = model
        self.forward = forward
        self.kv_caches = kv_caches
        self.layer_names = list(kv_caches)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.attention_backend = attention_backend
        self.dispatch = dispatch
        self.uniform_query_len = uniform_query_len
        """Query tokens per request of a batch the dispatcher calls uniform: 1, or 1 + k with
        speculative decoding (then verify batches are the uniform ones)."""
        self.device = torch.device(device)
        max_blocks = -(-max_model_len // block_size)
        self.max_request_tokens = max_blocks * block_size
        """Tokens one request's block-table row has room for (``max_model_len`` rounded up to
        a block): the most a dummy request may hold."""
        # Host staging arrays.  On CPU the persistent "device" buffers *are* these arrays
        # (torch.from_numpy shares the memory): staging writes the step's inputs in place and
        # nothing is copied.  Elsewhere each buffer is copied in with one ``copy_``.
        self._np = {
            "input_ids": np.zeros(max_num_tokens, np.int64),
            "positions": np.zeros(max_num_tokens, np.int64),
            "slot_mapping": np.full(max_num_tokens, -1, np.int64),
            "padding_mask": np.zeros(max_num_tokens, np.bool_),
            "query_start_loc": np.zeros(max_num_seqs + 1, np.int32),
            "seq_lens": np.zeros(max_num_seqs, np.int32),
            "block_table": np.full((max_num_seqs, max_blocks), NULL_BLOCK, np.int32),
        }
        self._shared = self.device.type == "cpu"
        for name, arr in self._np.items():
            t = torch.from_numpy(arr)
            setattr(self, name, t if self._shared else t.clone().to(self.device))
        self._rows: list[Optional[tuple[list[int], int]]] = [None] * max_num_seqs
        """Per block-table row: (the block list it was written from, entries written).  A
        request's block list only grows (or is replaced by a new list), so a row whose list
        is the same object needs only its new entries written."""
        self._views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self.sampler = sampler if sampler is not None else Sampler()
        """``(logits, reqs) -> (tokens, logprobs)``; a tensor-parallel rank other than 0 gets
        one that samples nothing (rank 0 samples)."""
        self.greedy_logits: Optional[Callable[[torch.Tensor], Any]] = (
            model.compute_logits_greedy if isinstance(model, GreedyLogits) else None
        )
        """The model's fused LM head + greedy choice (None: the model has none).  A step whose
        requests are all greedy (no penalties or logprobs) takes its tokens from it when the
        head's kernel can (a bf16 head on the small-M kernel): no separate pass of the sampler
        over the logits, which after the head's weights streamed through the caches costs
        several times its microbenchmark."""
        self.cpu_replay_max_tokens = 0
        """Steps of at most this many (padded) tokens let CPU pieces replay their recorded
        native calls (``ForwardContext.cpu_replay``; the worker sets it from
        ``CompilationConfig.cpu_replay_max_tokens``).  Safe here: a step is done with its
        hidden states (LM head, sampler) before the next forward."""
        self.fuse_greedy_head = True
        """False: always ``compute_logits`` then the sampler (the A/B baseline of
        ``experiments.bench.engine_ab --ab greedy_head``); the tokens are the same."""
        self.verify = verify if verify is not None else RejectionSampler()
        """Speculative steps: ``(logits, reqs, drafts, draft_probs, argmax) -> kept tokens``
        per verify chunk (accepted drafts + one; ``argmax``: each row's first maximum and
        maximum where the LM head's greedy kernel gave them, else None); a tensor-parallel
        rank other than 0 gets one that keeps nothing (rank 0 verifies)."""
        self.last_logprobs: Optional[list] = None
        """Per sampling chunk of the last step: {token: logprob} when its request asked."""
        self.trace: Optional[list[dict]] = [] if record_trace else None
        self.step_times: dict[str, list[float]] = {
            "prefill": [],
            "decode": [],
            "verify": [],
            "mixed": [],
        }

    # ------------------------------------------------------------------ inputs
    def _stage(self, chunks: list[ScheduledChunk]) -> tuple[int, list[int], list[int]]:
        """Write the step's token ids, positions, slots and block-table rows into the host
        arrays; returns (tokens, query start locations, context lengths)."""
        h = self._np
        bs = self.block_size
        ids_np, pos_np, slot_np = h["input_ids"], h["positions"], h["slot_mapping"]
        if single_token_batch(chunks):
            # One token per request (decode): plain ints, one array write per buffer.
            ids, pos, slots = [], [], []
            for c in chunks:
                p = c.start
                ids.append(c.req.token_at(p))
                pos.append(p)
                slots.append(c.req.block_ids[p // bs] * bs + p % bs)
            n = len(chunks)
            ids_np[:n] = ids
            pos_np[:n] = pos
            slot_np[:n] = slots
            qsl = list(range(n + 1))
            seq_lens = [p + 1 for p in pos]
        else:
            n = 0
            qsl, seq_lens = [0], []
            for c in chunks:
                req, k = c.req, c.num_tokens
                p = np.arange(c.start, c.end, dtype=np.int64)
                pos_np[n : n + k] = p
                prompt = req.prompt
                if c.spec:  # a verify chunk: known tokens, then the drafts after them
                    ids_np[n : n + k] = req.tokens(c.start, req.num_tokens) + list(c.spec)
                else:
                    ids_np[n : n + k] = (
                        prompt[c.start : c.end]
                        if c.end <= len(prompt)
                        else req.all_tokens()[c.start : c.end]
                    )
                blocks = np.asarray(req.block_ids, dtype=np.int64)
                slot_np[n : n + k] = blocks[p // bs] * bs + p % bs
                n += k
                qsl.append(n)
                seq_lens.append(c.end)
        for i, c in enumerate(chunks):
            self._write_row(i, c.req.block_ids)
        return n, qsl, seq_lens

    def _write_row(self, i: int, blocks: list[int]) -> None:
        row = self._np["block_table"][i]
        cached = self._rows[i]
        k = len(blocks)
        if cached is not None and cached[0] is blocks and k >= cached[1]:
            if k > cached[1]:
                row[cached[1] : k] = blocks[cached[1] :]
                self._rows[i] = (blocks, k)
            return
        row[:k] = blocks
        row[k:] = NULL_BLOCK
        self._rows[i] = (blocks, k)

    def _null_rows(self, lo: int, hi: int) -> None:
        self._np["block_table"][lo:hi] = NULL_BLOCK
        self._rows[lo:hi] = [None] * (hi - lo)

    def _copy_in(
        self, n: int, n_pad: int, num_reqs: int, qsl: list[int], seq_lens: list[int]
    ) -> None:
        h = self._np
        if n_pad > n:
            h["input_ids"][n:n_pad] = 0
            h["positions"][n:n_pad] = 0
            h["slot_mapping"][n:n_pad] = -1
            h["padding_mask"][n:n_pad] = False
        h["padding_mask"][:n] = True
        h["query_start_loc"][: num_reqs + 1] = qsl
        h["seq_lens"][:num_reqs] = seq_lens
        if self._shared:
            return
        for name in ("input_ids", "positions", "slot_mapping", "padding_mask"):
            getattr(self, name)[:n_pad].copy_(torch.from_numpy(h[name][:n_pad]))
        for name, k in (("query_start_loc", num_reqs + 1), ("seq_lens", num_reqs)):
            getattr(self, name)[:k].copy_(torch.from_numpy(h[name][:k]))
        self.block_table[:num_reqs].copy_(torch.from_numpy(h["block_table"][:num_reqs]))

    def _views_for(self, n_pad: int, num_reqs: int) -> tuple[torch.Tensor, ...]:
        """Slices of the persistent buffers for a (padded tokens, requests) shape, made once
        (a slice costs microseconds; the same few shapes recur every step)."""
        key = (n_pad, num_reqs)
        v = self._views.get(key)
        if v is None:
            v = self._views[key] = (
                self.input_ids[:n_pad],
                self.positions[:n_pad],
                self.slot_mapping[:n_pad],
                self.padding_mask[:n_pad],
                self.query_start_loc[: num_reqs + 1],
                self.seq_lens[:num_reqs],
                self.block_table[:num_reqs],
            )
        return v

    def build_context(
        self,
        chunks: list[ScheduledChunk],
        force: Optional[tuple[CUDAGraphMode, BatchDescriptor]] = None,
        record: bool = True,
        graphs: bool = True,
    ) -> tuple[ForwardContext, int, int]:
        """Stage a step's inputs; returns the forward context, real and padded token counts.
        ``force`` replaces the dispatcher's choice (graph capture uses it); ``record`` False
        keeps the step out of the trace (dummy batches); ``graphs`` False runs the
        dispatcher's (padded) size without CUDA graphs: a warm-up must never be the first
        run of a piece inside a capture (a real capture runs nothing, and a kernel loaded or
        a compile finished there invalidates it)."""
        n, qsl, seq_lens = self._stage(chunks)
        num_reqs = real_reqs = len(chunks)
        q = self.uniform_query_len
        uniform = single_token_batch(chunks) if q == 1 else uniform_batch(chunks, q)
        mode, desc = force or self.dispatch(n, num_reqs, uniform)
        if not graphs:
            mode = CUDAGraphMode.NONE
        n_pad = desc.num_tokens
        if mode == CUDAGraphMode.FULL and desc.num_reqs and desc.num_reqs > num_reqs:
            # A full graph is captured for desc.num_reqs requests: the extra ones have no
            # query tokens, an empty context and the null block.
            extra = desc.num_reqs - num_reqs
            qsl = qsl + [qsl[-1]] * extra
            seq_lens = seq_lens + [0] * extra
            self._null_rows(num_reqs, desc.num_reqs)
            num_reqs = desc.num_reqs
        self._copy_in(n, n_pad, num_reqs, qsl, seq_lens)
        _, _, slots, mask, qsl_t, seq_lens_t, table = self._views_for(n_pad, num_reqs)
        md = AttentionMetadata(
            attention_backend=self.attention_backend,
            num_actual_tokens=n,
            num_reqs=num_reqs,
            max_query_len=max(c.num_tokens for c in chunks),
            max_seq_len=max(seq_lens),
            query_start_loc=qsl_t,
            seq_lens=seq_lens_t,
            block_table=table,
            slot_mapping=slots,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
        )
        ctx = ForwardContext(
            attn_metadata=dict.fromkeys(self.layer_names, md),
            kv_caches=self.kv_caches,
            slot_mapping=slots,
            cudagraph_runtime_mode=mode,
            batch_descriptor=desc,
            padding_mask=mask,
            cpu_replay=n_pad <= self.cpu_replay_max_tokens,
        )
        if record and self.trace is not None:
            num_decode = sum(c.is_decode for c in chunks)
            num_draft = sum(len(c.spec) for c in chunks)
            self.trace.append(
                {
                    "step": len(self.trace),
                    "num_tokens": n,
                    "num_reqs": real_reqs,
                    "num_decode": num_decode,
                    "num_prefill_tokens": n - num_decode,  # draft tokens included
                    "num_draft_tokens": num_draft,
                    "num_padded_tokens": n_pad,
                }
            )
        return ctx, n, n_pad

    def inputs_of(self, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The (padded) token-id and position buffers a context built by
        :meth:`build_context` runs over."""
        num_reqs = ctx.attn_metadata[self.layer_names[0]].num_reqs
        return self._views_for(ctx.batch_descriptor.num_tokens, num_reqs)[:2]

    @property
    def stages_in_place(self) -> bool:
        """The host staging arrays are the forward's input buffers (CPU): a value written
        into them is what the next forward reads, with no copy in between."""
        return self._shared

    def _slot(self, row: int, position: int) -> Optional[int]:
        """The KV slot of ``position`` in staged request row ``row`` (from the block list the
        row was written from), or None where the row has no block there."""
        blocks, written = self._rows[row]  # type: ignore[misc]  # only staged rows are asked
        b = position // self.block_size
        return None if b >= written else blocks[b] * self.block_size + position % self.block_size

    def later_steps(
        self, n: int, positions: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray
    ) -> bool:
        """For the staged single-token batch of ``n`` requests, the inputs of the steps after
        it, as :meth:`advance` would stage them, without staging them: row ``j`` (``j >= 1``)
        of ``positions``, ``slots`` and ``seq_lens`` (``[steps, >= n]`` arrays) gets step j's.
        False (the rows then partly written) where a request has no KV block for a position."""
        first = self._np["positions"][:n].tolist()
        return self.single_token_rows(first, positions, slots, seq_lens, start=1)

    def single_token_rows(
        self,
        first: list[int],
        positions: np.ndarray,
        slots: np.ndarray,
        seq_lens: np.ndarray,
        start: int = 0,
    ) -> bool:
        """The inputs of single-token steps over the staged request rows ``0..len(first)-1``
        whose step 0 feeds position ``first[i]``, without staging them: row ``j`` (``j >=
        start``) of ``positions``, ``slots`` and ``seq_lens`` gets step j's (position
        ``first[i] + j``, its KV slot from the row's staged block list, context length
        ``position + 1``).  False (the rows then partly written) where a request has no KV
        block for a position."""
        for j in range(start, positions.shape[0]):
            for i, p0 in enumerate(first):
                p = p0 + j
                slot = self._slot(i, p)
                if slot is None:
                    return False
                positions[j, i] = p
                slots[j, i] = slot
                seq_lens[j, i] = p + 1
        return True

    def advance(self, ctx: ForwardContext, next_ids: torch.Tensor) -> ForwardContext:
        """The context of the next step of a single-token batch (every request has one query
        token): each request's position moves one on and its token id becomes
        ``next_ids[i]`` (a tensor on the runner's device: no host sync).  The padding, the
        dispatcher's choice and the block-table rows are kept, so every request's KV blocks
        must already hold the new position (a draft model reserves them before its steps).

        A new metadata object is returned (backends cache per-step data on it); the host
        arrays are updated in place, which is why only the latest context may run."""
        md: AttentionMetadata = ctx.attn_metadata[self.layer_names[0]]
        n = md.num_actual_tokens
        if md.max_query_len != 1 or md.query_start_loc_cpu[-1] != n:
            raise ValueError(
                f"ModelRunner.advance: the context is not a single-token batch "
                f"(max_query_len={md.max_query_len}, {n} tokens)"
            )
        h = self._np
        # A single-token request's context length is its position + 1: the new position.
        # Plain ints, as in the staging of a decode step (cheaper than array ops at these
        # sizes).
        pos = md.seq_lens_cpu[:n]
        slots = []
        for i, p in enumerate(pos):
            slot = self._slot(i, p)
            if slot is None:
                raise ValueError(
                    f"ModelRunner.advance: request row {i} has no KV block for position {p} "
                    f"(reserve the blocks before advancing)"
                )
            slots.append(slot)
        seq_lens = [p + 1 for p in pos]
        h["positions"][:n] = pos
        h["slot_mapping"][:n] = slots
        h["seq_lens"][:n] = seq_lens
        self.input_ids[:n].copy_(next_ids)
        if not self._shared:
            for name in ("positions", "slot_mapping"):
                getattr(self, name)[:n].copy_(torch.from_numpy(h[name][:n]))
            self.seq_lens[:n].copy_(torch.from_numpy(h["seq_lens"][:n]))
        seq_lens = seq_lens + md.seq_lens_cpu[n:]
        md = AttentionMetadata(
            attention_backend=md.attention_backend,
            num_actual_tokens=n,
            num_reqs=md.num_reqs,
            max_query_len=1,
            max_seq_len=md.max_seq_len + 1,
            query_start_loc=md.query_start_loc,
            seq_lens=md.seq_lens,
            block_table=md.block_table,
            slot_mapping=md.slot_mapping,
            query_start_loc_cpu=md.query_start_loc_cpu,
            seq_lens_cpu=seq_lens,
        )
        return ForwardContext(
            attn_metadata=dict.fromkeys(self.layer_names, md),
            kv_caches=ctx.kv_caches,
            slot_mapping=ctx.slot_mapping,
            cudagraph_runtime_mode=ctx.cudagraph_runtime_mode,
            batch_descriptor=ctx.batch_descriptor,
            padding_mask=ctx.padding_mask,
            cpu_replay=ctx.cpu_replay,
        )

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute(
        self,
        chunks: list[ScheduledChunk],
        force: Optional[tuple[CUDAGraphMode, BatchDescriptor]] = None,
        record: bool = True,
        graphs: bool = True,
    ) -> tuple[list[Any], torch.Tensor]:
        """Run one step; returns the sampled token per chunk (None when the chunk ends
        mid-prompt; for a verify chunk the list of kept tokens: accepted drafts + one) and
        the logits of the sampling chunks (a verify chunk has ``1 + len(spec)`` rows).
        ``record`` False: a dummy step, kept out of ``step_times`` and the trace; ``graphs``
        False: no CUDA graph captured or replayed (warm-up)."""
        t0 = time.perf_counter()
        ctx, n, n_pad = self.build_context(chunks, force, record, graphs)
        ids, positions = self._views_for(n_pad, ctx.attn_metadata[self.layer_names[0]].num_reqs)[:2]
        with set_forward_context(ctx):
            hidden = self.forward(ids, positions)
        sampling = [c.samples for c in chunks]
        sampled: list[Any]
        if any(c.spec for c in chunks):
            sampled, logits = self._verify(chunks, sampling, hidden, ctx)
            self.last_logprobs = None
        else:
            h: Optional[torch.Tensor]
            if all(sampling) and n == len(chunks):
                # One token per request, every one samples: the rows are hidden[:n], a view.
                reqs = [c.req for c in chunks]
                h = hidden[:n]
            else:
                qsl = ctx.attn_metadata[self.layer_names[0]].query_start_loc_cpu
                rows = [qsl[i + 1] - 1 for i, s in enumerate(sampling) if s]
                reqs = [c.req for c, s in zip(chunks, sampling) if s]
                h = hidden[rows] if rows else None
            if h is None:
                logits, tokens, self.last_logprobs = hidden.new_empty(0, 0), [], None
            else:
                logits, tokens, self.last_logprobs = self._sample(h, reqs)
            if len(tokens) == len(chunks):
                sampled = tokens
            else:
                it = iter(tokens)
                sampled = [next(it) if s else None for s in sampling]
        if record:
            self.step_times[step_kind(chunks)].append(time.perf_counter() - t0)
        return sampled, logits

    def _sample(self, h: torch.Tensor, reqs: list) -> tuple[torch.Tensor, list, Optional[list]]:
        """(logits, token per row, logprobs) of the sampling rows ``h``: from the LM head's
        greedy kernel where the batch only needs each row's argmax and the head has one, else
        ``compute_logits`` and the sampler."""
        sampler = self.sampler
        argmax_only = isinstance(sampler, Sampler) and sampler.takes_argmax(reqs)
        logits, best = self._logits(h, argmax_only)
        if best is not None:
            return logits, sampler.from_argmax(*best, reqs), None
        tokens, logprobs = sampler(logits, reqs)
        return logits, tokens, logprobs

    def _logits(
        self, h: torch.Tensor, argmax_only: bool
    ) -> tuple[torch.Tensor, Optional[tuple[list[int], list[float]]]]:
        """The logits of rows ``h`` and, where the caller reads only each row's argmax
        (``argmax_only``) and the LM head's greedy kernel takes these rows, each row's first
        maximum and maximum from the same call; else ``compute_logits`` and None."""
        if argmax_only and self.fuse_greedy_head and self.greedy_logits is not None:
            got = self.greedy_logits(h)
            if got is not None:
                logits, idx, top = got
                return logits, (idx.tolist(), top.tolist())
        return self.model.compute_logits(h), None

    def _verify(
        self, chunks: list[ScheduledChunk], sampling: list[bool], hidden: torch.Tensor, ctx
    ) -> tuple[list[Any], torch.Tensor]:
        """A step with verify chunks: logits at every query position of a verify chunk (its
        last token and each draft) and at the last one of other sampling chunks; rejection
        sampling keeps the accepted drafts and one token of the target's per verify chunk."""
        qsl = ctx.attn_metadata[self.layer_names[0]].query_start_loc_cpu
        rows: list[int] = []
        reqs, drafts, probs = [], [], []
        for i, (c, s) in enumerate(zip(chunks, sampling)):
            if not s:
                continue
            rows.extend(range(qsl[i + 1] - 1 - len(c.spec), qsl[i + 1]))
            reqs.append(c.req)
            drafts.append(c.spec)
            probs.append(c.draft_probs)
        if not rows:
            kept: list[Any] = []
            logits = hidden.new_empty(0, 0)
        else:
            # The rows of one request's chunk, or of uniform verify chunks, are one range.
            contiguous = rows[-1] - rows[0] == len(rows) - 1
            h = hidden[rows[0] : rows[-1] + 1] if contiguous else hidden[rows]
            # Rank 0's verify (it reads params) reads only argmaxes for greedy requests.
            argmax_only = isinstance(self.verify, RejectionSampler) and all(
                r.params.greedy for r in reqs
            )
            logits, argmax = self._logits(h, argmax_only)
            any_probs = any(p is not None for p in probs)
            kept = self.verify(logits, reqs, drafts, probs if any_probs else None, argmax)
        it = iter(kept)
        sampled: list[Any] = []
        for c, s in zip(chunks, sampling):
            if not s:
                sampled.append(None)
                continue
            got = next(it)
            # A verify chunk's kept tokens as a list; a plain chunk's one token as an int.
            sampled.append(got if (c.spec or got is None) else got[0])
        return sampled, logits
