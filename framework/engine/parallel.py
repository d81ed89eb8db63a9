"""Tensor-parallel execution: N processes, one process group, rank 0 drives.

``LLM(..., tensor_parallel_size=N)`` calls :func:`start_tensor_parallel`, which either uses
the ranks that already exist (a process group is initialized, or ``torchrun`` set
``RANK``/``WORLD_SIZE``) or spawns ranks 1..N-1 with ``torch.multiprocessing`` (spawn) while
the calling process becomes rank 0.  One process group: gloo on CPU, NCCL on CUDA.

Every rank then builds the same ``LLM`` -- its shard of the model (``framework.core.
parallel_state`` tells the layers how to split), its shard of the KV cache (by heads), its own
compiled forward and artifact cache (``rank_<r>``) -- and runs start-up (warm-up compiles) in
lockstep, since start-up is deterministic.  After start-up rank 0 schedules; every step it
broadcasts what the step needs (per chunk: tokens, positions, block ids) and the workers run
the same forward (their sampler is a no-op: rank 0 samples from the all-gathered logits).

Under ``torchrun`` every rank runs the user's script: ranks other than 0 serve rank 0's
steps inside ``LLM(...)`` and, when rank 0 closes its LLM, leave the group and exit the
process (status 0), so the code after ``LLM(...)`` runs on rank 0 only.

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
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from framework.core.parallel_state import TPState, divide, kv_head_layout, set_tp_state
from framework.engine.tp_messages import chunk_from_msg, chunk_msg
from models.config import ModelConfig, read_hf_config

logger = logging.getLogger(__name__)

FAIL_HOOK_ENV = "PIECEWISE_TP_FAIL"
_ACTIVE: list["TPGroup"] = []
"""The group this process leads as rank 0 and still holds (at most one)."""
_SPAWNED_RANK: list[int] = []
"""Set in a worker process this module spawned: its rank."""
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


def start_tensor_parallel(n: int, llm_args: dict[str, Any], llm_cls: type) -> Optional["TPGroup"]:
    """None for ``n == 1``; else this process's handle in an ``n``-rank group."""
    if check_tp_size(n) == 1:
        return None
    check_shardable(llm_args["model"], n)
    device = str(llm_args.get("device") or "cpu")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    for old in list(_ACTIVE):  # one group per process: a new TP LLM retires the previous one
        logger.warning("tensor parallel: closing the previous LLM's group for a new one")
        old.close()
    if dist.is_initialized() or "WORLD_SIZE" in os.environ:
        return _join_existing(n, backend)
    return _spawn(n, backend, llm_cls, llm_args)


def _join_existing(n: int, backend: str) -> "TPGroup":
    """The ranks exist already: an initialized group, or ``torchrun``'s environment."""
    owns = not dist.is_initialized()
    if owns:
        if int(os.environ["WORLD_SIZE"]) != n:  # before the rendezvous, which would wait
            raise ValueError(
                f"LLM.tensor_parallel_size={n} but torchrun started "
                f"{os.environ['WORLD_SIZE']} ranks (--nproc-per-node must match)"
            )
        dist.init_process_group(backend, timeout=_TIMEOUT)  # torchrun's env:// rendezvous
    if dist.get_world_size() != n:
        raise ValueError(
            f"LLM.tensor_parallel_size={n} but the process group has {dist.get_world_size()} ranks"
        )
    device = None
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    spawned = bool(_SPAWNED_RANK)  # a worker of _spawn: its entry point owns the group
    return TPGroup(
        dist.get_rank(), n, workers=[], errors=None, owns_group=owns, device=device, spawned=spawned
    )


def _spawn(n: int, backend: str, llm_cls: type, llm_args: dict[str, Any]) -> "TPGroup":
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    fd, path = tempfile.mkstemp(prefix="piecewise-tp-")
    os.close(fd)
    os.unlink(path)  # FileStore creates it; a stale file would hold old keys
    init = f"file://{path}"
    threads = max(1, torch.get_num_threads() // n)
    workers = []
    for rank in range(1, n):
        p = ctx.Process(
            target=_worker_main,
            args=(rank, n, backend, init, llm_cls, llm_args, errors, threads),
            name=f"piecewise-tp-rank{rank}",
            daemon=True,  # never outlive rank 0
        )
        p.start()
        workers.append(p)
    group = TPGroup(
        0, n, workers=workers, errors=errors, owns_group=True, store_path=path, spawned=True
    )
    try:
        dist.init_process_group(backend, init_method=init, rank=0, world_size=n, timeout=_TIMEOUT)
    except BaseException as e:
        group.fail(e)
    return group


def _worker_main(rank, n, backend, init, llm_cls, llm_args, errors, threads) -> None:
    """Entry point of a spawned rank: join the group, build the same LLM (which serves steps
    from rank 0 until told to stop), leave."""
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no pools in a daemon
    torch.set_num_threads(threads)
    _SPAWNED_RANK.append(rank)
    try:
        dist.init_process_group(
            backend, init_method=init, rank=rank, world_size=n, timeout=_TIMEOUT
        )
        if backend == "nccl":
            torch.cuda.set_device(rank)
            llm_args = {**llm_args, "device": f"cuda:{rank}"}
        llm_cls(**llm_args, tensor_parallel_size=n)  # the class rank 0 was built as
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
    ):
        self.rank, self.world_size = rank, world_size
        self.workers: list = workers
        self.errors = errors
        self.owns_group = owns_group
        self.store_path = store_path
        self.spawned = spawned
        self.device: Optional[str] = device
        """The device this rank must use (torchrun on CUDA: ``cuda:<LOCAL_RANK>``)."""
        self.closed = False
        self.steps = 0
        self._fail_step = _fail_hook(rank)
        if rank == 0:
            atexit.register(self.close)
            _ACTIVE.append(self)

    # -------------------------------------------------------------- set-up
    def activate(self) -> None:
        """Publish rank / world size / group name for the model layers."""
        set_tp_state(TPState(self.rank, self.world_size, dist.group.WORLD.group_name))

    def handshake(self) -> None:
        """Every rank has built its model: fails here (naming the rank) if one could not."""
        self._collective(lambda: dist.barrier())

    def rank_path(self, path: str) -> str:
        """This rank's subfolder of ``path`` (``rank_<r>``, as in the artifact cache)."""
        return os.path.join(path, f"rank_{self.rank}")

    def startup_fail_hook(self) -> None:
        if self._fail_step == "startup":
            raise RuntimeError(f"{FAIL_HOOK_ENV} test hook: rank {self.rank} raises at start-up")

    def attach(self, llm) -> None:
        """End of start-up: rank 0 starts broadcasting steps; other ranks serve them."""
        if self.rank == 0:
            execute = llm.runner.execute

            def driver_execute(chunks, force=None, **kwargs):
                self._broadcast(("step", [chunk_msg(c) for c in chunks], force))

                def step():
                    self._step_fail_hook()
                    return execute(chunks, force, **kwargs)

                return self._collective(step)

            llm.runner.execute = driver_execute
            return
        llm.runner.sampler = _no_sample
        self.serve(llm.runner)
        if not self.spawned:  # torchrun: rank 0 is done with this rank; so is its script
            self._teardown(graceful=True)
            raise _Stopped(0)

    # -------------------------------------------------------------- steps
    def serve(self, runner) -> None:
        while True:
            msg = [None]
            dist.broadcast_object_list(msg, src=0)
            kind, chunks, force = msg[0]
            if kind == "stop":
                return
            self._step_fail_hook()
            runner.execute([chunk_from_msg(m) for m in chunks], force)

    def _step_fail_hook(self) -> None:
        self.steps += 1
        if isinstance(self._fail_step, int) and self.steps >= self._fail_step:
            raise RuntimeError(f"{FAIL_HOOK_ENV} test hook: rank {self.rank} raises")

    def _broadcast(self, msg) -> None:
        self._collective(lambda: dist.broadcast_object_list([msg], src=0))

    def _collective(self, fn: Callable):
        if self.closed:
            raise TensorParallelError("the tensor-parallel group is closed (LLM.close() ran)")
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
        worker; a spawned worker re-raises its own error (reported by its entry point)."""
        if isinstance(cause, TensorParallelError):  # named already (by a collective)
            if not self.closed:
                self._teardown(graceful=False)
            raise cause
        if self.spawned and self.rank != 0:
            raise cause
        if not isinstance(cause, Exception):  # KeyboardInterrupt, SystemExit: stop, pass on
            self._teardown(graceful=False)
            raise cause
        # A collective that failed because a peer left: wait for that peer's report.  Any
        # other exception is this rank's own: take only a report that is already there.
        collective = _is_collective_error(cause)
        failed = self._first_error(wait_s=10.0 if collective else 0.5)
        self._teardown(graceful=False)
        if failed is not None:
            rank, tb = failed
            raise TensorParallelError(
                f"tensor parallel rank {rank} failed:\n{tb.rstrip()}"
            ) from None
        if collective:
            raise TensorParallelError(
                f"tensor parallel: a collective failed on rank {self.rank} "
                f"({type(cause).__name__}: {cause}); no other rank reported an error"
            ) from cause
        tb = "".join(traceback.format_exception(cause)).rstrip()
        raise TensorParallelError(f"tensor parallel rank {self.rank} failed:\n{tb}") from cause

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
                    return dead[0], f"exited with code {self.workers[dead[0] - 1].exitcode}"
        return None

    def close(self) -> None:
        """Rank 0: tell the workers to stop, join them, destroy the group (idempotent)."""
        if self.closed or self.rank != 0:
            return
        self._teardown(graceful=True)

    def _teardown(self, graceful: bool) -> None:
        self.closed = True
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
        set_tp_state(TPState())
        if self.store_path and os.path.exists(self.store_path):
            os.unlink(self.store_path)
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


def _no_sample(logits, reqs):
    return [0] * len(reqs), None
