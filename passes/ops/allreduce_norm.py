"""``piecewise::allreduce_add_rms_norm``: tensor-parallel all-reduce + residual add + RMSNorm.

    new_residual = residual + all_reduce_sum(x)        (x: this rank's partial sums)
    out          = rms_norm_hf(new_residual, weight, eps)
    returns (out, new_residual)

The reference implementation runs anywhere (gloo on CPU, NCCL on CUDA): the functional
all-reduce, then the add and the norm written exactly as the model writes them, so it is
bit-identical to the unfused graph.  It is the op a fused kernel would replace (see
passes/README.md, "AllReduce + RMSNorm"): one launch that reduces, adds and normalises while
the data is in registers, instead of an all-reduce kernel, a write, and a norm kernel that reads
it back.  There is no such kernel here; this op is the pattern's target and its oracle.
"""

from __future__ import annotations

import torch
from torch import Tensor

from framework.compat.ops import c10d_functional
from passes.fusion_patterns import rms_norm_hf


@torch.library.custom_op("piecewise::allreduce_add_rms_norm", mutates_args=())
def allreduce_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, group_name: str
) -> tuple[Tensor, Tensor]:
    reduced = c10d_functional().all_reduce(x, "sum", group_name)
    reduced = c10d_functional().wait_tensor(reduced)
    new_residual = residual + reduced
    return rms_norm_hf(new_residual, weight, eps), new_residual


@allreduce_add_rms_norm.register_fake
def _fake(x, residual, weight, eps, group_name):
    out_dtype = torch.promote_types(weight.dtype, residual.dtype)
    return torch.empty_like(residual, dtype=out_dtype), torch.empty_like(residual)
