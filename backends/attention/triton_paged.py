"""Triton paged attention: the GPU backend that can live inside FULL CUDA graphs.

Same contract and KV layout as the plain-torch backend (``[2, num_blocks, block_size, Hkv,
D]``); two kernels:

* ``_write_kv``: one program per token copies its K and V rows into the cache slot given by
  ``slot_mapping`` (slot -1 = padding, skipped).
* ``_paged_attention``: one program per (query token, KV head) handles the ``Hq // Hkv``
  query heads that share the KV head (GQA).  It finds its request by counting
  ``query_start_loc`` entries, places the query at the end of the request's context
  (position ``seq_len - q_len + i``), and streams that request's KV blocks through the block
  table with an online softmax, applying the causal mask and the sliding window.  Decode and
  prefill rows are the same code; padding rows (past the last request) get zeros.

CUDA-graph support: ALWAYS.  The launch grids depend only on the padded token count and the
head counts, the only host scalars are ``num_reqs`` (fixed per batch descriptor: the runner
pads requests to the descriptor's count with zero-length queries), ``scale`` and the window;
everything that changes from step to step (query_start_loc, seq_lens, block_table,
slot_mapping) is read from device tensors inside the kernels.  Nothing syncs with the host,
so one graph per descriptor replays correctly for any mix of prefill and decode.

Triton is imported at the first kernel call, not at import, so importing this module never
fails (nor imports triton) and ``TRITON_INTERPRET=1`` set before triton's first import in the
process selects the interpreter; on CPU tensors the interpreter is required.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from backends.attention.common import AttentionBackend, AttentionCGSupport, register_backend
from framework.core.attention_metadata import AttentionMetadata

triton = None
tl = None
"""Bound by :func:`_kernels` on first use: importing triton at module import would fix the
interpreter-or-compiler choice of ``triton.language`` before tests can set TRITON_INTERPRET
(and ``torch._inductor`` imports triton early), so the kernel bodies read ``tl`` from here."""

_REQ_CHUNK = 64
"""Requests scanned per vector step while a program finds its request."""


def _write_kv_kernel(
    k_ptr,
    v_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_vt,
    stride_cache_slot,
    ROW: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK_ROW)
        mask = offs < ROW
        k = tl.load(k_ptr + t * stride_kt + offs, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + offs, mask=mask)
        tl.store(key_cache_ptr + slot * stride_cache_slot + offs, k, mask=mask)
        tl.store(value_cache_ptr + slot * stride_cache_slot + offs, v, mask=mask)


def _paged_attention_kernel(
    q_ptr,
    out_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale,
    num_reqs,
    sliding_window,
    block_size,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    REQ_CHUNK: tl.constexpr,
):
    t = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Request of token t = number of request ends (query_start_loc[1:]) at or before t.
    req = 0
    for r0 in range(0, num_reqs, REQ_CHUNK):
        r = r0 + tl.arange(0, REQ_CHUNK)
        ends = tl.load(query_start_loc_ptr + 1 + r, mask=r < num_reqs, other=2147483647)
        req += tl.sum((ends <= t).to(tl.int32), axis=0)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    out_ptrs = out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :]
    out_mask = g_mask[:, None] & d_mask[None, :]

    if req >= num_reqs:
        # Padding token: deterministic zeros, like the torch backend.
        tl.store(
            out_ptrs,
            tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32).to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        q_start = tl.load(query_start_loc_ptr + req)
        q_end = tl.load(query_start_loc_ptr + req + 1)
        seq_len = tl.load(seq_lens_ptr + req)
        pos = seq_len - (q_end - q_start) + (t - q_start)  # this query's context position

        q = tl.load(
            q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :],
            mask=out_mask,
            other=0.0,
        ).to(tl.float32)
        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)

        first_key = 0
        if sliding_window > 0:
            first_key = tl.maximum(pos - sliding_window + 1, 0)
        n = tl.arange(0, BLOCK_N)
        for blk in range(first_key // block_size, pos // block_size + 1):
            block_id = tl.load(block_table_ptr + req * stride_bt + blk).to(tl.int64)
            key_pos = blk * block_size + n
            valid = (n < block_size) & (key_pos <= pos) & (key_pos >= first_key)
            kv_offs = (
                block_id * stride_cache_block
                + n[:, None] * stride_cache_slot
                + kv_head * stride_cache_head
                + d[None, :]
            )
            kv_mask = valid[:, None] & d_mask[None, :]
            k = tl.load(key_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(value_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
            # [G, 1, D] * [1, N, D] summed over D: a dot without tl.dot's >= 16 shape limits.
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            # The first block always holds a valid key, so m_new is finite from then on.
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@functools.cache
def _kernels(interpret: bool):
    """Import triton and JIT-wrap the kernels on first use (``TRITON_INTERPRET`` is read at
    wrap time)."""
    del interpret  # part of the cache key only
    global triton, tl
    import triton
    import triton.language as tl

    return triton.jit(_write_kv_kernel), triton.jit(_paged_attention_kernel)


def _get_kernels(device: torch.device):
    if importlib.util.find_spec("triton") is None:
        raise RuntimeError(
            "the 'triton' attention backend needs the triton package; install "
            "it or use attention backend 'torch'"
        )
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if device.type == "cpu" and not interpret:
        raise RuntimeError(
            "the 'triton' attention backend got CPU tensors: set "
            "TRITON_INTERPRET=1 to run its kernels in the interpreter, or use "
            "attention backend 'torch' on CPU"
        )
    kernels = _kernels(interpret)
    if device.type == "cpu" and not _language_is_interpreted():
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after triton was imported in this "
            "process (triton.language is built for the compiler); set it in "
            "the environment before Python starts"
        )
    return kernels


def _language_is_interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


def write_kv_triton(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter every token's K/V into ``kv_cache`` at ``slot_mapping`` (-1 = skip)."""
    write_kv, _ = _get_kernels(k.device)
    num_tokens, hkv, d = k.shape
    if num_tokens == 0:
        return
    _check_row_contiguous("k", k)
    _check_row_contiguous("v", v)
    if not kv_cache[0].is_contiguous():
        raise ValueError(
            "triton attention: kv_cache[0] and kv_cache[1] must be contiguous "
            "[num_blocks, block_size, Hkv, D] halves"
        )
    row = hkv * d
    write_kv[(num_tokens,)](
        k,
        v,
        kv_cache[0],
        kv_cache[1],
        slot_mapping,
        k.stride(0),
        v.stride(0),
        row,
        ROW=row,
        BLOCK_ROW=triton.next_power_of_2(row),
    )


def paged_attention_triton(
    q: torch.Tensor,
    out: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    sliding_window: int,
) -> None:
    """Causal paged attention of every query row into ``out`` (padding rows get zeros)."""
    _, attention = _get_kernels(q.device)
    num_tokens, hq, d = q.shape
    if num_tokens == 0:
        return
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _, block_size, hkv, _ = key_cache.shape
    if hq % hkv:
        raise ValueError(
            f"triton attention: query heads ({hq}) must be a multiple of KV heads ({hkv})"
        )
    for name, t in (("q", q), ("out", out), ("kv_cache", key_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"triton attention: {name} must have a contiguous last dim")
    group = hq // hkv
    attention[(num_tokens, hkv)](
        q,
        out,
        key_cache,
        value_cache,
        md.block_table,
        md.query_start_loc,
        md.seq_lens,
        float(scale),
        md.num_reqs,
        int(sliding_window),
        block_size,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        md.block_table.stride(0),
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_G=triton.next_power_of_2(group),
        BLOCK_D=triton.next_power_of_2(d),
        BLOCK_N=triton.next_power_of_2(block_size),
        REQ_CHUNK=_REQ_CHUNK,
    )


def _check_row_contiguous(name: str, t: torch.Tensor) -> None:
    # Rows are copied as flat [Hkv * D] vectors.
    if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        raise ValueError(
            f"triton attention: {name} must be contiguous per token "
            f"([T, Hkv, D] with strides (*, D, 1)), got strides {t.stride()}"
        )


@register_backend("triton")
class TritonPagedAttention(AttentionBackend):
    cudagraph_support = AttentionCGSupport.ALWAYS

    @staticmethod
    def forward(
        q, k, v, out, kv_cache, md: AttentionMetadata, scale: float, sliding_window: int
    ) -> None:
        write_kv_triton(k, v, kv_cache, md.slot_mapping)
        paged_attention_triton(q, out, kv_cache, md, scale, sliding_window)
