"""Tensor-parallel state of this process: rank, world size and the process group's name.

Models read it when they are built (how to shard their layers); the parallel layers read the
group name to emit functional collectives (``torch.ops._c10d_functional``) that Dynamo traces
into the FX graph, so passes can see, count and rewrite them.  The engine
(``framework.engine.parallel``) sets it with :func:`set_tp_state` after creating the process
group; without that every process is rank 0 of 1 and the layers emit no collective.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from framework.compat.ops import c10d_functional


@dataclass(frozen=True)
class TPState:
    rank: int = 0
    world_size: int = 1
    group_name: str = ""
    """c10d group name passed to the functional collectives ("" when world_size == 1)."""


_STATE = TPState()


def get_tp_state() -> TPState:
    return _STATE


def set_tp_state(state: TPState) -> None:
    global _STATE
    if not (0 <= state.rank < state.world_size):
        raise ValueError(f"TPState: rank {state.rank} outside 0..{state.world_size - 1}")
    _STATE = state


@contextmanager
def tp_state(state: TPState) -> Iterator[TPState]:
    """Temporarily set the state (tests build one rank's shard without a process group)."""
    old = _STATE
    set_tp_state(state)
    try:
        yield state
    finally:
        set_tp_state(old)


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(
            f"tensor_parallel_size={parts} must divide {what} ({total}); pick a size that does"
        )
    return total // parts


def kv_head_layout(num_kv_heads: int, world_size: int) -> tuple[int, int]:
    """(KV heads held per rank, how many ranks hold each KV head).

    With at least as many KV heads as ranks they are split evenly; with fewer (MQA, or GQA at
    high TP) each rank holds one head, replicated over ``world_size // num_kv_heads`` ranks.
    """
    if num_kv_heads >= world_size:
        return divide(num_kv_heads, world_size, "num_key_value_heads"), 1
    return 1, divide(world_size, num_kv_heads, "tensor_parallel_size / num_key_value_heads")


# ---------------------------------------------------------------- collectives (traceable)
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the TP group as a functional collective (appears in traced graphs)."""
    st = _STATE
    if st.world_size == 1:
        return x
    out = c10d_functional().all_reduce(x, "sum", st.group_name)
    return c10d_functional().wait_tensor(out)


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x [N, C]`` along the last dim -> ``[N, world * C]``."""
    st = _STATE
    if st.world_size == 1:
        return x
    n = st.world_size
    out = c10d_functional().all_gather_into_tensor(x.contiguous(), n, st.group_name)
    out = c10d_functional().wait_tensor(out)  # [world * N, C]
    return out.view(n, x.shape[0], x.shape[1]).permute(1, 0, 2).reshape(x.shape[0], -1)
