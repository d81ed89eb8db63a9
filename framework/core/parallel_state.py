"""Tensor-parallel state of one engine: rank, world size and the process group's name.

Models read it when they are built (how to shard their layers) and keep it: the parallel
layers pass their own :class:`TPState` to :func:`all_reduce` / :func:`all_gather_last_dim`,
which emit functional collectives (``torch.ops._c10d_functional``) on its group that Dynamo
traces into the FX graph, so passes can see, count and rewrite them.

The state is scoped, not process-global: an engine worker (``framework.engine.worker``) builds,
compiles and runs its model inside ``with tp_state(its_state):``, and the current state is a
:class:`contextvars.ContextVar`, so a second engine in the process (or another thread) never
sees it.  Outside such a block every build is rank 0 of 1 and emits no collective.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
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

    def __post_init__(self) -> None:
        if not (0 <= self.rank < self.world_size):
            raise ValueError(f"TPState: rank {self.rank} outside 0..{self.world_size - 1}")


_STATE: ContextVar[TPState] = ContextVar("piecewise_tp_state", default=TPState())
"""The state of the engine building / running in this thread (rank 0 of 1 outside one)."""


def get_tp_state() -> TPState:
    """The tensor-parallel state of the engine building (or running) in this thread."""
    return _STATE.get()


@contextmanager
def tp_state(state: TPState) -> Iterator[TPState]:
    """Make ``state`` current for the block (this thread / task only): an engine builds,
    compiles and runs its model inside one; tests build one rank's shard without a group."""
    if not isinstance(state, TPState):
        raise TypeError(f"tp_state: expected a TPState, got {type(state).__name__}")
    token = _STATE.set(state)
    try:
        yield state
    finally:
        _STATE.reset(token)


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
def all_reduce(x: torch.Tensor, st: TPState) -> torch.Tensor:
    """Sum over ``st``'s group as a functional collective (appears in traced graphs).  The
    layer passes the state it was built with (no lookup at run time)."""
    if st.world_size == 1:
        return x
    out = c10d_functional().all_reduce(x, "sum", st.group_name)
    return c10d_functional().wait_tensor(out)


def all_gather_last_dim(x: torch.Tensor, st: TPState) -> torch.Tensor:
    """Concatenate every rank's ``x [N, C]`` along the last dim -> ``[N, world * C]``."""
    if st.world_size == 1:
        return x
    n = st.world_size
    out = c10d_functional().all_gather_into_tensor(x.contiguous(), n, st.group_name)
    out = c10d_functional().wait_tensor(out)  # [world * N, C]
    return out.view(n, x.shape[0], x.shape[1]).permute(1, 0, 2).reshape(x.shape[0], -1)
