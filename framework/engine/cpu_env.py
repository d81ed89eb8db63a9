"""Process settings that make a CPU engine several times slower, checked when a CPU engine is
built: a warning that names the variable, what it costs and the fix.

``OMP_WAIT_POLICY=PASSIVE`` puts OpenMP's worker threads to sleep at the end of every
parallel region.  A decode step runs dozens of regions (the linear kernels, the attention
kernel, Inductor's elementwise kernels), and waking a sleeping worker costs far more than
the region's work: on the 2-vCPU KVM machine this project is measured on, a tiny model's b1
decode step took 13-14 ms with PASSIVE against 2.8-3.3 ms with libgomp's default (spin,
then sleep), in fresh processes side by side (closing note of 2026-12-03).  ``ACTIVE`` was
as fast as the default.
"""

from __future__ import annotations

import os
import warnings
from typing import Mapping, Optional


class CpuSettingsWarning(RuntimeWarning):
    """A process setting that slows a CPU engine down (see :func:`cpu_setting_problems`)."""


def cpu_setting_problems(env: Optional[Mapping[str, str]] = None) -> list[str]:
    """What in ``env`` (default: this process's environment) slows a CPU engine, one
    message per setting; empty when nothing does."""
    env = os.environ if env is None else env
    out = []
    policy = env.get("OMP_WAIT_POLICY", "").strip()
    if policy.upper() == "PASSIVE":
        out.append(
            f"OMP_WAIT_POLICY={policy}: OpenMP's workers sleep after every parallel region "
            "and a decode step runs dozens of them; a tiny model's decode step measured 4-5x "
            "slower than with the default. Unset it (or set ACTIVE) for CPU inference."
        )
    return out


def warn_cpu_settings(env: Optional[Mapping[str, str]] = None) -> list[str]:
    """Warn (:class:`CpuSettingsWarning`) once per problem found; returns the messages."""
    problems = cpu_setting_problems(env)
    for msg in problems:
        warnings.warn(msg, CpuSettingsWarning, stacklevel=3)
    return problems
