"""Plain-torch paged attention: the CPU path and the reference every other backend is tested
against.  Correct for mixed batches (some requests prefill, some decode) and GQA.

Per request it gathers the request's KV blocks into a contiguous ``[L, Hkv, D]`` view and
runs SDPA with a bottom-right-aligned causal mask (the query is the last ``q_len`` positions
of the context).  Its host-side loop over requests reads Python lists only, so it is safe in
a CUDA graph only when captured per exact batch: it declares UNIFORM_SINGLE_TOKEN_DECODE.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.attention.common import (AttentionBackend, AttentionCGSupport, AttentionMetadata,
                                       register_backend)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor, num_tokens: int) -> None:
    """Scatter the new keys/values of the first ``num_tokens`` tokens into their slots."""
    _, num_blocks, block_size, hkv, d = kv_cache.shape
    slots = slot_mapping[:num_tokens]
    kv_cache[0].view(num_blocks * block_size, hkv, d).index_copy_(0, slots, k[:num_tokens])
    kv_cache[1].view(num_blocks * block_size, hkv, d).index_copy_(0, slots, v[:num_tokens])


def causal_mask(q_len: int, kv_len: int, sliding_window: int,
                device: torch.device) -> torch.Tensor | None:
    """Bool mask [q_len, kv_len] (True = attend); None when no masking is needed."""
    if q_len == 1 and (sliding_window <= 0 or kv_len <= sliding_window):
        return None
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window > 0:
        mask &= k_pos > q_pos - sliding_window
    return mask


@register_backend("torch")
class TorchPagedAttention(AttentionBackend):
    cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    @staticmethod
    def forward(q, k, v, out, kv_cache, md: AttentionMetadata, scale: float,
                sliding_window: int) -> None:
        n = md.num_actual_tokens
        write_kv(k, v, kv_cache, md.slot_mapping, n)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        block_size = key_cache.shape[1]
        hq, hkv = q.shape[1], k.shape[1]
        qsl, seq_lens = md.query_start_loc_cpu, md.seq_lens_cpu
        for i in range(md.num_reqs):
            qs, qe, kv_len = qsl[i], qsl[i + 1], seq_lens[i]
            nblk = -(-kv_len // block_size)
            blocks = md.block_table[i, :nblk]
            keys = key_cache[blocks].flatten(0, 1)[:kv_len]      # [L, Hkv, D]
            values = value_cache[blocks].flatten(0, 1)[:kv_len]
            qi = q[qs:qe].transpose(0, 1)                          # [Hq, q_len, D]
            mask = causal_mask(qe - qs, kv_len, sliding_window, q.device)
            oi = F.scaled_dot_product_attention(
                qi, keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask,
                scale=scale, enable_gqa=hq != hkv)                 # [Hq, q_len, D]
            out[qs:qe] = oi.transpose(0, 1)
        if out.shape[0] > n:
            out[n:].zero_()
