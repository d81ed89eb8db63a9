"""The Hydra runs' spellings of the one pass list, ``PassConfig.passes``
(framework/core/config.py: exact names, or ``+name``/``-name`` edits of the level's list).

    python -m experiments.run                                  # unset: the level's passes
    python -m experiments.run 'passes=[noop_elimination,mypkg.passes:double_neg]'  # exactly
    python -m experiments.run 'passes=[+mypkg.passes:double_neg]'   # the level's, plus one
    python -m experiments.run 'passes=[-fuse_add_rmsnorm]'          # the level's, minus one
    python -m experiments.run 'passes=[+mypkg.passes:double_neg,-prepack_linear]'  # mixed
    python -m experiments.run -m 'passes=[+mypkg.passes:double_neg],[-fuse_add_rmsnorm]'

- The top-level ``passes=[...]`` is ``compile.pass_config.passes`` under a short name (a ``+x``
  pass is placed by the pass manager at its declared order, ``@register_pass(after=...)``, or,
  named by import path, at the end before the passes that must run last).  Setting both is an
  error naming both keys.
- ``toggle_passes=[x, ...]`` (the ``ablate_passes`` sweep) flips each named pass against the
  list the job would run otherwise, and writes the result back as ``+x``/``-x`` edits (or, for
  an exact list, as the edited exact list): sugar over the same field.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from framework.core.config import parse_pass_list
from passes.registry import level_passes

LONG_KEY = "compile.pass_config.passes"


def parse_short(items: Sequence[Any]) -> list[str]:
    """``passes=[...]`` checked (the errors name ``passes``) and returned as a plain list."""
    parse_pass_list(items, where="passes")
    return [str(item) for item in items]


def apply_short(short: Optional[Sequence[Any]], pass_config: dict) -> dict:
    """``pass_config`` (a plain dict) with the short form ``short`` applied; ``short`` None
    leaves it as it is.  A long form that is also set is an error."""
    if short is None:
        return pass_config
    if pass_config.get("passes") is not None:
        raise ValueError(
            f"passes={list(short)} and {LONG_KEY} are both set: they are two spellings of "
            f"the pass list; use one of them"
        )
    return {**pass_config, "passes": parse_short(short)}


def toggle_passes(pass_config: dict, names: list[str], level: int, device_type: str) -> dict:
    """``pass_config`` with each of ``names`` flipped against what the job would run: the
    level's default list on ``device_type`` (O2's list differs between CPU and CUDA,
    ``levels`` of ``@register_pass``), the explicit list, or the level's list with its edits.
    A pass that would run is removed, one that would not is added."""
    parsed = parse_pass_list(pass_config.get("passes"), where=LONG_KEY)
    runs = parsed.resolve(level_passes(level, device_type))
    if parsed.exact is not None:
        exact = [n for n in runs if n not in names] + [n for n in names if n not in runs]
        return {**pass_config, "passes": exact}
    edits = {n: "+" for n in parsed.add} | {n: "-" for n in parsed.remove}
    for name in names:
        flip = "-" if name in runs else "+"
        if edits.get(name) == ("+" if flip == "-" else "-"):
            del edits[name]  # undoing an edit of the job's own list
        else:
            edits[name] = flip
    return {**pass_config, "passes": [sign + n for n, sign in edits.items()] or None}
