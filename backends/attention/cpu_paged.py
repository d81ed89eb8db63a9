"""Fused CPU paged attention: one native call per layer writes the new K/V at the slot mapping
and attends straight from the block table (no gather, no repeated KV heads, no masks built).

Contract and KV layout are the plain-torch backend's (``[2, num_blocks, block_size, Hkv, D]``):
decode and mixed prefill+decode batches, GQA/MQA, sliding windows, padding rows zeroed;
float32 and bfloat16 (fp32 accumulation, online softmax).  The kernel is C++
(``csrc/cpu_paged_attention.cpp``) built per machine on first use and cached on disk
(:mod:`backends.attention.cpu_paged_build`).  Other dtypes and non-CPU tensors raise.  On
AVX512-BF16 machines a bf16 cache (head_dim 32/64/128/256) is read as bf16, scores by
``vdpbf16ps`` (the "direct" path); elsewhere K/V rows are staged in fp32 per block.  Both give
a verify row of a speculative step the bits of the decode step it stands for.

Per step the metadata-derived arguments (pointers of the block table, query_start_loc,
seq_lens and slot_mapping, and the counts) are computed once and kept on the metadata object,
which every layer shares, so a layer call only adds its own q/k/v/out/cache pointers.

CUDA-graph support: NEVER (a CPU kernel; FULL graphs come from the Triton backend).
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from backends.attention.common import AttentionBackend, AttentionCGSupport, register_backend
from backends.attention.cpu_paged_build import load_library
from framework.core.attention_metadata import AttentionMetadata

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_ERRORS = {
    1: "unsupported dtype",
    2: "head_dim > 256 or Hq not a multiple of Hkv",
    3: "a request has more query tokens than context (seq_lens < query length)",
    4: "the block table names a block outside the KV cache",
}
_MD_KEY = "_cpu_paged_args"


def _rows(name: str, t: torch.Tensor, heads: int, d: int) -> tuple[int, int]:
    """(rows, token stride) of a ``[T, heads, d]`` tensor whose heads are contiguous."""
    shape, stride = t.shape, t.stride()
    if len(shape) != 3 or shape[1] != heads or shape[2] != d or stride[2] != 1 or stride[1] != d:
        raise ValueError(
            f"cpu_paged attention: {name} must be [T, {heads}, {d}] with "
            f"contiguous heads, got shape {tuple(shape)} strides {stride}"
        )
    return shape[0], stride[0]


def _metadata_args(md: AttentionMetadata, block_size: int) -> tuple:
    """(kept tensors, block size, slot_mapping, block_table, block-table row stride,
    query_start_loc, seq_lens, num_reqs, num_actual_tokens): pointers and counts, checked
    once per step (every layer shares the metadata object)."""
    args = md.__dict__.get(_MD_KEY)
    if args is None or args[1] != block_size:
        tensors = {
            "slot_mapping": (md.slot_mapping, torch.int64),
            "block_table": (md.block_table, torch.int32),
            "query_start_loc": (md.query_start_loc, torch.int32),
            "seq_lens": (md.seq_lens, torch.int32),
        }
        for name, (t, dtype) in tensors.items():
            if t.device.type != "cpu" or t.dtype != dtype or t.stride(-1) != 1:
                raise ValueError(
                    f"cpu_paged attention: metadata {name} must be a CPU {dtype} "
                    f"tensor with unit inner stride, got {t.dtype} on {t.device} "
                    f"with strides {t.stride()}"
                )
        if md.query_start_loc.shape[0] < md.num_reqs + 1 or md.seq_lens.shape[0] < md.num_reqs:
            raise ValueError(
                f"cpu_paged attention: query_start_loc/seq_lens shorter than num_reqs={md.num_reqs}"
            )
        if md.query_start_loc_cpu[md.num_reqs] > md.num_actual_tokens:
            raise ValueError(
                f"cpu_paged attention: query_start_loc ends at "
                f"{md.query_start_loc_cpu[md.num_reqs]} > num_actual_tokens="
                f"{md.num_actual_tokens}"
            )
        if md.max_seq_len > md.block_table.shape[1] * block_size:
            raise ValueError(
                f"cpu_paged attention: max_seq_len={md.max_seq_len} exceeds the "
                f"block table ({md.block_table.shape[1]} blocks of {block_size})"
            )
        if md.slot_mapping.shape[0] < md.num_actual_tokens:
            raise ValueError(
                f"cpu_paged attention: slot_mapping has "
                f"{md.slot_mapping.shape[0]} entries for num_actual_tokens="
                f"{md.num_actual_tokens}"
            )
        keep = (md.slot_mapping, md.block_table, md.query_start_loc, md.seq_lens)
        args = (
            keep,
            block_size,
            md.slot_mapping.data_ptr(),
            md.block_table.data_ptr(),
            md.block_table.stride(0),
            md.query_start_loc.data_ptr(),
            md.seq_lens.data_ptr(),
            md.num_reqs,
            md.num_actual_tokens,
        )
        md.__dict__[_MD_KEY] = args
    return args


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    sliding_window: int,
    library: Optional[ctypes.CDLL] = None,
) -> None:
    """The fused kernel on explicit tensors (see :class:`AttentionBackend.forward`).
    ``library``: another build of the kernel to call (default: this machine's build of the
    current source; ``experiments.bench.attention_ab`` times two versions side by side)."""
    dtype = _DTYPES.get(q.dtype)
    if (
        dtype is None
        or k.dtype != q.dtype
        or v.dtype != q.dtype
        or out.dtype != q.dtype
        or kv_cache.dtype != q.dtype
    ):
        raise ValueError(
            f"cpu_paged attention: q/k/v/out/kv_cache must share one dtype of "
            f"{sorted(str(d) for d in _DTYPES)}, got q {q.dtype}, k {k.dtype}, "
            f"v {v.dtype}, out {out.dtype}, kv_cache {kv_cache.dtype}"
        )
    if not (kv_cache.is_cpu and q.is_cpu):
        raise ValueError(
            f"cpu_paged attention runs on CPU tensors, got q on {q.device}, "
            f"kv_cache on {kv_cache.device}"
        )
    _, num_blocks, block_size, hkv, d = kv_cache.shape
    hq = q.shape[1]
    if not kv_cache.is_contiguous():
        raise ValueError("cpu_paged attention: kv_cache must be contiguous")
    q_rows, q_st = _rows("q", q, hq, d)
    k_rows, k_st = _rows("k", k, hkv, d)
    v_rows, v_st = _rows("v", v, hkv, d)
    out_rows, out_st = _rows("out", out, hq, d)
    _, _, slots, table, table_stride, qsl, seq_lens, num_reqs, n = _metadata_args(md, block_size)
    if n > min(q_rows, k_rows, v_rows, out_rows):
        raise ValueError(
            f"cpu_paged attention: num_actual_tokens={n} exceeds the rows of "
            f"q/k/v/out ({q_rows}, {k_rows}, {v_rows}, {out_rows})"
        )
    rc = (library or load_library()).piecewise_cpu_paged_attention(
        q.data_ptr(),
        q_st,
        k.data_ptr(),
        k_st,
        v.data_ptr(),
        v_st,
        out.data_ptr(),
        out_st,
        kv_cache.data_ptr(),
        num_blocks,
        block_size,
        slots,
        table,
        table_stride,
        qsl,
        seq_lens,
        num_reqs,
        n,
        out_rows,
        hq,
        hkv,
        d,
        scale,
        sliding_window,
        dtype,
    )
    if rc:
        raise ValueError(
            f"cpu_paged attention: {_ERRORS.get(rc, f'error {rc}')} (Hq={hq}, Hkv={hkv}, D={d})"
        )


@register_backend("cpu_paged")
class CpuPagedAttention(AttentionBackend):
    cudagraph_support = AttentionCGSupport.NEVER

    @staticmethod
    def forward(
        q, k, v, out, kv_cache, md: AttentionMetadata, scale: float, sliding_window: int
    ) -> None:
        paged_attention(q, k, v, out, kv_cache, md, scale, sliding_window)
