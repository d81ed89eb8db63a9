"""Whether this CPU's oneDNN lays a bf16 weight out as the small-M kernel's panels, found the
test's own way (oneDNN's bytes against ``small_m.pack``, whole): on AVX512-BF16 CPUs without
AMX it does for K a multiple of 32; with AMX (Sapphire Rapids and later) oneDNN picks its AMX
blocking and never does.  The engine's packing decides the same per shape
(``passes.ops.packed_linear._same_as_panels``); the tests check its decision against this."""

from __future__ import annotations

import torch

from framework.compat import onednn
from passes import small_m_linear as small_m


def onednn_reads_panels(w: torch.Tensor) -> bool:
    """``w [N, K]`` (bf16): oneDNN's re-laid bytes are exactly ``small_m.pack(w)``."""
    got = onednn.reorder(w)
    if got is None:
        return False
    try:
        panels = small_m.pack(w).reshape(-1)
        return got.data.numel() == panels.numel() and torch.equal(got.data, panels)
    finally:
        got.release()


def has_amx() -> bool:
    """The CPU reports AMX for bf16 (``amx_bf16`` in /proc/cpuinfo; False off Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_bf16" in line for line in f)
    except OSError:
        return False
