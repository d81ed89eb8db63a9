"""Tensor-parallel execution: N processes, one process group, rank 0 drives.

``LLM(..., tensor_parallel_size=N)`` calls :func:`start_tensor_parallel`, which either uses
the ranks that already exist (a process group is initialized, or ``torchrun`` set
``RANK``/``WORLD_SIZE``) or spawns ranks 1..N-1 with ``torch.multiprocessing`` (spawn) while
the calling process becomes rank 0.  One process group: gloo on CPU, NCCL on CUDA.

Every rank then builds the same :class:`framework.engine.worker.Worker` -- its shard of the
model (the group's :class:`TPState`, scoped to the build, tells the layers how to split), its
shard of the KV cache (by heads), its own compiled forward and artifact cache (``rank_<r>``)
-- and runs start-up (warm-up compiles) in lockstep, since start-up is deterministic.  After
start-up rank 0's engine core schedules and calls its executor
(:class:`framework.engine.executor.TensorParallelExecutor`), which broadcasts what each step
needs (per chunk: tokens, positions, block ids) and runs rank 0's worker; the other ranks
run :func:`framework.engine.executor.worker_loop` (their runner samples nothing: rank 0
samples from the all-gathered logits).

The group belongs to the engine that asked for it: its state is never process-global, so an
``LLM`` built without tensor parallelism next to it is rank 0 of 1 and joins nothing.  A
process holds one default process group, so one tensor-parallel ``LLM`` leads ranks at a
time: building another closes the previous one's group (with a warning; using the old one
afterwards says so).

Start-up watches the workers: while rank 0 waits for them at the rendezvous, a worker that
exits ends start-up within a second with its stderr tail (and, for Python's bootstrapping
error of a script without ``if __name__ == "__main__":``, says to guard the script).  The
rendezvous file (``piecewise-tp-*`` in the temp directory) is removed on every exit path,
SIGTERM included (:mod:`framework.engine.tp_processes`: the workers' stderr, the rendezvous
files and the SIGTERM handler).

Under ``torchrun`` every rank runs the user's script: ranks other than 0 run the worker loop
from ``LLM(...)`` and, when rank 0 closes its LLM, leave the group and exit the process
(status 0), so the code after ``LLM(...)`` runs on rank 0 only.

Shutdown: ``LLM.close()`` (also at interpreter exit) broadcasts a stop message, joins the
workers and destroys the group.  Failures, at start-up (any level) or in a step, end with one
:class:`TensorParallelError` naming the rank that failed with its traceback, and no process
left: a spawned worker that raises reports ``(rank, traceback)`` on a queue and exits; rank 0
fails at its next collective (the peer closed) or on its own error, and everything it raised
between ``start_tensor_parallel`` and the end of start-up (:func:`startup_guard`) or in a
step goes through :meth:`TPGroup.fail`, which finds the failed rank, stops every worker and
raises the error.  Under ``torchrun`` a rank raises its own error and the launcher stops the
others.

Test hook: ``PIECEWISE_TP_FAIL=<rank>:<step>`` makes that rank raise at that served step
(workers), or, with ``<step>`` = ``startup``, after the start-up handshake, just before the
warm-up compile (any rank).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing import resource_tracker as mp_resource_tracker
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from framework.core.parallel_state import TPState, divide, kv_head_layout
from framework.engine.tp_messages import chunk_from_msg, chunk_msg
from framework.engine.tp_processes import StderrTail, new_store_file, remove_store_file
from models.config import ModelConfig, read_hf_config

if TYPE_CHECKING:
    from framework.engine.worker import Worker

logger = logging.getLogger(__name__)

FAIL_HOOK_ENV = "PIECEWISE_TP_FAIL"
_ACTIVE: list["TPGroup"] = []
"""The group this process leads as rank 0 and still holds (at most one: a process has one
default process group, a process-wide resource; this list mirrors it)."""
_SPAWNED_RANK: list[int] = []
"""Set in a worker process this module spawned: its rank."""
BOOTSTRAP_HINT = (
    'guard the script\'s entry point with `if __name__ == "__main__":` -- tensor parallelism '
    "spawns worker processes that import the main module, and an unguarded script starts "
    "the LLM again in each of them"
)
_TIMEOUT = timedelta(seconds=int(os.environ.get("PIECEWISE_TP_TIMEOUT_S", "300")))


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed; the message names it and carries its traceback."""


def check_tp_size(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"LLM.tensor_parallel_size: must be a positive int, got {n!r}")
    return n


def check_shardable(model_dir, n: int) -> None:
    """Refuse a size the model cannot be split by before any process starts."""
    source = str(Path(model_dir) / "config.json")
    mc = ModelConfig.from_hf_dict(read_hf_config(model_dir), source=source)
    divide(mc.num_heads, n, "num_attention_heads")
    divide(mc.intermediate_size, n, "intermediate_size")
    kv_head_layout(mc.num_kv_heads, n)


def start_tensor_parallel(n: int, llm_args: dict[str, Any]) -> Optional["TPGroup"]:
    """None for ``n == 1``; else this process's handle in an ``n``-rank group."""
    if check_tp_size(n) == 1:
        return None
    check_shardable(llm_args["model"], n)
    device = str(llm_args.get("device") or "cpu")
    dist_backend = "nccl" if device.startswith("cuda") else "gloo"
    for old in list(_ACTIVE):  # one group per process: a new TP LLM retires the previous one
        logger.warning("tensor parallel: closing the previous LLM's group for a new one")
        old.close(
            reason="another tensor-parallel LLM was built in this process, and a process "
            "holds one process group: build it again to use it"
        )
    if dist.is_initialized() or "WORLD_SIZE" in os.environ:
        return _join_existing(n, dist_backend)
    return _spawn(n, dist_backend, llm_args)


def _join_existing(n: int, dist_backend: str) -> "TPGroup":
    """The ranks exist already: an initialized group, or ``torchrun``'s environment."""
    owns = not dist.is_initialized()
    if owns:
        if int(os.environ["WORLD_SIZE"]) != n:  # before the rendezvous, which would wait
            raise ValueError(
                f"LLM.tensor_parallel_size={n} but torchrun started "
                f"{os.environ['WORLD_SIZE']} ranks (--nproc-per-node must match)"
            )
        dist.init_process_group(dist_backend, timeout=_TIMEOUT)  # torchrun's env:// rendezvous
    if dist.get_world_size() != n:
        raise ValueError(
            f"LLM.tensor_parallel_size={n} but the process group has {dist.get_world_size()} ranks"
        )
    device = None
    if dist_backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    spawned = bool(_SPAWNED_RANK)  # a worker of _spawn: its entry point owns the group
    return TPGroup(
        dist.get_rank(), n, workers=[], errors=None, owns_group=owns, device=device, spawned=spawned
    )


def _live_workers() -> list:
    """The worker processes of this process's live groups (what SIGTERM stops)."""
    return [p for group in _ACTIVE for p in group.workers]


def _spawn(n: int, dist_backend: str, llm_args: dict[str, Any]) -> "TPGroup":
    ctx = mp.get_context("spawn")
    errors, ready = ctx.Queue(), ctx.Queue()
    path = new_store_file(_live_workers)
    init = f"file://{path}"
    threads = max(1, torch.get_num_threads() // n)
    workers, tails = [], []
    # The resource tracker (started by the first spawn) must not inherit a worker's pipe.
    mp_resource_tracker.ensure_running()
    try:
        for rank in range(1, n):
            p = ctx.Process(
                target=_worker_main,
                args=(rank, n, dist_backend, init, llm_args, errors, ready, threads),
                name=f"piecewise-tp-rank{rank}",
                daemon=True,  # never outlive rank 0
            )
            tail = StderrTail(rank)
            with tail.as_stderr():
                p.start()
            tail.start()
            workers.append(p)
            tails.append(tail)
    except BaseException:  # no worker, no file left behind
        for p in workers:
            p.kill()
            p.join()
        remove_store_file(path)
        raise
    group = TPGroup(
        0,
        n,
        workers=workers,
        errors=errors,
        owns_group=True,
        store_path=path,
        spawned=True,
        stderr_tails=tails,
    )
    try:
        group.wait_for_workers(ready)
        dist.init_process_group(
            dist_backend, init_method=init, rank=0, world_size=n, timeout=_TIMEOUT
        )
    except BaseException as e:
        group.fail(e)
    return group


def _worker_main(rank, n, dist_backend, init, llm_args, errors, ready, threads) -> None:
    """Entry point of a spawned rank: join the group, build this rank's worker, run the
    worker loop until rank 0 says stop, leave."""
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no pools in a daemon
    torch.set_num_threads(threads)
    torch.manual_seed(llm_args.get("seed", 0))  # as LLM(...) seeds rank 0
    _SPAWNED_RANK.append(rank)
    try:
        ready.put(rank)  # imported and running: rank 0 stops watching for an early exit
        dist.init_process_group(
            dist_backend, init_method=init, rank=rank, world_size=n, timeout=_TIMEOUT
        )
        device = None
        if dist_backend == "nccl":
            torch.cuda.set_device(rank)
            device = f"cuda:{rank}"
        group = TPGroup(
            rank, n, workers=[], errors=None, owns_group=False, spawned=True, device=device
        )
        from framework.engine.executor import worker_loop
        from framework.engine.worker import Worker

        worker = Worker(**llm_args, group=group)
        worker_loop(group, worker)
    except BaseException:
        tb = traceback.format_exc()
        print(f"[tensor parallel rank {rank}] {tb}", file=sys.stderr, flush=True)
        errors.put((rank, tb))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def startup_guard(group: Optional["TPGroup"]) -> Iterator[None]:
    """Around a rank's start-up: any exception becomes :meth:`TPGroup.fail`'s one error."""
    if group is None:
        yield
        return
    try:
        yield
    except _Stopped:
        raise
    except BaseException as e:
        group.fail(e)


class _Stopped(SystemExit):
    """A torchrun rank > 0 served until rank 0 closed: its process ends here (status 0)."""


def run_torchrun_worker(group: "TPGroup", worker: "Worker") -> None:
    """A torchrun rank other than 0 (every rank runs the user's script): run the worker
    loop until rank 0 closes, leave the group and end the process (status 0), so the code
    after ``LLM(...)`` runs on rank 0 only."""
    from framework.engine.executor import worker_loop

    worker_loop(group, worker)
    group._teardown(graceful=True)
    raise _Stopped(0)


class TPGroup:
    """One rank's view of the tensor-parallel group (see the module docstring).

    ``spawned``: this process started the group and its workers (rank 0 of a spawn), or is
    one of those workers; otherwise the ranks came from torchrun (or a group that existed).
    ``owns_group``: this process initialized the group (and destroys it on close)."""

    def __init__(
        self,
        rank,
        world_size,
        *,
        workers,
        errors,
        owns_group,
        store_path=None,
        spawned=False,
        device=None,
        stderr_tails=(),
    ):
        self.rank, self.world_size = rank, world_size
        self.workers: list = workers
        self.errors = errors
        self.owns_group = owns_group
        self.store_path = store_path
        self.spawned = spawned
        self.device: Optional[str] = device
        """The device this rank must use (torchrun on CUDA: ``cuda:<LOCAL_RANK>``)."""
        self.stderr_tails: list[StderrTail] = list(stderr_tails)
        self.closed = False
        self.closed_reason = "LLM.close() ran"
        """Why the group closed: what using it afterwards says (a failure, or close)."""
        self.steps = 0
        self._fail_step = _fail_hook(rank)
        if rank == 0:
            atexit.register(self.close)
            _ACTIVE.append(self)

    # -------------------------------------------------------------- set-up
    @property
    def state(self) -> TPState:
        """Rank / world size / group name: what this group's worker builds and runs under."""
        return TPState(self.rank, self.world_size, dist.group.WORLD.group_name)

    def wait_for_workers(self, ready) -> None:
        """Rank 0, before the rendezvous: wait until every worker process runs, ending at
        once (with its stderr tail) when one exits instead."""
        pending = set(range(1, self.world_size))
        deadline = time.monotonic() + _TIMEOUT.total_seconds()
        while pending:
            try:
                pending.discard(ready.get(timeout=0.1))
                continue
            except queue.Empty:
                pass
            for rank in sorted(pending):
                code = self.workers[rank - 1].exitcode
                if code is not None:
                    raise _WorkerExited(rank, code)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"tensor parallel: ranks {sorted(pending)} did not start within "
                    f"{_TIMEOUT.total_seconds():.0f} s (PIECEWISE_TP_TIMEOUT_S)"
                )

    def stderr_tail(self, rank: int) -> str:
        if not (1 <= rank <= len(self.stderr_tails)):
            return ""
        return self.stderr_tails[rank - 1].text()

    def handshake(self) -> None:
        """Every rank has built its model: fails here (naming the rank) if one could not."""
        self.collective(lambda: dist.barrier())

    def rank_path(self, path: str) -> str:
        """This rank's subfolder of ``path`` (``rank_<r>``, as in the artifact cache)."""
        return os.path.join(path, f"rank_{self.rank}")

    def startup_fail_hook(self) -> None:
        if self._fail_step == "startup":
            raise RuntimeError(f"{FAIL_HOOK_ENV} test hook: rank {self.rank} raises at start-up")

    # -------------------------------------------------------------- steps
    def broadcast_step(self, chunks, force=None) -> None:
        """Rank 0: what the workers need to run the same step."""
        dist.broadcast_object_list([("step", [chunk_msg(c) for c in chunks], force)], src=0)

    def receive_step(self):
        """A worker rank: the next step's chunks and forced graph mode; None for stop."""
        msg = [None]
        dist.broadcast_object_list(msg, src=0)
        kind, chunks, force = msg[0]
        if kind == "stop":
            return None
        return [chunk_from_msg(m) for m in chunks], force

    def step_fail_hook(self) -> None:
        self._step_fail_hook()

    def _step_fail_hook(self) -> None:
        self.steps += 1
        if isinstance(self._fail_step, int) and self.steps >= self._fail_step:
            raise RuntimeError(f"{FAIL_HOOK_ENV} test hook: rank {self.rank} raises")

    def collective(self, fn: Callable):
        """Run ``fn`` (collectives); on rank 0 any failure becomes :meth:`fail`'s error."""
        if self.closed:
            raise TensorParallelError(f"the tensor-parallel group is closed: {self.closed_reason}")
        try:
            return fn()
        except TensorParallelError:
            raise
        except BaseException as e:
            if self.rank != 0:
                raise
            self.fail(e)

    # -------------------------------------------------------------- shutdown
    def fail(self, cause: BaseException):
        """Raise one error naming the failed rank with its traceback.  Rank 0 (and a torchrun
        rank) first finds which rank failed -- a worker's report, or itself -- and stops every
        worker; a spawned worker re-raises its own error (reported by its entry point).
        Using the group afterwards repeats this cause, not "closed"."""
        if isinstance(cause, TensorParallelError):  # named already (by a collective)
            if not self.closed:
                self._teardown(graceful=False, reason=f"it stopped after a failure: {cause}")
            raise cause
        if self.spawned and self.rank != 0:
            raise cause
        if not isinstance(cause, Exception):  # KeyboardInterrupt, SystemExit: stop, pass on
            self._teardown(graceful=False, reason=f"it stopped on {type(cause).__name__}")
            raise cause
        error = self._failure(cause)
        self._teardown(graceful=False, reason=f"it stopped after a failure: {error}")
        if error.__cause__ is None:
            raise error from None
        raise error

    def _failure(self, cause: BaseException) -> TensorParallelError:
        if isinstance(cause, _WorkerExited):  # before the rendezvous: no report, its stderr
            try:  # a report from its entry point (it got that far), else its stderr
                rank, tb = self.errors.get(timeout=0.5)
                return TensorParallelError(f"tensor parallel rank {rank} failed:\n{tb}")
            except queue.Empty:
                pass
            tail = self.stderr_tail(cause.rank).rstrip()
            msg = (
                f"tensor parallel rank {cause.rank} failed: its process exited with code "
                f"{cause.code} during start-up, before joining the group"
            )
            if "bootstrapping phase" in tail or "freeze_support" in tail:
                msg += f".\nFix: {BOOTSTRAP_HINT}"
            msg += f".\nIts stderr ends with:\n{tail}" if tail else " (it wrote no stderr)"
            return TensorParallelError(msg)
        # A collective that failed because a peer left: wait for that peer's report.  Any
        # other exception is this rank's own: take only a report that is already there.
        collective = _is_collective_error(cause)
        failed = self._first_error(wait_s=10.0 if collective else 0.5)
        if failed is not None:
            rank, tb = failed
            return TensorParallelError(f"tensor parallel rank {rank} failed:\n{tb.rstrip()}")
        if collective:
            err = TensorParallelError(
                f"tensor parallel: a collective failed on rank {self.rank} "
                f"({type(cause).__name__}: {cause}); no other rank reported an error"
            )
            err.__cause__ = cause
            return err
        tb = "".join(traceback.format_exception(cause)).rstrip()
        err = TensorParallelError(f"tensor parallel rank {self.rank} failed:\n{tb}")
        err.__cause__ = cause
        return err

    def _first_error(self, wait_s: float):
        if self.errors is None:  # torchrun: the launcher reports the other ranks
            return None
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                return self.errors.get(timeout=0.2)
            except queue.Empty:
                pass
            dead = [i + 1 for i, p in enumerate(self.workers) if p.exitcode not in (None, 0)]
            if dead and all(p.exitcode is not None for p in self.workers):
                try:
                    return self.errors.get(timeout=1.0)
                except queue.Empty:
                    rank = dead[0]
                    tail = self.stderr_tail(rank).rstrip()
                    code = self.workers[rank - 1].exitcode
                    return rank, f"exited with code {code}" + (
                        f"; its stderr ends with:\n{tail}" if tail else ""
                    )
        return None

    def close(self, reason: str = "LLM.close() ran") -> None:
        """Rank 0: tell the workers to stop, join them, destroy the group (idempotent)."""
        if self.closed or self.rank != 0:
            return
        self._teardown(graceful=True, reason=reason)

    def _teardown(self, graceful: bool, reason: str = "LLM.close() ran") -> None:
        self.closed = True
        self.closed_reason = reason
        if graceful and self.rank == 0 and dist.is_initialized():
            try:
                dist.broadcast_object_list([("stop", [], None)], src=0)
            except Exception as e:  # a worker is gone already; terminate below
                logger.warning("tensor parallel: stop message failed (%s)", e)
        for p in self.workers:
            p.join(timeout=30 if graceful else 2)
        for p in self.workers:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        if self.store_path:
            remove_store_file(self.store_path)
        atexit.unregister(self.close)
        if self in _ACTIVE:
            _ACTIVE.remove(self)


def _is_collective_error(e: BaseException) -> bool:
    """A process-group error (a peer closed, a timeout).  Gloo raises a plain RuntimeError
    whose message names its source file (``third_party/gloo/...``); NCCL a DistBackendError."""
    return isinstance(e, dist.DistError) or "gloo" in str(e).lower()


def _fail_hook(rank: int) -> Union[int, str, None]:
    """``PIECEWISE_TP_FAIL=<rank>:<step>``: this rank's served step to raise at, or
    ``"startup"``; None when the hook is unset or names another rank."""
    spec = os.environ.get(FAIL_HOOK_ENV)
    if not spec:
        return None
    r, _, step = spec.partition(":")
    if int(r) != rank:
        return None
    return "startup" if step == "startup" else int(step or 1)


class _WorkerExited(RuntimeError):
    """A spawned worker process ended before it joined the group."""

    def __init__(self, rank: int, code: int):
        super().__init__(f"tensor parallel rank {rank} exited with code {code} at start-up")
        self.rank, self.code = rank, code
