"""Pass registry: ``@register_pass("name")`` on the class; config names passes by registry name
or by import path ``module.sub:ClassName`` (an out-of-tree pass, no framework edit needed).

Built-in passes live one per file in ``passes/``; :func:`resolve_pass` imports the file of a
built-in name on first use, so importing the registry stays cheap and cycle-free.
"""

from __future__ import annotations

import importlib
from typing import Callable, TypeVar

from passes.base import GraphPass

CANONICAL_ORDER: list[str] = [
    "noop_elimination",  # first: strips view/reshape/slice noise so patterns match
    "sequence_parallelism",  # TP, big concrete sizes: reduce-scatter / norm on 1/N / gather
    "fuse_allreduce_rmsnorm",  # TP all-reduce + add + RMSNorm (before the add is taken)
    "fuse_add_rmsnorm",  # add + RMSNorm -> fused_add_rms_norm
    "fuse_rmsnorm_quant",  # (fused-add-)RMSNorm + quant -> one op (sees the op above)
    "fuse_silu_mul_quant",
    "fuse_qk_norm_rope",
    "prepack_linear",  # after fusions: they never look at mm nodes
    "fix_functionalization",  # last: re-inplaces auto_functionalized ops (breaks functional IR)
]
"""Order of the built-in passes; ``order_passes`` sorts a config's list by it."""

BUILTIN_MODULES: dict[str, str] = {name: f"passes.{name}" for name in CANONICAL_ORDER}
"""Registry name -> module that registers it (imported lazily by :func:`resolve_pass`)."""

_REGISTRY: dict[str, type[GraphPass]] = {}

P = TypeVar("P", bound=type)


def register_pass(name: str) -> Callable[[P], P]:
    """Class decorator: make a :class:`GraphPass` subclass selectable as ``name`` in config."""

    def deco(cls: P) -> P:
        if not (isinstance(cls, type) and issubclass(cls, GraphPass)):
            raise TypeError(f"@register_pass({name!r}): {cls!r} is not a GraphPass subclass")
        old = _REGISTRY.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (
            cls.__module__,
            cls.__qualname__,
        ):
            raise ValueError(
                f"@register_pass({name!r}): name already used by "
                f"{old.__module__}.{old.__qualname__}"
            )
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def registered_passes() -> dict[str, type[GraphPass]]:
    """Every registered pass, the built-ins imported first."""
    for name in BUILTIN_MODULES:
        _import_builtin(name)
    return dict(_REGISTRY)


def _import_builtin(name: str) -> None:
    if name not in _REGISTRY and name in BUILTIN_MODULES:
        importlib.import_module(BUILTIN_MODULES[name])


def resolve_pass(name: str) -> type[GraphPass]:
    """The pass class for a registry name or an import path ``module.sub:ClassName``."""
    if ":" in name:
        return _import_pass(name)
    _import_builtin(name)
    if name not in _REGISTRY:
        known = sorted(registered_passes())
        raise ValueError(
            f"unknown pass {name!r}; registered passes: {known}; an out-of-tree "
            f"pass is named by import path 'module.sub:ClassName'"
        )
    return _REGISTRY[name]


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
    if not (isinstance(cls, type) and issubclass(cls, GraphPass)):
        raise ValueError(
            f"pass import path {path!r}: {cls!r} is not a subclass of passes.base.GraphPass"
        )
    if not cls.__dict__.get("name"):
        cls.name = path  # out-of-tree passes need not register: they are known by their path
    return cls


def order_passes(names: list[str]) -> list[str]:
    """Built-in names sorted by :data:`CANONICAL_ORDER`; any other pass (out-of-tree) runs
    right after the built-in that precedes it in ``names`` (first if none does);
    ``fix_functionalization`` stays last because it leaves the graph non-functional."""
    rank = {n: i for i, n in enumerate(CANONICAL_ORDER)}
    attached: dict[str | None, list[str]] = {}
    previous: str | None = None
    for n in names:
        if n in rank:
            previous = n
        else:
            attached.setdefault(previous, []).append(n)
    out = list(attached.get(None, []))
    for n in sorted((n for n in names if n in rank), key=rank.__getitem__):
        if n == "fix_functionalization":
            continue
        out += [n, *attached.get(n, [])]
    if "fix_functionalization" in names:
        out += attached.get("fix_functionalization", [])
        out.append("fix_functionalization")
    return out
