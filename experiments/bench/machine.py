"""The CPU a benchmark ran on, for its results file: this workplace's machines are not all
alike (AVX512-BF16/VNNI on one, AVX2 + FMA only on another), and the kernels that run differ
with them, so every result records which it was."""

from __future__ import annotations

import os
from typing import Any

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
"""The CPU feature flags that decide which kernels run (``machine``)."""


def machine() -> dict[str, Any]:
    """The CPU the run measured: its name and the flags of :data:`ISA_FLAGS` it has (the
    kernels differ: AVX512-BF16/VNNI on one machine of this workplace, AVX2 only on another)."""
    from framework.core.native_build import cpu_flags

    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            names = (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
            name = next(names, "")
    except OSError:
        pass
    flags = set(cpu_flags().split())
    return {"cpu": name, "isa": [f for f in ISA_FLAGS if f in flags], "cores": os.cpu_count()}
