"""Sequence parallelism (tensor parallelism, large token counts): the all-reduce after a
row-parallel linear becomes a reduce-scatter, the residual add and RMSNorm run on this rank's
1/N of the tokens, and an all-gather restores every token before the next (column-parallel)
matmul.

Before (one match; ``x`` this rank's partial sums ``[T, H]``)::

    w   = wait_tensor(all_reduce(x, "sum", group))
    add = residual + w
    out = rms_norm_hf(add)               -> uses of (out, add)

After (``c = T / N``, ``r`` this rank)::

    rs   = wait_tensor(reduce_scatter_tensor(x, "sum", N, group))      # [c, H]
    addc = residual[r*c:(r+1)*c] + rs
    outc = rms_norm_hf(addc)                                           # on c tokens
    out  = wait_tensor(all_gather_into_tensor(outc, N, group))        # [T, H]
    add  = wait_tensor(all_gather_into_tensor(addc, N, group))

then ``residual[r*c:(r+1)*c]`` of a gathered ``add`` (the next match in the same piece) is
replaced by ``addc`` itself, so the residual stays sharded inside a piece and its all-gather
disappears; it is gathered only where it leaves the piece.

Applicability, range by range: only pieces compiled for one concrete size ``T`` with
``T >= PassConfig.sequence_parallel_min_tokens`` and ``T % N == 0`` (reduce-scatter needs
equal chunks; below the threshold the extra collectives cost more than the 1/N norm saves).
The pass records list the ranges it ran on.  For two ranks the sums are bitwise those of the
all-reduce (a + b), so tokens are unchanged.

Registered with ``@register_pass(name)`` alone; with ``after=`` / ``fusion=`` metadata it would
be ``after="noop_elimination", fusion=True``: it runs before ``fuse_allreduce_rmsnorm`` so that
fusion takes only what this pass leaves.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from framework.compat.ops import c10d_functional
from framework.core.parallel_state import get_tp_state
from passes.base import CompileRange
from passes.fuse_allreduce_rmsnorm import make_pattern
from passes.fusion_patterns import EPS_DUMMY, rms_norm_hf
from passes.pattern_fusion import FusionPattern, PatternFusionPass, float_dtypes
from passes.registry import register_pass

_C10D = c10d_functional()


def make_sp_replacement(group: str, rank: int, world: int):
    def replacement(x, residual, weight, eps):
        c = x.shape[0] // world
        rs = _C10D.wait_tensor.default(_C10D.reduce_scatter_tensor.default(x, "sum", world, group))
        add_c = residual[rank * c : (rank + 1) * c] + rs
        out_c = rms_norm_hf(add_c, weight, eps)
        out = _C10D.wait_tensor.default(_C10D.all_gather_into_tensor.default(out_c, world, group))
        add = _C10D.wait_tensor.default(_C10D.all_gather_into_tensor.default(add_c, world, group))
        return out, add

    return replacement


@register_pass("sequence_parallelism", after=("noop_elimination",), fusion=True)
class SequenceParallelismPass(PatternFusionPass):
    __doc__ = __doc__
    trace_on_fake_tensors = True  # the pattern holds an all-reduce

    def config_factors(self) -> dict[str, Any]:
        st = get_tp_state()
        return {
            **super().config_factors(),
            "group": st.group_name,
            "rank": st.rank,
            "tp": st.world_size,
            "min_tokens": self.context.sequence_parallel_min_tokens,
        }

    def is_applicable(self, compile_range: Optional[CompileRange]) -> bool:
        st = get_tp_state()
        if st.world_size == 1 or compile_range is None:
            return False
        size = int(compile_range.start)
        return (
            size == int(compile_range.end)
            and size >= self.context.sequence_parallel_min_tokens
            and size % st.world_size == 0
        )

    def patterns(self) -> Iterable[FusionPattern]:
        st = get_tp_state()
        if not st.group_name:
            return
        pattern, _ = make_pattern(st.group_name)
        replacement = make_sp_replacement(st.group_name, st.rank, st.world_size)
        for dtype in float_dtypes(self.context):

            def inputs(dtype=dtype):
                n = 4 * st.world_size
                return [
                    torch.randn(n, 16, dtype=dtype),
                    torch.randn(n, 16, dtype=dtype),
                    torch.randn(16, dtype=dtype),
                ]

            yield FusionPattern(
                f"sequence_parallel_{dtype}",
                pattern,
                replacement,
                inputs,
                scalars={"eps": EPS_DUMMY},
            )

    def __call__(self, graph: torch.fx.Graph) -> None:
        super().__call__(graph)
        if self.match_count:
            _keep_residual_sharded(graph, get_tp_state().rank)
            graph.eliminate_dead_code()


def _keep_residual_sharded(graph: torch.fx.Graph, rank: int) -> None:
    """``slice(wait(all_gather(y)), 0, r*c, (r+1)*c)`` -> ``y`` (this rank's own chunk)."""
    for node in list(graph.find_nodes(op="call_function", target=torch.ops.aten.slice.Tensor)):
        src = node.args[0]
        if not (
            isinstance(src, torch.fx.Node)
            and src.target is _C10D.wait_tensor.default
            and isinstance(src.args[0], torch.fx.Node)
            and src.args[0].target is _C10D.all_gather_into_tensor.default
        ):
            continue
        chunk = src.args[0].args[0]
        val = chunk.meta.get("val")
        dim, start, end = (list(node.args[1:]) + [0, None, None])[:3]
        if val is None or dim != 0:
            continue
        c = int(val.shape[0])
        gathered = int(src.meta["val"].shape[0]) if "val" in src.meta else None
        # the last rank's slice may be traced with an end past the size (``x[r*c:]``)
        end_ok = end == (rank + 1) * c or (
            gathered is not None
            and (rank + 1) * c == gathered
            and end is not None
            and end >= gathered
        )
        if start == rank * c and end_ok:
            node.replace_all_uses_with(chunk)
            graph.erase_node(node)
