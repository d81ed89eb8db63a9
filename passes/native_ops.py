"""The C++ CPU kernels of the piecewise linear ops, registered with the torch dispatcher.

``piecewise::packed_linear`` (bf16 small-M), ``int8_packed_linear`` (W8A8) and
``int8_wo_packed_linear`` (int8 weight-only) are defined in Python (schema, fake, and a Python
body as their ``CompositeExplicitAutograd`` kernel).  :func:`load` builds
``csrc/torch_ops.cpp`` against torch's headers (once per machine and torch version, cached
under ``~/.cache/piecewise/kernels`` like every kernel library) and loads it: its
``TORCH_LIBRARY_IMPL(piecewise, CPU, ...)`` block adds a C++ CPU kernel to each op.  From then
on a graph's call of the op goes from the dispatcher straight into C++ -- no Python op body, no
ctypes marshalling; calls the kernels do not take (more rows than the call's ``max_rows``,
other dtypes or layouts) are handed to the op's Python twin ``piecewise::<op>_python``.

Where this Python's headers are installed the library is also a Python module whose functions
are the same C++ kernels; :func:`load` registers them as the ops' direct calls
(``framework.core.ops.direct_call``), which the lean pieces call without the dispatcher.

The registration is process-wide (like the ops themselves), and changes no result: the C++
kernel computes what the Python body computes.  The engine's model preparation calls
:func:`load` when it re-lays a weight for a kernel; where the library cannot be built (no
compiler, no torch headers) the Python bodies run, with one logged warning.
``PIECEWISE_NATIVE_OPS_PORTABLE=1`` forces the portable build.
"""

from __future__ import annotations

import ctypes
import functools

from framework.core.native_build import TorchOpLibrary
from passes.int8_small_m import CSRC

LIBRARY = TorchOpLibrary(
    "piecewise_ops",
    CSRC / "torch_ops.cpp",
    portable_env="PIECEWISE_NATIVE_OPS_PORTABLE",
    extra_flags=("-ffp-contract=off",),
    python_module="piecewise_ops",
    depends=(
        CSRC / "small_m_linear.cpp",
        CSRC / "int8_linear.cpp",
        CSRC / "panel_loop.h",
        CSRC / "amx_tiles.h",
        CSRC / "fused_moe_packed.cpp",
        CSRC.parents[1] / "framework" / "core" / "csrc" / "row_argmax.h",
        CSRC.parents[1] / "framework" / "core" / "csrc" / "dtype_name.h",
        CSRC.parents[1] / "framework" / "core" / "csrc" / "bf16.h",
    ),
)

OPS = (
    "packed_linear",
    "packed_linear_greedy",
    "int8_packed_linear",
    "int8_wo_packed_linear",
    "fused_moe_packed",
)
"""The ``piecewise::`` ops that get a C++ CPU kernel."""


@functools.lru_cache(maxsize=1)
def load() -> bool:
    """Register the C++ kernels (once per process; building the library on first use).
    False, with one warning, where it cannot be built: the ops' Python bodies then run."""
    import passes.ops.int8_packed_linear  # noqa: F401  (the ops and their Python twins first)
    import passes.ops.packed_linear  # noqa: F401
    import passes.ops.packed_moe  # noqa: F401

    return LIBRARY.register(
        "the linear ops run their Python bodies", direct=tuple(f"piecewise::{op}" for op in OPS)
    )


def loaded() -> bool:
    """:func:`load` ran here and succeeded (without building anything)."""
    return load.cache_info().currsize > 0 and load()


def isa() -> str:
    """The instruction sets of the loaded library's kernels (``bf16 kernel,int8 kernel``)."""
    if not load():
        return "unavailable"
    lib = ctypes.CDLL(str(LIBRARY.library_path()))
    lib.piecewise_torch_ops_isa.restype = ctypes.c_char_p
    return lib.piecewise_torch_ops_isa().decode()
