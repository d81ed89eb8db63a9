"""Which baseline each job of a sweep is compared with: one baseline per *cell*.

A sweep over several dimensions (``compile=O1,O2,O3 'toggle_passes=[],[x]'``) has one
baseline job per value of the other dimensions (the job of each level with
``toggle_passes=[]``).  The *cell keys* are the override keys whose values differ between the
baseline jobs (here ``compile``); a job belongs to the cell of the baseline that shares its
values of those keys.  So every toggle is compared with the baseline that differs from it in
the toggle alone: per level, per dtype, per quantisation.

- No job says ``"baseline": true``: the first job is the baseline of one cell (old sweeps).
- One baseline: one cell, every job compared with it.
- Two baselines with the same cell values: :class:`BaselineConflict`, raised by
  ``experiments.run.job`` before the sweep's first job is built and by the report.
- A job whose cell has no baseline: ``baseline_of`` is None (reported, never compared).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence


class BaselineConflict(ValueError):
    """Two jobs claim to be the baseline of the same cell."""


@dataclass(frozen=True)
class CellPlan:
    keys: tuple[str, ...]
    """Override keys that tell the cells apart (empty: one cell)."""
    baseline_of: tuple[Optional[int], ...]
    """Per job, the index of its cell's baseline job (None: its cell has none)."""

    def label(self, overrides: Mapping[str, str]) -> str:
        """``compile=O2, dtype=bfloat16``: the cell of a job with these overrides."""
        return ", ".join(f"{k}={overrides.get(k, '(unset)')}" for k in self.keys) or "all jobs"

    @property
    def baselines(self) -> list[int]:
        return sorted({b for b in self.baseline_of if b is not None})


def plan_cells(
    overrides: Sequence[Mapping[str, str]], baseline: Sequence[bool], names: Sequence[str] = ()
) -> CellPlan:
    """The cells of a sweep whose jobs have these ``overrides`` (key -> value) and
    ``baseline`` flags; ``names`` label the jobs in errors (default: their index)."""
    n = len(overrides)
    names = list(names) or [str(i) for i in range(n)]
    bases = [i for i in range(n) if baseline[i]]
    if not bases:
        return CellPlan((), tuple(0 for _ in range(n)) if n else ())
    if len(bases) == 1:
        return CellPlan((), tuple(bases[0] for _ in range(n)))
    keys: list[str] = []
    for i in bases:
        keys.extend(k for k in overrides[i] if k not in keys)
    keys = [k for k in keys if len({overrides[i].get(k) for i in bases}) > 1]
    cells: dict[tuple, int] = {}
    for i in bases:
        cell = tuple(overrides[i].get(k) for k in keys)
        if cell in cells:
            j = cells[cell]
            where = ", ".join(f"{k}={v}" for k, v in zip(keys, cell)) or "the same overrides"
            raise BaselineConflict(
                f"jobs {names[j]} and {names[i]} both claim to be the baseline of the cell "
                f"{where}: mark one baseline per cell (e.g. "
                f"baseline: ${{eq:${{toggle_passes}},[]}} in a sweep over one more dimension)"
            )
        cells[cell] = i
    return CellPlan(
        tuple(keys),
        tuple(cells.get(tuple(overrides[i].get(k) for k in keys)) for i in range(n)),
    )
