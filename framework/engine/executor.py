"""Executors: what the engine core calls to run one scheduled step.

The core (``framework.engine.core``) schedules and hands each step's chunks to an
:class:`Executor`; the executor runs them on its workers (``framework.engine.worker``) and
returns the sampled tokens, the sampling rows' logits and their logprobs.

* :class:`InProcessExecutor` -- one worker in this process (no tensor parallelism).
* :class:`TensorParallelExecutor` -- rank 0 of a tensor-parallel group: every step it
  broadcasts the chunks to the other ranks, which run :func:`worker_loop` in their own
  processes (each owns a worker: its shard, its runner), and runs rank 0's worker; any rank's
  failure becomes one :class:`framework.engine.parallel.TensorParallelError`.

Both expose rank 0's worker as ``worker`` (the model, runner, compiled forward and stats of
this process).
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch

from framework.engine.parallel import TPGroup
from framework.engine.request import ScheduledChunk
from framework.engine.worker import Worker

StepResult = tuple[list[Optional[int]], torch.Tensor, Optional[list]]
"""(sampled token per chunk -- None mid-prompt --, logits of the sampling chunks, their
logprobs per sampling chunk or None)."""


class Executor(Protocol):
    worker: Worker
    """This process's worker (rank 0 under tensor parallelism)."""

    def execute(self, chunks: list[ScheduledChunk]) -> StepResult: ...

    def close(self) -> None: ...


class InProcessExecutor:
    """One worker, in this process."""

    def __init__(self, worker: Worker):
        self.worker = worker

    def execute(self, chunks: list[ScheduledChunk]) -> StepResult:
        sampled, logits = self.worker.execute(chunks)
        return sampled, logits, self.worker.last_logprobs

    def close(self) -> None:
        pass


class TensorParallelExecutor:
    """Rank 0 of ``group``: broadcast each step, run it on rank 0's worker."""

    def __init__(self, group: TPGroup, worker: Worker):
        self.group = group
        self.worker = worker

    def execute(self, chunks: list[ScheduledChunk]) -> StepResult:
        def step():
            self.group.broadcast_step(chunks)
            self.group.step_fail_hook()
            return self.worker.execute(chunks)

        sampled, logits = self.group.collective(step)
        return sampled, logits, self.worker.last_logprobs

    def close(self) -> None:
        self.group.close()


def worker_loop(group: TPGroup, worker: Worker) -> None:
    """A rank other than 0: run rank 0's steps on this rank's worker until it says stop."""
    while True:
        step = group.receive_step()
        if step is None:
            return
        chunks, force = step
        group.step_fail_hook()
        worker.execute(chunks, force)
