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

A layer's call is the torch op ``piecewise::cpu_paged_attention`` (q, k, v, out, cache, the
step's metadata tensors and counts).  Its CPU kernel is C++ (``csrc/cpu_paged_op.cpp``,
registered by :func:`~backends.attention.cpu_paged_build.load_op` on first use): the checks of
the tensors and metadata and the kernel call, with no Python body and no ctypes marshalling.
In a tiny-model b1 decode step that took a call from 21.5-26.6 µs (Python checks, metadata
arguments kept per step, ctypes) to 12.6-13.1 µs (fresh processes alternated,
``experiments/bench/results/step_parts_attention_glue_2026-12-05.txt``).  Where the op library
cannot be built, the op's Python body makes the same checks and calls the kernel through
ctypes (``python -m experiments.bench.engine_ab --ab attention_call`` times the two).  Where
this Python's headers are installed the op library is also a Python module, and the backend
calls its kernel function without the dispatcher (``framework.core.ops.direct_call``; the
dispatcher still takes the call under an override, a dispatch mode or the profiler): a b1
decode call 7.2-7.7 -> 5.8-6.1 µs (``experiments/bench/results/host_calls_2026-12-07_s30.md``).

CUDA-graph support: NEVER (a CPU kernel; FULL graphs come from the Triton backend).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable, Optional

import torch

from backends.attention.common import AttentionBackend, AttentionCGSupport, register_backend
from backends.attention.cpu_paged_build import load_library, load_op
from framework.core.attention_metadata import AttentionMetadata
from framework.core.forward_context import native_tape_sink
from framework.core.native_tape import native_call
from framework.core.ops import define_op, direct_call, direct_recorder

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_ERRORS = {
    1: "unsupported dtype",
    2: "head_dim > 256 or Hq not a multiple of Hkv",
    3: "a request has more query tokens than context (seq_lens < query length)",
    4: "the block table names a block outside the KV cache",
}


def _rows(name: str, t: torch.Tensor, heads: int, d: int) -> tuple[int, int]:
    """(rows, token stride) of a ``[T, heads, d]`` tensor whose heads are contiguous."""
    shape, stride = t.shape, t.stride()
    if len(shape) != 3 or shape[1] != heads or shape[2] != d or stride[2] != 1 or stride[1] != d:
        raise ValueError(
            f"cpu_paged attention: {name} must be [T, {heads}, {d}] with "
            f"contiguous heads, got shape {tuple(shape)} strides {stride}"
        )
    return shape[0], stride[0]


def _check_metadata(name: str, t: torch.Tensor, dtype: torch.dtype, dim: int) -> None:
    if t.device.type != "cpu" or t.dtype != dtype or t.dim() != dim or t.stride(-1) != 1:
        raise ValueError(
            f"cpu_paged attention: metadata {name} must be a {dim}-D CPU {dtype} tensor with "
            f"unit inner stride, got {t.dim()}-D {t.dtype} on {t.device} with strides "
            f"{t.stride()}"
        )


def call_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    num_reqs: int,
    num_actual_tokens: int,
    scale: float,
    sliding_window: int,
    library: Optional[ctypes.CDLL] = None,
) -> None:
    """The kernel through ctypes, after the checks the op's C++ kernel makes
    (``csrc/cpu_paged_op.cpp``; the same messages): the op's Python body, and the path of
    ``library``, another build of the kernel (``experiments.bench.attention_ab`` and the
    portable-build tests run one)."""
    dtype = _DTYPES.get(q.dtype)
    if dtype is None or any(t.dtype != q.dtype for t in (k, v, out, kv_cache)):
        raise ValueError(
            f"cpu_paged attention: q/k/v/out/kv_cache must share one dtype of "
            f"{sorted(str(d) for d in _DTYPES)}, got q {q.dtype}, k {k.dtype}, "
            f"v {v.dtype}, out {out.dtype}, kv_cache {kv_cache.dtype}"
        )
    if not all(t.is_cpu for t in (kv_cache, q, k, v, out)):
        raise ValueError(
            f"cpu_paged attention runs on CPU tensors, got q on {q.device}, "
            f"kv_cache on {kv_cache.device}"
        )
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"cpu_paged attention: kv_cache must be [2, num_blocks, block_size, Hkv, D], "
            f"got {list(kv_cache.shape)}"
        )
    if not kv_cache.is_contiguous():
        raise ValueError("cpu_paged attention: kv_cache must be contiguous")
    _, num_blocks, block_size, hkv, d = kv_cache.shape
    hq = q.shape[1] if q.dim() == 3 else -1
    q_rows, q_st = _rows("q", q, hq, d)
    k_rows, k_st = _rows("k", k, hkv, d)
    v_rows, v_st = _rows("v", v, hkv, d)
    out_rows, out_st = _rows("out", out, hq, d)
    _check_metadata("slot_mapping", slot_mapping, torch.int64, 1)
    _check_metadata("block_table", block_table, torch.int32, 2)
    _check_metadata("query_start_loc", query_start_loc, torch.int32, 1)
    _check_metadata("seq_lens", seq_lens, torch.int32, 1)
    n = num_actual_tokens
    if num_reqs < 0 or query_start_loc.shape[0] < num_reqs + 1 or seq_lens.shape[0] < num_reqs:
        raise ValueError(
            f"cpu_paged attention: query_start_loc/seq_lens shorter than num_reqs={num_reqs}"
        )
    end = int(query_start_loc[num_reqs])
    if end > n:
        raise ValueError(
            f"cpu_paged attention: query_start_loc ends at {end} > num_actual_tokens={n}"
        )
    max_seq_len = int(seq_lens[:num_reqs].max()) if num_reqs else 0
    if max_seq_len > block_table.shape[1] * block_size:
        raise ValueError(
            f"cpu_paged attention: max_seq_len={max_seq_len} exceeds the block table "
            f"({block_table.shape[1]} blocks of {block_size})"
        )
    if slot_mapping.shape[0] < n:
        raise ValueError(
            f"cpu_paged attention: slot_mapping has {slot_mapping.shape[0]} entries for "
            f"num_actual_tokens={n}"
        )
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
        slot_mapping.data_ptr(),
        block_table.data_ptr(),
        block_table.stride(0),
        query_start_loc.data_ptr(),
        seq_lens.data_ptr(),
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


def _cpu_paged_attention_fake(
    q, k, v, out, kv_cache, slot_mapping, block_table, query_start_loc, seq_lens,
    num_reqs, num_actual_tokens, scale, sliding_window,
) -> None:  # fmt: skip
    # A meta tensor among real ones dispatches here too: refuse it as the kernels do.
    devices = {t.device for t in (q, k, v, out, kv_cache)}
    if len(devices) > 1:
        raise ValueError(
            f"cpu_paged attention runs on CPU tensors, got q on {q.device}, "
            f"kv_cache on {kv_cache.device}"
        )
    return None


cpu_paged_attention = define_op(
    "piecewise::cpu_paged_attention",
    fake=_cpu_paged_attention_fake,
    schema="(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!) kv_cache, "
    "Tensor slot_mapping, Tensor block_table, Tensor query_start_loc, Tensor seq_lens, "
    "int num_reqs, int num_actual_tokens, float scale, int sliding_window) -> ()",
)(call_kernel)
"""The fused kernel as a torch op.  Its Python body (any device: the checks refuse all but CPU)
is :func:`call_kernel`, through ctypes; where the op library is built and loaded
(:func:`backends.attention.cpu_paged_build.load_op`), its C++ CPU kernel takes the call
instead: the same checks and the same kernel, without the Python."""


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
    """The fused kernel on explicit tensors and the step's metadata (see
    :class:`AttentionBackend.forward`): the op ``piecewise::cpu_paged_attention``, whose CPU
    kernel is C++ once :func:`~backends.attention.cpu_paged_build.load_op` has run.
    ``library``: another build of the kernel, called through ctypes instead."""
    args = (
        q, k, v, out, kv_cache, md.slot_mapping, md.block_table, md.query_start_loc,
        md.seq_lens, md.num_reqs, md.num_actual_tokens, scale, sliding_window,
    )  # fmt: skip
    if library is not None:
        call_kernel(*args, library=library)
        return
    sink = native_tape_sink()
    if sink is None:
        _op_call()(*args)
        return
    # A whole forward is being recorded: the call and the native call it made.
    op = _op_call()  # (loads the op library, which registers its recorder)
    recorder = direct_recorder("piecewise::cpu_paged_attention")
    if recorder is None:
        op(*args)
        sink.refuse("cpu_paged attention: no recording kernel (the op's Python module)")
        return
    _, native = recorder(*args)
    sink.add([native_call(native, "cpu_paged_attention")], None)


@functools.lru_cache(maxsize=1)
def _op_call() -> Callable[..., None]:
    """What :func:`paged_attention` calls: the op's C++ kernel without the dispatcher where
    its library has a Python module (``framework.core.ops.direct_call``: the dispatcher still
    takes the calls while an override, a dispatch mode or the profiler watches), else the op."""
    load_op()
    return direct_call("piecewise::cpu_paged_attention") or cpu_paged_attention


@register_backend("cpu_paged")
class CpuPagedAttention(AttentionBackend):
    cudagraph_support = AttentionCGSupport.NEVER

    @staticmethod
    def forward(
        q, k, v, out, kv_cache, md: AttentionMetadata, scale: float, sliding_window: int
    ) -> None:
        paged_attention(q, k, v, out, kv_cache, md, scale, sliding_window)
