"""Session-wide fixtures: one tiny random HF checkpoint per model family, built once."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Test helpers (checkpoints.py, paged_harness.py) import as top-level modules whatever the
# pytest import mode.
sys.path.insert(0, os.path.dirname(__file__))

from checkpoints import FAMILIES, MOE_FAMILIES, build_family_checkpoint  # noqa: E402
from triton_interpreter import (  # noqa: E402
    KERNEL_MARK,
    fix_interpreter_scalar_index,
    language_is_interpreted,
)

fix_interpreter_scalar_index()  # only under TRITON_INTERPRET=1 (a CPU kernel-test child)

# The server's tests need its stack (the `serve` extra: fastapi, uvicorn, openai), which the
# GPU image lacks: there they are not collected (what the GPU check collects, the dry run too).
try:
    import fastapi  # noqa: F401
    import openai  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError:
    collect_ignore = ["framework/serve"]

GPU_CHECK_ENV = "PIECEWISE_GPU_CHECK"
"""Set by scripts/gpu_check.sh: the collection guard below then reports what it checked."""
_INTERPRET_AT_START = os.environ.get("TRITON_INTERPRET")


def _limit_worker_threads(config) -> None:
    """Under pytest-xdist (``make test`` runs ``-n 2``) each worker computes with its share of
    the cores, and so do the processes its tests start (they inherit ``OMP_NUM_THREADS``):
    two workers on two cores run one thread each instead of four threads fighting over two."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:
        share = max(1, (os.cpu_count() or 1) // int(workers))
        torch.set_num_threads(share)
        os.environ["OMP_NUM_THREADS"] = str(share)


def pytest_configure(config):
    _limit_worker_threads(config)
    config.addinivalue_line(
        "markers",
        f"{KERNEL_MARK}: launches Triton kernels in the test process (compiled on "
        "CUDA; on CPU rerun under the interpreter in a child process)",
    )
    config.addinivalue_line(
        "markers",
        "triton_interpreted: CPU test that needs the Triton interpreter (rerun in "
        "a child process with TRITON_INTERPRET=1)",
    )


def pytest_collection_finish(session):
    """No test may switch this process to interpreted Triton (tests never set process
    environment at import): on CUDA, or under scripts/gpu_check.sh, that would silently run
    the GPU tests with interpreted kernels.  Checked after every module was imported."""
    gpu_check = os.environ.get(GPU_CHECK_ENV) == "1"
    if not gpu_check and not (torch.cuda.is_available() and _INTERPRET_AT_START is None):
        return
    interpret = os.environ.get("TRITON_INTERPRET")
    if interpret is not None or language_is_interpreted():
        raise pytest.UsageError(
            f"TRITON_INTERPRET={interpret!r} after collection (triton.language interpreted: "
            f"{language_is_interpreted()}): GPU tests must run compiled Triton; unset "
            f"TRITON_INTERPRET and find the test module that sets it"
        )
    if gpu_check:
        session.config.pluginmanager.get_plugin("terminalreporter").write_line(
            f"gpu-check collection: {len(session.items)} tests selected, TRITON_INTERPRET "
            f"unset, triton compiled: ok"
        )


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(family) -> Path``: the fp32 ``test-<family>`` checkpoint (seed 0),
    written once per session; family in FAMILIES + MOE_FAMILIES (tests/checkpoints.py)."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in FAMILIES + MOE_FAMILIES:
            raise ValueError(f"unknown family {family!r}; choose from {FAMILIES + MOE_FAMILIES}")
        if family not in built:
            root = tmp_path_factory.mktemp(f"ckpt-{family}")
            built[family] = build_family_checkpoint(root / family, family)
        return built[family]

    return get


@pytest.fixture(scope="session")
def llama_checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def compile_cache_dir(tmp_path_factory, request) -> str:
    """One artifact-cache root shared by every test that is not about the cache itself, so
    identical configurations compile once per session.  Under pytest-xdist the workers share
    it (the folder above each worker's base temp is the run's): the store lets processes
    compile into one root (one compiles a key, the others load it)."""
    if hasattr(request.config, "workerinput"):
        root = tmp_path_factory.getbasetemp().parent / "piecewise-cache"
        root.mkdir(exist_ok=True)
        return str(root)
    return str(tmp_path_factory.mktemp("piecewise-cache"))


@pytest.fixture
def count_direct_calls(monkeypatch):
    """``count(qualname) -> calls``: for the test, the op's direct kernel
    (``framework.core.ops.direct_kernel``) is wrapped so that each call appends its number of
    arguments to ``calls``; skips where the op library was built without its Python module."""
    from framework.core import ops as core_ops

    def count(qualname: str) -> list[int]:
        kernel = core_ops.direct_kernel(qualname)
        if kernel is None:
            pytest.skip("the op library was built without its Python module")
        calls: list[int] = []

        def counted(*args):
            calls.append(len(args))
            return kernel(*args)

        monkeypatch.setitem(core_ops._DIRECT, qualname, counted)
        return calls

    return count
