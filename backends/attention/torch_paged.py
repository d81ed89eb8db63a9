"""Plain-torch paged attention: the CPU path and the reference every other backend is tested
against.  Correct for mixed batches (some requests prefill, some decode) and GQA.

Pure-decode steps run batched over all requests (one gather, one masked matmul-softmax);
other steps gather each request's KV blocks into a contiguous ``[L, Hkv, D]`` view and run
SDPA with a bottom-right-aligned causal mask (the query is the last ``q_len`` positions of the
context).  Both paths size their work with host-side numbers (``max_seq_len``, the real token
count, the per-request lists), which a CUDA graph would freeze at capture: NEVER.  FULL graphs
come from the Triton backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.attention.common import AttentionBackend, AttentionCGSupport, register_backend
from framework.core.attention_metadata import AttentionMetadata


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int,
) -> None:
    """Scatter the new keys/values of the first ``num_tokens`` tokens into their slots."""
    _, num_blocks, block_size, hkv, d = kv_cache.shape
    slots = slot_mapping[:num_tokens]
    kv_cache[0].view(num_blocks * block_size, hkv, d).index_copy_(0, slots, k[:num_tokens])
    kv_cache[1].view(num_blocks * block_size, hkv, d).index_copy_(0, slots, v[:num_tokens])


def causal_mask(
    q_len: int, kv_len: int, sliding_window: int, device: torch.device
) -> torch.Tensor | None:
    """Bool mask [q_len, kv_len] (True = attend); None when no masking is needed."""
    if q_len == 1 and (sliding_window <= 0 or kv_len <= sliding_window):
        return None
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window > 0:
        mask &= k_pos > q_pos - sliding_window
    return mask


def _decode_mask(
    md: AttentionMetadata, b: int, length: int, sliding_window: int, device: torch.device
) -> torch.Tensor:
    """Key positions each request must not see; built once per step, shared by all layers
    (the metadata object is shared)."""
    cache = md.__dict__.setdefault("_decode_masks", {})
    key = (b, length, sliding_window)
    mask = cache.get(key)
    if mask is None:
        pos = torch.arange(length, device=device)[None, :]
        seq_lens = md.seq_lens[:b].to(torch.int64)[:, None]
        mask = pos >= seq_lens  # [B, L]
        if sliding_window > 0:
            mask |= pos < seq_lens - sliding_window
        cache[key] = mask
    return mask


def decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    sliding_window: int,
) -> torch.Tensor:
    """Batched single-token decode over all requests at once (no per-request loop).

    q ``[B, Hq, D]``; caches ``[num_blocks, block_size, Hkv, D]``; returns ``[B, Hq, D]``.
    """
    b, hq, d = q.shape
    block_size, hkv = key_cache.shape[1], key_cache.shape[2]
    nblk = -(-md.max_seq_len // block_size)
    table = md.block_table[:b, :nblk].reshape(-1)
    keys = key_cache.index_select(0, table).view(b, nblk * block_size, hkv, d)
    values = value_cache.index_select(0, table).view(b, nblk * block_size, hkv, d)
    # fp32 math: oneDNN's tiny bf16 matmuls cost ~2x the fp32 ones here (measured side by
    # side at batch 1), and softmax wants fp32 anyway.
    qg = q.view(b, hkv, hq // hkv, d).float()  # [B, Hkv, G, D]
    scores = torch.matmul(qg, keys.permute(0, 2, 3, 1).float())  # [B, Hkv, G, L]
    invalid = _decode_mask(md, b, nblk * block_size, sliding_window, q.device)  # [B, L]
    scores.mul_(scale).masked_fill_(invalid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, values.permute(0, 2, 1, 3).float())  # [B, Hkv, G, D]
    return out.to(q.dtype).view(b, hq, d)


def prefill_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, sliding_window: int
) -> torch.Tensor:
    """One request: q ``[q_len, Hq, D]`` attends to keys/values ``[L, Hkv, D]``."""
    q_len, kv_len = q.shape[0], keys.shape[0]
    hq, hkv = q.shape[1], keys.shape[1]
    if hq != hkv:  # expand KV heads so SDPA can take its fused CPU kernel
        keys = keys.repeat_interleave(hq // hkv, dim=1)
        values = values.repeat_interleave(hq // hkv, dim=1)
    plain_causal = q_len == kv_len and (sliding_window <= 0 or kv_len <= sliding_window)
    mask = None if plain_causal else causal_mask(q_len, kv_len, sliding_window, q.device)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        keys.transpose(0, 1),
        values.transpose(0, 1),
        attn_mask=mask,
        is_causal=plain_causal and q_len > 1,
        scale=scale,
    )  # [Hq, q_len, D]
    return out.transpose(0, 1)


@register_backend("torch")
class TorchPagedAttention(AttentionBackend):
    cudagraph_support = AttentionCGSupport.NEVER

    @staticmethod
    def forward(
        q, k, v, out, kv_cache, md: AttentionMetadata, scale: float, sliding_window: int
    ) -> None:
        n = md.num_actual_tokens
        write_kv(k, v, kv_cache, md.slot_mapping, n)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        if md.max_query_len == 1:
            out[:n] = decode_attention(q[:n], key_cache, value_cache, md, scale, sliding_window)
        else:
            block_size = key_cache.shape[1]
            qsl, seq_lens = md.query_start_loc_cpu, md.seq_lens_cpu
            for i in range(md.num_reqs):
                qs, qe, kv_len = qsl[i], qsl[i + 1], seq_lens[i]
                blocks = md.block_table[i, : -(-kv_len // block_size)]
                keys = key_cache.index_select(0, blocks).flatten(0, 1)[:kv_len]
                values = value_cache.index_select(0, blocks).flatten(0, 1)[:kv_len]
                out[qs:qe] = prefill_attention(q[qs:qe], keys, values, scale, sliding_window)
        if out.shape[0] > n:
            out[n:].zero_()
