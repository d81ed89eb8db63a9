"""A minimal paged-KV driver for model tests: builds ``AttentionMetadata`` and per-layer KV
caches by hand, so the model can be checked against transformers without the runner.

Blocks are handed out from a seeded permutation (not in order), so a wrong block-table lookup
shows up as wrong logits.  Steps can mix requests in prefill and in decode, and can pad the
flat batch (padding tokens get slot -1, as the runner does for CUDA graphs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from framework.core.attention_metadata import AttentionMetadata
from framework.core.forward_context import ForwardContext, set_forward_context


@dataclass
class _Seq:
    tokens: list[int]
    num_prompt: int
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)


class PagedHarness:
    def __init__(
        self,
        model,
        block_size: int = 4,
        num_blocks: int = 256,
        seed: int = 0,
        backend: str = "torch",
    ):
        self.model, self.config = model, model.config
        self.block_size, self.backend = block_size, backend
        self.layer_names = model.attention_layer_names()
        dtype = next(model.parameters()).dtype
        shape = (2, num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)
        self.kv_caches = {n: torch.zeros(shape, dtype=dtype) for n in self.layer_names}
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        self.free_blocks = order.tolist()

    # -- one forward over a flat batch ---------------------------------------------------------
    def _step(
        self, seqs: list[_Seq], chunks: list[list[int]], pad_to: Optional[int] = None
    ) -> torch.Tensor:
        """Run the new tokens ``chunks[i]`` of each sequence; returns hidden [T_padded, H]."""
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        for seq, chunk in zip(seqs, chunks):
            start, end = seq.num_computed, seq.num_computed + len(chunk)
            while len(seq.blocks) * self.block_size < end:
                seq.blocks.append(self.free_blocks.pop())
            ids += chunk
            pos += list(range(start, end))
            slots += [
                seq.blocks[p // self.block_size] * self.block_size + p % self.block_size
                for p in range(start, end)
            ]
            qsl.append(qsl[-1] + len(chunk))
            seq_lens.append(end)
            seq.num_computed = end
        num_tokens = len(ids)
        pad = max(0, (pad_to or 0) - num_tokens)
        ids, pos, slots = ids + [0] * pad, pos + [0] * pad, slots + [-1] * pad
        max_blocks = max(len(s.blocks) for s in seqs)
        table = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
        for i, s in enumerate(seqs):
            table[i, : len(s.blocks)] = torch.tensor(s.blocks, dtype=torch.int32)
        md = AttentionMetadata(
            attention_backend=self.backend,
            num_actual_tokens=num_tokens,
            num_reqs=len(seqs),
            max_query_len=max(len(c) for c in chunks),
            max_seq_len=max(seq_lens),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
        )
        ctx = ForwardContext(
            attn_metadata={n: md for n in self.layer_names},
            kv_caches=self.kv_caches,
            slot_mapping=md.slot_mapping,
        )
        with torch.no_grad(), set_forward_context(ctx):
            return self.model(
                torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64)
            )

    # -- public helpers ------------------------------------------------------------------------
    def prefill_logits(
        self, prompts: Sequence[Sequence[int]], pad_to: Optional[int] = None
    ) -> list[torch.Tensor]:
        """All prompts in ONE flat batch; logits of every prompt token, ``[L_i, V]`` each."""
        seqs = [_Seq(list(p), len(p)) for p in prompts]
        hidden = self._step(seqs, [list(p) for p in prompts], pad_to)
        with torch.no_grad():
            logits = self.model.compute_logits(hidden)
        out, start = [], 0
        for p in prompts:
            out.append(logits[start : start + len(p)])
            start += len(p)
        return out

    def greedy(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        arrival_steps: Optional[Sequence[int]] = None,
        pad_multiple: Optional[int] = None,
        return_logits: bool = False,
    ):
        """Greedy generation; request i joins at step ``arrival_steps[i]`` (default 0), so
        later arrivals prefill in the same step as earlier ones decode.

        Returns the new tokens per request; with ``return_logits`` also the logits each new
        token was sampled from, ``[max_new_tokens, V]`` per request."""
        arrival = list(arrival_steps or [0] * len(prompts))
        seqs = [_Seq(list(p), len(p)) for p in prompts]
        sampled_logits: list[list[torch.Tensor]] = [[] for _ in prompts]
        step = 0
        while any(len(s.tokens) - s.num_prompt < max_new_tokens for s in seqs):
            active = [
                i
                for i, s in enumerate(seqs)
                if arrival[i] <= step and len(s.tokens) - s.num_prompt < max_new_tokens
            ]
            step += 1
            if not active:
                continue
            batch = [seqs[i] for i in active]
            chunks = [s.tokens[s.num_computed :] for s in batch]
            total = sum(len(c) for c in chunks)
            pad_to = -(-total // pad_multiple) * pad_multiple if pad_multiple else None
            hidden = self._step(batch, chunks, pad_to)
            last_rows = torch.tensor(
                [sum(len(c) for c in chunks[: j + 1]) - 1 for j in range(len(chunks))]
            )
            with torch.no_grad():
                logits = self.model.compute_logits(hidden[last_rows])  # [num_reqs, V]
            for j, (i, t) in enumerate(zip(active, logits.argmax(-1).tolist())):
                seqs[i].tokens.append(t)
                sampled_logits[i].append(logits[j])
        tokens = [s.tokens[s.num_prompt :] for s in seqs]
        if return_logits:
            return tokens, [torch.stack(rows) for rows in sampled_logits]
        return tokens


def hf_greedy(hf_model, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """transformers ``generate(do_sample=False)`` of one prompt, EOS disabled so exactly
    ``max_new_tokens`` come back."""
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
        )
    return out[0, len(prompt) :].tolist()
