"""Pass registry: ``@register_pass(name, after=..., levels=..., fusion=...)`` on the class.

The metadata on each pass is the one source of three things that used to be hand lists:

- the **canonical order** (:func:`canonical_order`): every registered pass after the passes it
  names in ``after`` (``after=ALL``: after every other pass); passes with no ``after`` relation
  between them keep registration order (built-ins: the order of ``BUILTIN_MODULES``; plugins
  after them);
- the **per-level tables** (:func:`level_passes`): ``levels={"cpu": 3, "cuda": 1}`` maps a device
  type to the lowest optimization level that runs the pass (every level above runs it too; a
  device type not named never runs it by default; unknown device types use ``"cpu"``);
- the **ablation sweep** of ``conf/experiment/ablate_passes.yaml`` (every registered pass
  flipped once; ``experiments.run.job`` expands it from :func:`canonical_order`).

Config names passes by registry name or by import path ``module.sub:ClassName`` (an out-of-tree
pass, no framework edit needed). Installed packages add passes through the entry-point group
``piecewise.passes`` (an entry point loads a module that uses ``@register_pass``, or names a
``GraphPass`` subclass, which then has no levels and runs only when named).
"""

from __future__ import annotations

import importlib
from typing import Callable, Iterable, Optional, TypeVar, Union

from framework.core.registry import Registry
from passes.base import GraphPass
from passes.callable_pass import is_graph_pass_class, wrap_callable

ALL = "*"
"""``after=ALL``: the pass runs after every other pass (``fix_functionalization``)."""

DEVICE_TYPES = ("cpu", "cuda")
"""Device types with their own level tables."""

BUILTIN_MODULES: tuple[str, ...] = (
    "passes.noop_elimination",
    "passes.sequence_parallelism",
    "passes.fuse_allreduce_rmsnorm",
    "passes.fuse_add_rmsnorm",
    "passes.fuse_rmsnorm_quant",
    "passes.fuse_silu_mul_quant",
    "passes.fuse_qk_norm_rope",
    "passes.fuse_moe_router",
    "passes.prepack_linear",
    "passes.fix_functionalization",
)
"""Modules of the built-in passes, imported on the registry's first read."""

PASSES: Registry[type[GraphPass]] = Registry(
    "pass", builtin_modules=BUILTIN_MODULES, entry_point_group="piecewise.passes"
)

P = TypeVar("P", bound=type)


def register_pass(
    name: str,
    *,
    after: Union[str, Iterable[str]] = (),
    levels: Optional[dict[str, int]] = None,
    fusion: bool = False,
) -> Callable[[P], P]:
    """Class decorator: make a :class:`GraphPass` subclass selectable as ``name`` in config.

    ``after``: passes that run before this one when both are selected (or :data:`ALL`).
    ``levels``: device type -> lowest optimization level (1-3) that runs it by default.
    ``fusion``: a fusion that matches nothing in a whole model is reported by name.
    """
    after_t = (ALL,) if after == ALL else tuple(after)
    levels = dict(levels or {})
    for device, level in levels.items():
        if not isinstance(device, str) or level not in (1, 2, 3):
            raise ValueError(
                f"@register_pass({name!r}): levels maps a device type to the lowest level "
                f"1, 2 or 3 that runs the pass, got {device!r}: {level!r}"
            )
    if ALL in after_t and len(after_t) > 1:
        raise ValueError(f"@register_pass({name!r}): after=ALL cannot name other passes too")

    def deco(cls: P) -> P:
        if not is_graph_pass_class(cls):
            # A plain function or class: the registry holds its wrapper; the decorated
            # object itself is returned unchanged.
            try:
                wrapper = wrap_callable(cls, name, fusion=fusion)
            except ValueError as e:
                raise TypeError(f"@register_pass({name!r}): {e}") from None
            PASSES.add(name, wrapper, after=after_t, levels=levels, fusion=fusion)
            return cls
        PASSES.add(name, cls, after=after_t, levels=levels, fusion=fusion)
        cls.name = name
        cls.is_fusion = fusion
        return cls

    return deco


def registered_passes() -> dict[str, type[GraphPass]]:
    """Every registered pass (built-ins and plugins), in canonical order."""
    return {name: PASSES.get(name) for name in canonical_order()}


def canonical_order() -> list[str]:
    """Every registered pass name, each after the passes its ``after`` names (see module doc)."""
    entries = {e.name: e for e in PASSES.entries()}
    preds: dict[str, set[str]] = {}
    for name, e in entries.items():
        after = e.meta.get("after", ())
        if ALL in after:
            preds[name] = {n for n in entries if ALL not in entries[n].meta.get("after", ())}
            continue
        unknown = [n for n in after if n not in entries]
        if unknown:
            raise ValueError(
                f"pass {name!r}: after={list(after)} names unregistered pass(es) {unknown}; "
                f"registered passes: {sorted(entries)}"
            )
        preds[name] = set(after)
    order: list[str] = []
    # Ties: built-ins in BUILTIN_MODULES order (whatever imported them first), then the rest
    # in registration order.
    builtin_rank = {m: i for i, m in enumerate(BUILTIN_MODULES)}
    remaining = sorted(
        entries, key=lambda n: builtin_rank.get(entries[n].obj.__module__, len(builtin_rank))
    )
    while remaining:
        ready = next((n for n in remaining if preds[n] <= set(order)), None)
        if ready is None:
            raise ValueError(f"passes {remaining}: their 'after' constraints form a cycle")
        order.append(ready)
        remaining.remove(ready)
    return order


def level_passes(level: int, device_type: str) -> list[str]:
    """The passes optimization ``level`` runs by default on ``device_type``, in canonical order.
    Level 0 (eager) runs none, and is answered without importing any pass."""
    if level == 0:
        return []
    device = device_type if device_type in DEVICE_TYPES else "cpu"
    out = []
    for name in canonical_order():
        lowest = PASSES.entry(name).meta.get("levels", {}).get(device)
        if lowest is not None and level >= lowest:
            out.append(name)
    return out


def pass_meta(name: str) -> dict:
    """The ``@register_pass`` metadata of a registered pass."""
    return dict(PASSES.entry(name).meta)


def resolve_pass(name: str) -> type[GraphPass]:
    """The pass class for a registry name or an import path ``module.sub:obj``; a plain
    function or class (no GraphPass base) comes back wrapped (passes/callable_pass.py)."""
    if ":" in name:
        return _import_pass(name)
    if name not in PASSES:
        raise ValueError(
            f"unknown pass {name!r}; registered passes: {PASSES.names()}; an out-of-tree "
            f"pass is named by import path 'module.sub:ClassName'"
        )
    cls = PASSES.get(name)
    if not is_graph_pass_class(cls):  # an entry point naming a plain function or class
        return wrap_callable(cls, name, fusion=bool(PASSES.entry(name).meta.get("fusion")))
    if not cls.__dict__.get("name"):
        cls.name = name  # an entry point naming a class that did not register itself
    return cls


def _import_pass(path: str) -> type[GraphPass]:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"pass import path {path!r}: expected 'module.sub:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"pass import path {path!r}: cannot import module {module_name!r} "
            f"({e}); is it on PYTHONPATH?"
        ) from e
    cls = getattr(module, attr, None)
    if cls is None:
        raise ValueError(
            f"pass import path {path!r}: module {module_name!r} has no attribute {attr!r}"
        )
    if not is_graph_pass_class(cls):
        try:
            return wrap_callable(cls, path)
        except ValueError as e:
            raise ValueError(f"pass import path {path!r}: {e}") from e
    if not cls.__dict__.get("name"):
        cls.name = path  # out-of-tree passes need not register: they are known by their path
    return cls


def order_passes(names: list[str]) -> list[str]:
    """Registered names sorted by :func:`canonical_order`; a pass named by import path runs
    right after the registered pass that precedes it in ``names`` (first if none does); passes
    registered with ``after=ALL`` stay last because they leave the graph non-functional."""
    canon = canonical_order() if any(":" not in n for n in names) else []
    rank = {n: i for i, n in enumerate(canon)}
    last = {n for n in canon if ALL in PASSES.entry(n).meta.get("after", ())}
    attached: dict[str | None, list[str]] = {}
    previous: str | None = None
    for n in names:
        if n in rank:
            previous = n
        else:
            attached.setdefault(previous, []).append(n)
    out = list(attached.get(None, []))
    ordered = sorted((n for n in names if n in rank), key=rank.__getitem__)
    for n in ordered:
        if n not in last:
            out += [n, *attached.get(n, [])]
    for n in ordered:
        if n in last:
            out += attached.get(n, [])
            out.append(n)
    return out
