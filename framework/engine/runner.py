"""The model runner: persistent input buffers, attention metadata, one step of the model.

Inputs live in buffers sized for ``max_num_tokens`` / ``max_num_seqs`` whose addresses never
change, so CUDA graphs captured over them replay correctly.  Host-side staging happens in
numpy mirrors and is copied in with one ``copy_`` per buffer.  Padding (to a capture or
compile size) fills token ids and positions with 0, the slot mapping with -1 and block-table
rows with the null block, and clears the padding mask.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import numpy as np
import torch

from framework.core.attention_metadata import AttentionMetadata
from framework.core.forward_context import (
    BatchDescriptor,
    CUDAGraphMode,
    ForwardContext,
    set_forward_context,
)
from framework.engine.kv_cache import BlockAllocator
from framework.engine.request import ScheduledChunk
from framework.engine.sampler import Sampler

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
        attn_backend: str = "torch",
        dispatch: DispatchFn = no_graph_dispatch,
        record_trace: bool = True,
    ):
        self.model = model
        self.forward = forward
        self.kv_caches = kv_caches
        self.layer_names = list(kv_caches)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.attn_backend = attn_backend
        self.dispatch = dispatch
        self.device = torch.device(device)
        max_blocks = -(-max_model_len // block_size)
        i32, i64 = torch.int32, torch.int64
        d = self.device
        # Persistent device buffers (static addresses) and their host staging mirrors.
        self.input_ids = torch.zeros(max_num_tokens, dtype=i64, device=d)
        self.positions = torch.zeros(max_num_tokens, dtype=i64, device=d)
        self.slot_mapping = torch.full((max_num_tokens,), -1, dtype=i64, device=d)
        self.padding_mask = torch.zeros(max_num_tokens, dtype=torch.bool, device=d)
        self.query_start_loc = torch.zeros(max_num_seqs + 1, dtype=i32, device=d)
        self.seq_lens = torch.zeros(max_num_seqs, dtype=i32, device=d)
        self.block_table = torch.zeros(max_num_seqs, max_blocks, dtype=i32, device=d)
        self._np = {
            "input_ids": np.zeros(max_num_tokens, np.int64),
            "positions": np.zeros(max_num_tokens, np.int64),
            "slot_mapping": np.full(max_num_tokens, -1, np.int64),
            "query_start_loc": np.zeros(max_num_seqs + 1, np.int32),
            "seq_lens": np.zeros(max_num_seqs, np.int32),
            "block_table": np.full((max_num_seqs, max_blocks), BlockAllocator.NULL_BLOCK, np.int32),
        }
        self.sampler = Sampler()
        self.last_logprobs: Optional[list] = None
        """Per sampling chunk of the last step: {token: logprob} when its request asked."""
        self.trace: Optional[list[dict]] = [] if record_trace else None
        self.step_times: dict[str, list[float]] = {"prefill": [], "decode": [], "mixed": []}

    # ------------------------------------------------------------------ inputs
    def _stage(self, chunks: list[ScheduledChunk]) -> tuple[int, int, list[int], list[int]]:
        h = self._np
        bs = self.block_size
        n = 0
        qsl, seq_lens = [0], []
        for i, c in enumerate(chunks):
            req = c.req
            pos = np.arange(c.start, c.end, dtype=np.int64)
            h["positions"][n : n + c.num_tokens] = pos
            h["input_ids"][n : n + c.num_tokens] = [req.token_at(p) for p in range(c.start, c.end)]
            blocks = np.asarray(req.block_ids, dtype=np.int64)
            h["slot_mapping"][n : n + c.num_tokens] = blocks[pos // bs] * bs + pos % bs
            row = h["block_table"][i]
            row[: len(blocks)] = blocks
            row[len(blocks) :] = BlockAllocator.NULL_BLOCK
            n += c.num_tokens
            qsl.append(n)
            seq_lens.append(c.end)
        return n, len(chunks), qsl, seq_lens

    def _copy_in(
        self, n: int, n_pad: int, num_reqs: int, qsl: list[int], seq_lens: list[int]
    ) -> None:
        h = self._np
        h["input_ids"][n:n_pad] = 0
        h["positions"][n:n_pad] = 0
        h["slot_mapping"][n:n_pad] = -1
        h["query_start_loc"][: num_reqs + 1] = qsl
        h["seq_lens"][:num_reqs] = seq_lens
        for name in ("input_ids", "positions", "slot_mapping"):
            getattr(self, name)[:n_pad].copy_(torch.from_numpy(h[name][:n_pad]))
        self.query_start_loc[: num_reqs + 1].copy_(
            torch.from_numpy(h["query_start_loc"][: num_reqs + 1])
        )
        self.seq_lens[:num_reqs].copy_(torch.from_numpy(h["seq_lens"][:num_reqs]))
        self.block_table[:num_reqs].copy_(torch.from_numpy(h["block_table"][:num_reqs]))
        self.padding_mask[:n].fill_(True)
        self.padding_mask[n:n_pad].fill_(False)

    def build_context(
        self,
        chunks: list[ScheduledChunk],
        force: Optional[tuple[CUDAGraphMode, BatchDescriptor]] = None,
    ) -> tuple[ForwardContext, int, int]:
        """Stage a step's inputs; returns the forward context, real and padded token counts.
        ``force`` replaces the dispatcher's choice (graph capture uses it)."""
        n, num_reqs, qsl, seq_lens = self._stage(chunks)
        uniform_decode = all(c.num_tokens == 1 for c in chunks)
        mode, desc = force or self.dispatch(n, num_reqs, uniform_decode)
        n_pad = desc.num_tokens
        real_reqs = num_reqs
        if mode == CUDAGraphMode.FULL and desc.num_reqs and desc.num_reqs > num_reqs:
            # A full graph is captured for desc.num_reqs requests: the extra ones have no
            # query tokens, an empty context and the null block.
            extra = desc.num_reqs - num_reqs
            qsl = qsl + [qsl[-1]] * extra
            seq_lens = seq_lens + [0] * extra
            self._np["block_table"][num_reqs : desc.num_reqs] = BlockAllocator.NULL_BLOCK
            num_reqs = desc.num_reqs
        self._copy_in(n, n_pad, num_reqs, qsl, seq_lens)
        md = AttentionMetadata(
            backend=self.attn_backend,
            num_actual_tokens=n,
            num_reqs=num_reqs,
            max_query_len=max(c.num_tokens for c in chunks),
            max_seq_len=max(seq_lens),
            query_start_loc=self.query_start_loc[: num_reqs + 1],
            seq_lens=self.seq_lens[:num_reqs],
            block_table=self.block_table[:num_reqs],
            slot_mapping=self.slot_mapping[:n_pad],
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
        )
        num_reqs = real_reqs
        ctx = ForwardContext(
            attn_metadata=dict.fromkeys(self.layer_names, md),
            kv_caches=self.kv_caches,
            slot_mapping=self.slot_mapping[:n_pad],
            cudagraph_runtime_mode=mode,
            batch_descriptor=desc,
            padding_mask=self.padding_mask[:n_pad],
        )
        if self.trace is not None:
            self.trace.append(
                {
                    "step": len(self.trace),
                    "num_tokens": n,
                    "num_reqs": num_reqs,
                    "num_decode": sum(c.num_tokens == 1 and c.start > 0 for c in chunks),
                    "num_prefill_tokens": sum(
                        c.num_tokens for c in chunks if not (c.num_tokens == 1 and c.start > 0)
                    ),
                    "num_padded_tokens": n_pad,
                }
            )
        return ctx, n, n_pad

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute(
        self,
        chunks: list[ScheduledChunk],
        force: Optional[tuple[CUDAGraphMode, BatchDescriptor]] = None,
    ) -> tuple[list[Optional[int]], torch.Tensor]:
        """Run one step; returns the sampled token per chunk (None when the chunk ends
        mid-prompt) and the logits of the sampling chunks."""
        t0 = time.perf_counter()
        ctx, n, n_pad = self.build_context(chunks, force)
        with set_forward_context(ctx):
            hidden = self.forward(self.input_ids[:n_pad], self.positions[:n_pad])
        qsl = ctx.attn_metadata[self.layer_names[0]].query_start_loc_cpu
        rows = [qsl[i + 1] - 1 for i, c in enumerate(chunks) if c.samples]
        logits = self.model.compute_logits(hidden[rows]) if rows else hidden.new_empty(0, 0)
        tokens, self.last_logprobs = (
            self.sampler(logits, [c.req for c in chunks if c.samples]) if rows else ([], None)
        )
        it = iter(tokens)
        sampled = [next(it) if c.samples else None for c in chunks]
        kind = (
            "decode"
            if all(c.num_tokens == 1 and c.start > 0 for c in chunks)
            else "prefill"
            if all(c.start == 0 for c in chunks)
            else "mixed"
        )
        self.step_times[kind].append(time.perf_counter() - t0)
        return sampled, logits
