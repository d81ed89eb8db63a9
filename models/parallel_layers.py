"""Tensor-parallel layers: column- and row-parallel linears, the vocab-parallel embedding and
LM head.  With a world size of 1 each behaves exactly like the plain layer it replaces (same
parameters, same ops, no collective), so single-process graphs are unchanged.

How the checkpoint is split is each layer's business: the loader asks ``load_slice(attr,
block)`` which slice of the (full) checkpoint tensor this rank holds and reads only that
slice from safetensors.

* ``MergedColumnParallelLinear`` (qkv, gate_up): every row block is split on its own, so rank r
  holds its q heads, its KV heads (replicated when there are fewer KV heads than ranks) and its
  slice of gate and of up.  Output stays sharded: no collective.
* ``RowParallelLinear`` (o_proj, down_proj): input sharded, partial sums all-reduced; the bias
  is added once (by rank 0, before the sum).
* ``VocabParallelEmbedding`` / ``ParallelLMHead``: the vocabulary is padded up to a multiple
  of the world size; rank r holds rows ``[r*Vp/N, (r+1)*Vp/N)`` (padding rows are zero).  The
  embedding masks ids outside its rows and all-reduces; the head all-gathers its logits and
  drops the padding columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from framework.core.parallel_state import (
    all_gather_last_dim,
    all_reduce,
    divide,
    get_tp_state,
)
from models.layers import GreedyLinearMethod, Linear, MergedLinear, RecordingGreedyLinearMethod


@dataclass(frozen=True)
class LoadSlice:
    """Read checkpoint rows/cols ``[src_start, src_start + size)`` along ``dim`` (whose full
    length is ``full``) into the local tensor at ``dst_start``; the rest of the local tensor
    (vocabulary padding) is zero."""

    dim: int
    src_start: int
    size: int
    full: int
    dst_start: int = 0


@dataclass(frozen=True)
class BlockShard:
    """This rank's part of one row block of a merged projection."""

    local: int
    src_start: int
    full: int


class MergedColumnParallelLinear(MergedLinear):
    def __init__(
        self,
        in_features: int,
        blocks: list[BlockShard],
        bias: bool = False,
        dtype: Optional[torch.dtype] = None,
    ):
        super().__init__(in_features, [b.local for b in blocks], bias=bias, dtype=dtype)
        self.blocks = list(blocks)

    @classmethod
    def even(cls, in_features: int, full_sizes: list[int], what: str, **kw):
        """Every block split evenly over the ranks (gate_up)."""
        st = get_tp_state()
        blocks = []
        for full in full_sizes:
            local = divide(full, st.world_size, what)
            blocks.append(BlockShard(local, st.rank * local, full))
        return cls(in_features, blocks, **kw)

    def load_slice(self, attr: str, block: Optional[int]) -> Optional[LoadSlice]:
        if get_tp_state().world_size == 1 or block is None:
            return None
        b = self.blocks[block]
        return LoadSlice(0, b.src_start, b.local, b.full)


class RowParallelLinear(Linear):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: Optional[torch.dtype] = None,
        what: str = "in_features",
    ):
        st = get_tp_state()
        super().__init__(divide(in_features, st.world_size, what), out_features, bias, dtype)
        self.full_in_features = in_features
        self.tp_rank, self.tp_size = st.rank, st.world_size
        self.tp = st  # the state this layer was built with: its collectives' group

    def load_slice(self, attr: str, block: Optional[int]) -> Optional[LoadSlice]:
        if self.tp_size == 1 or attr != "weight":
            return None  # the bias is replicated
        local = self.in_features
        return LoadSlice(1, self.tp_rank * local, local, self.full_in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        bias = self.bias if self.tp_rank == 0 else None
        if self.linear_method is not None:
            if self.bias is not None:
                raise NotImplementedError(
                    "RowParallelLinear: a linear method with a bias under tensor parallelism"
                )
            y = self.linear_method.apply(self, x)
        else:
            y = F.linear(x, self.weight, bias)
        return all_reduce(y, self.tp)


def _vocab_shard(vocab_size: int) -> tuple[int, int, int]:
    """(rows per rank, first vocab id of this rank, real rows of this rank)."""
    st = get_tp_state()
    padded = -(-vocab_size // st.world_size) * st.world_size
    per = padded // st.world_size
    start = st.rank * per
    return per, start, max(0, min(per, vocab_size - start))


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = get_tp_state()  # the state this layer was built with: its collectives' group
        self.tp_size = self.tp.world_size
        self.rows, self.vocab_start, self.real_rows = _vocab_shard(vocab_size)
        self.weight = nn.Parameter(
            torch.empty(self.rows, hidden_size, dtype=dtype), requires_grad=False
        )

    def load_slice(self, attr: str, block: Optional[int]) -> Optional[LoadSlice]:
        if self.tp_size == 1:
            return None
        return LoadSlice(0, self.vocab_start, self.real_rows, self.vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.rows)  # [T]
        out = F.embedding(local * inside, self.weight)  # [T, H] (row 0 where outside)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return all_reduce(out, self.tp)

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size}, rows={self.rows} from {self.vocab_start}"


class ParallelLMHead(Linear):
    def __init__(self, hidden_size: int, vocab_size: int, dtype: Optional[torch.dtype] = None):
        rows, start, real = _vocab_shard(vocab_size)
        super().__init__(hidden_size, rows, dtype=dtype)
        self.vocab_size, self.vocab_start, self.real_rows = vocab_size, start, real
        self.tp = get_tp_state()  # the state this layer was built with: its collectives' group
        self.tp_size = self.tp.world_size
        self._greedy_checked: object = None
        self._greedy: Optional[GreedyLinearMethod] = None

    def load_slice(self, attr: str, block: Optional[int]) -> Optional[LoadSlice]:
        if self.tp_size == 1:
            return None
        return LoadSlice(0, self.vocab_start, self.real_rows, self.vocab_size)

    def _greedy_method(self) -> Optional[GreedyLinearMethod]:
        """The linear method if it has a greedy kernel.  An ``isinstance`` against a Protocol
        walks the Protocol's members (a few µs): checked once per installed method, not once
        per decode step."""
        method = self.linear_method
        if method is not self._greedy_checked:
            self._greedy_checked = method
            self._greedy = method if isinstance(method, GreedyLinearMethod) else None
        return self._greedy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)  # [N, Vp / world]
        if self.tp_size == 1:
            return logits
        return all_gather_last_dim(logits, self.tp)[:, : self.vocab_size]  # [N, V]

    def forward_greedy(
        self, x: torch.Tensor
    ) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(logits [N, V], first-maximum index [N], maximum [N]) from one kernel call, or None
        (sharded vocabulary, or a linear method without a greedy kernel)."""
        method = self._greedy_method() if self.tp_size == 1 else None
        return None if method is None else method.apply_greedy(self, x)

    def record_greedy(
        self, x: torch.Tensor
    ) -> Optional[tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], list[int]]]:
        """:meth:`forward_greedy` and the native call its kernel made (see
        :class:`models.layers.RecordingGreedyLinearMethod`), or None."""
        method = self._greedy_method() if self.tp_size == 1 else None
        if not isinstance(method, RecordingGreedyLinearMethod):
            return None
        return method.record_greedy(self, x)
