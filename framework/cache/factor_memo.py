"""The Inductor-derived cache-key factors, memoized on disk so a warm start need not import
Inductor to compute its own cache key.

The C++ compiler identity and Inductor's config (``framework.cache.key``) are read through
``torch._inductor``, and importing ``torch._inductor`` imports Dynamo (torch 2.13, ~1.5-4 s).
In a process that has not imported ``torch._inductor`` yet, nothing can have patched its
config, so both factors are a function of torch's build, the environment variables torch and
the compiler read, the compiler binary and the CPUs visible to the process.  Those form the
memo's name; the value is computed once (importing Inductor) and reused by later processes.
Where ``torch._inductor`` is already imported (its config may be patched), the factors are
computed directly and the memo is neither read nor written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from framework.cache.key import _cpp_compiler_identity, inductor_factors
from framework.compat.dynamo import inductor_imported
from framework.core.files import atomic_write_text

logger = logging.getLogger(__name__)

MEMO_DIR = "factor_memo"
_ENV_PREFIXES = (
    "TORCH", "PYTORCH", "INDUCTOR", "TRITON", "CUDA", "ROCM", "HIP", "CXX", "CC", "CPATH",
    "LD_", "LIBRARY_PATH", "CONDA", "PATH", "OMP", "MKL", "KMP", "PYTHON",
)  # fmt: skip


def _memo_name() -> str:
    import torch

    compiler = shutil.which(os.environ.get("CXX", "g++")) or ""
    stat = os.stat(compiler) if compiler else None
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count()
    basis = {
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", None),
        "torch_file": torch.__file__,
        "python": sys.executable,
        "env": {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)},
        "compiler": [os.path.realpath(compiler), stat and stat.st_size, stat and stat.st_mtime_ns]
        if compiler
        else None,
        "cpus": [os.cpu_count(), cpus],
    }
    digest = hashlib.sha256(json.dumps(basis, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:24]


def inductor_side_factors(memo_root: str | Path | None) -> dict[str, Any]:
    """``{"cpp_compiler": ..., "inductor": ...}`` (see ``framework.cache.key``), memoized
    under ``<memo_root>/factor_memo/`` while ``torch._inductor`` is not imported."""

    def compute() -> dict[str, Any]:
        return {"cpp_compiler": _cpp_compiler_identity(), "inductor": inductor_factors()}

    if memo_root is None or inductor_imported():
        return compute()
    path = Path(memo_root) / MEMO_DIR / f"{_memo_name()}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    value = compute()
    try:
        atomic_write_text(path, json.dumps(value, sort_keys=True))
    except OSError as e:  # a read-only or full cache: the memo is only an optimization
        logger.debug("factor memo %s not written: %s", path, e)
    return value
