"""Where Inductor and Triton keep their own caches while a job runs, and paying the
compiler's one-time process start-up before a job's cold start is timed."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch

from framework.compat import dynamo as compat_dynamo
from framework.compat import inductor as compat_inductor


@contextmanager
def compiler_caches_under(cache_dir: Optional[str]):
    """Point Inductor's and Triton's own on-disk caches (FX graphs, generated code, compiled
    kernels) into ``cache_dir`` while the job runs, and drop Inductor's in-memory caches of
    earlier jobs in this process (the basic launcher runs a whole sweep in one process, joblib
    reuses its workers), so a fresh ``cache_dir`` means a cold compile and not a hit in a cache
    an earlier job filled. ``None``: untouched."""
    if cache_dir is None:
        yield
        return
    saved = {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(cache_dir).resolve() / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(Path(cache_dir).resolve() / "triton")
    compat_inductor.clear_caches()
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_compiler_warmed_up = False


def warm_up_compiler() -> Optional[float]:
    """Pay Inductor's one-time start-up of this process (imports, C++ toolchain probing; ~10 s
    on a small CPU, whatever the model) on a throw-away function and cache, so ``cold_s``
    measures the model's own trace + compile and is comparable between the first compiling
    job of an in-process sweep and the later ones (or a job alone in its process). Returns
    the seconds spent, None when this process already paid it."""
    global _compiler_warmed_up
    if _compiler_warmed_up:
        return None
    import tempfile

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, compiler_caches_under(tmp):
        fn = torch.compile(
            lambda x, w: torch.nn.functional.silu(x @ w) * x.sum(-1, True),
            dynamic=True,
            fullgraph=True,
        )
        fn(torch.randn(8, 16), torch.randn(16, 16))
        compat_dynamo.reset()
        compat_inductor.clear_caches()  # nothing of the throw-away compile may serve the job
    _compiler_warmed_up = True
    return time.perf_counter() - t0
