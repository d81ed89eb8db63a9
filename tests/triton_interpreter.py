"""Running Triton kernel tests under the interpreter without touching the test process.

Triton decides between interpreter and compiler when ``triton.language`` is first imported
(its standard library is ``@triton.jit``-decorated at import; ``torch._inductor`` imports
triton early).  So no test sets ``TRITON_INTERPRET`` in its own process: a CPU kernel test
module runs its kernel tests in place only when the process *already* runs the interpreter
(or on CUDA, compiled), and otherwise one test reruns the module in a child pytest process
whose environment has ``TRITON_INTERPRET=1`` from the start.  GPU tests collected in the same
session therefore never see interpreted Triton (``scripts/gpu_check.sh`` checks this).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

KERNEL_MARK = "triton_kernel"
"""Marker of the tests that launch Triton kernels in place (``scripts/gpu_check.sh`` runs them
compiled on CUDA; on CPU they run in the interpreter child process)."""


def language_is_interpreted() -> bool:
    """Whether this process's ``triton.language`` was built for the interpreter."""
    if "triton.language" not in sys.modules:
        return os.environ.get("TRITON_INTERPRET", "0") == "1"
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


def fix_interpreter_scalar_index() -> bool:
    """Triton 3.6's interpreter (the GPU image's Triton, on CPU) turns a scalar -- a 1-element
    array there -- into a Python int with ``int(array)``, which NumPy >= 2.5 refuses ("only
    0-dimensional arrays can be converted to Python scalars"): every kernel whose loop bounds
    are computed values fails.  Triton 3.9 squeezes the array first; this gives 3.6 the same
    ``__index__``.  Interpreter only (compiled kernels never run this code); returns whether
    it patched."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton.runtime.interpreter as interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "squeezes_index", False):
        return False

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor.squeezes_index = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True


ON_GPU = torch.cuda.is_available()
KERNELS_RUN_HERE = ON_GPU or language_is_interpreted()
"""Kernel tests run in this process: compiled on CUDA, or in an interpreter process."""

kernel_test = pytest.mark.skipif(
    not KERNELS_RUN_HERE,
    reason="CPU process without the Triton interpreter: test_in_interpreter reruns these "
    "tests in a child process with TRITON_INTERPRET=1",
)
"""Decorator for a kernel test (skipped here when it runs in the child process instead)."""


def run_module_in_interpreter(
    module_file: str,
    request: pytest.FixtureRequest,
    timeout: float = 600,
    marker: str = KERNEL_MARK,
) -> str:
    """Run the tests marked ``marker`` of ``module_file`` in a fresh pytest process under the
    Triton interpreter; fail with its output unless every one of them passed."""
    module = Path(module_file).resolve()
    expected = sum(
        1
        for item in request.session.items
        if Path(str(item.fspath)).resolve() == module
        and item.get_closest_marker(marker) is not None
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker, str(module)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, out
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    passed = re.search(r"(\d+) passed", summary)
    assert passed, out
    assert not re.search(r"\d+ (failed|error)", summary), out
    # Every kernel test this session collected from the module ran (and none was skipped
    # because the child was not interpreted after all).
    assert int(passed.group(1)) >= max(expected, 1), out
    assert "skipped" not in summary, out
    return proc.stdout
