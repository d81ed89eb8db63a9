"""The short command-line form of the pass list: the top-level Hydra key ``passes``.

    python -m experiments.run                                  # unset: the level's passes
    python -m experiments.run 'passes=[noop_elimination,mypkg.passes:double_neg]'  # exactly
    python -m experiments.run 'passes=[+mypkg.passes:double_neg]'   # the level's, plus one
    python -m experiments.run 'passes=[-fuse_add_rmsnorm]'          # the level's, minus one
    python -m experiments.run 'passes=[+mypkg.passes:double_neg,-prepack_linear]'  # mixed
    python -m experiments.run -m 'passes=[+mypkg.passes:double_neg],[-fuse_add_rmsnorm]'

It is a spelling of the long form ``compile.pass_config.{passes,enable,disable}``: exact names
become ``passes``, ``+x`` goes to ``enable`` (the pass manager places it by its declared order,
``@register_pass(after=...)``, or, named by import path, at the end before the passes that
must run last), ``-y`` to ``disable``. Both forms in one job is an error naming both keys.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

LONG_KEYS = ("passes", "enable", "disable")


def parse_short(items: Sequence[Any]) -> dict[str, list[str]]:
    """``passes=[...]`` as the long form's fields: ``{"passes": [...]}`` for exact names,
    ``{"enable": [...], "disable": [...]}`` for ``+``/``-`` edits."""
    if isinstance(items, str) or not isinstance(items, (list, tuple)):
        raise ValueError(
            f"passes={items!r}: expected a list, e.g. passes=[+name] or passes=[a,b] "
            f"(quote it in the shell: 'passes=[+mypkg.mod:fn]')"
        )
    exact, enable, disable = [], [], []
    for item in items:
        if not isinstance(item, str) or not item.strip("+-"):
            raise ValueError(f"passes: {item!r} is not a pass name, +name or -name")
        if item[0] == "+":
            enable.append(item[1:])
        elif item[0] == "-":
            disable.append(item[1:])
        else:
            exact.append(item)
    if exact and (enable or disable):
        raise ValueError(
            f"passes={list(items)}: mixes exact names {exact} with +/- edits; either list the "
            f"passes exactly (passes=[a,b]) or edit the level's list (passes=[+x,-y])"
        )
    both = sorted(set(enable) & set(disable))
    if both:
        raise ValueError(f"passes={list(items)}: {both} both added (+) and removed (-)")
    if exact or not (enable or disable):  # passes=[] runs no pass at all
        return {"passes": exact}
    return {"enable": enable, "disable": disable}


def apply_short(short: Optional[Sequence[Any]], pass_config: dict) -> dict:
    """``pass_config`` (the long form, a plain dict) with the short form ``short`` applied;
    ``short`` None leaves it as it is. A long form that is also set is an error."""
    if short is None:
        return pass_config
    set_long = [
        f"compile.pass_config.{k}"
        for k in LONG_KEYS
        if (pass_config.get(k) is not None if k == "passes" else pass_config.get(k))
    ]
    if set_long:
        raise ValueError(
            f"passes={list(short)} and {', '.join(set_long)} are both set: they are two "
            f"spellings of the pass list; use one of them"
        )
    return {**pass_config, **parse_short(short)}
