"""Any callable is a pass: a plain function ``fn(graph)`` or a plain class whose instances have
``__call__(graph)``, no base class, wrapped into a :class:`~passes.base.GraphPass` here.

    # mypkg/passes.py                      run with: passes=[+mypkg.passes:double_neg]
    def double_neg(graph):
        n = 0
        for node in list(graph.nodes):
            ...                            # rewrite the graph in place
        return n                           # the match count (optional)

* **Matches**: the count the callable returns (an ``int``), else the ``match_count`` it sets
  on itself (the function object, or the instance); neither: the record says
  ``not reported``.
* **uuid** (enters the cache key): the live code of the callable's module and, for a class,
  of the modules of its non-torch base classes (:mod:`passes.code_hash`), so editing the
  file recompiles and an unchanged file loads from the cache.
* A class is instantiated with no arguments, or with the :class:`PassContext` when its
  ``__init__`` takes one argument.

:class:`GraphPass` stays the richer form: range applicability, config factors, fusion
metadata.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch

from framework.core.class_sources import class_modules
from passes.base import GraphPass, PassContext

NOT_REPORTED = None
"""``match_count`` of a callable that neither returned nor set a count."""

_WRAPPERS: dict[tuple[int, str], type[GraphPass]] = {}


def is_graph_pass_class(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, GraphPass)


def wrap_callable(obj: Any, name: str, *, fusion: bool = False) -> type[GraphPass]:
    """A :class:`GraphPass` subclass running ``obj`` (a function or a class with
    ``__call__(graph)``) under ``name``; one wrapper per object and name."""
    if is_graph_pass_class(obj):
        return obj
    if isinstance(obj, type):
        if "__call__" not in dir(obj) or obj.__call__ is type.__call__:
            raise ValueError(
                f"pass {name!r}: class {obj.__qualname__} is neither a GraphPass subclass nor "
                f"a class with __call__(graph)"
            )
    elif not callable(obj):
        raise ValueError(
            f"pass {name!r}: {obj!r} is neither a GraphPass subclass, a class with "
            f"__call__(graph) nor a function"
        )
    key = (id(obj), name)
    cached = _WRAPPERS.get(key)
    if cached is not None and cached.wrapped is obj:
        return cached
    qualname = getattr(obj, "__qualname__", type(obj).__qualname__)
    wrapper = type(
        f"CallablePass[{qualname}]",
        (CallablePass,),
        {
            "name": name,
            "is_fusion": fusion,
            "wrapped": obj,
            "__module__": getattr(obj, "__module__", None) or __name__,
            "__qualname__": f"CallablePass[{qualname}]",
        },
    )
    _WRAPPERS[key] = wrapper
    return wrapper


class CallablePass(GraphPass):
    """Runs a plain callable as a pass (see the module doc); subclassed per callable."""

    wrapped: Any = None

    def __init__(self, context: Optional[PassContext] = None):
        super().__init__(context)
        obj = type(self).wrapped
        self.fn: Callable[[torch.fx.Graph], Any] = _instantiate(obj, self.context)
        self.match_count = NOT_REPORTED

    def __call__(self, graph: torch.fx.Graph) -> None:
        if hasattr(self.fn, "match_count"):
            try:
                self.fn.match_count = NOT_REPORTED  # only a count set by this call counts
            except AttributeError:
                pass
        result = self.fn(graph)
        if isinstance(result, int) and not isinstance(result, bool):
            self.match_count = result
            return
        count = getattr(self.fn, "match_count", NOT_REPORTED)
        ok = isinstance(count, int) and not isinstance(count, bool)
        self.match_count = count if ok else NOT_REPORTED

    def code_modules(self) -> list[str]:
        obj = type(self).wrapped
        if isinstance(obj, type):
            return class_modules(obj)
        module = getattr(obj, "__module__", None)
        return [module] if module else []


def _instantiate(obj: Any, context: PassContext) -> Callable[[torch.fx.Graph], Any]:
    if not isinstance(obj, type):
        return obj
    try:
        params = [
            p
            for p in inspect.signature(obj).parameters.values()
            if p.default is inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    return obj(context) if len(params) == 1 else obj()
