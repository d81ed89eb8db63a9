"""Multi-process test helpers that cannot hang CI: every child runs under a deadline and is
killed (with everything it started) when the deadline passes, and the test fails instead.

``run_ranks(fn, world, ...)`` runs ``fn(rank, world)`` on ``world`` spawned gloo ranks (CPU).
``run_script(args, ...)`` runs a Python command line in its own process group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(fn: Callable, rank: int, world: int, init: str, errors) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        fn(rank, world)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[[int, int], None], world: int = 2, timeout_s: float = 120) -> None:
    """Run ``fn(rank, world)`` on ``world`` spawned processes joined in one gloo group; fail
    the test naming the rank that raised, or the ranks still running after ``timeout_s``
    (a deadlock), after killing them.  ``fn`` must be importable (module level)."""
    fd, path = tempfile.mkstemp(prefix="pg-harness-")
    os.close(fd)
    os.unlink(path)
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world, f"file://{path}", errors), daemon=True)
        for r in range(world)
    ]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        failed = []
        while not errors.empty():
            failed.append(errors.get())
        if failed:
            rank, tb = failed[0]
            pytest.fail(f"rank {rank} raised:\n{tb}")
        if hung:
            pytest.fail(f"ranks {hung} still running after {timeout_s:.0f} s (deadlock?)")
        codes = [p.exitcode for p in procs]
        assert codes == [0] * world, f"exit codes {codes}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if os.path.exists(path):
            os.unlink(path)


def run_script(
    args: list[str], timeout_s: float, env: Optional[dict] = None, cwd: Optional[str] = None
) -> subprocess.CompletedProcess:
    """``python *args`` in a new session; on timeout the whole process group is killed and the
    test fails with the output so far."""
    proc = subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{args} still running after {timeout_s:.0f} s (killed):\n{out[-4000:]}")
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, None)
    done.pid = proc.pid  # the process group's id too (a new session)
    return done


def group_alive(pgid: int) -> bool:
    """Whether any process of process group ``pgid`` still runs."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
