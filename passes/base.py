"""The compiler-pass base class and the context every pass is built with.

A pass is one class in one file: ``__call__(graph)`` rewrites a post-grad FX graph in place and
sets ``match_count``; ``uuid()`` names its behaviour for the cache key; ``is_applicable(range)``
lets it skip token ranges it cannot help.  Register it with :func:`passes.registry.register_pass`
(or name it by import path ``module.sub:ClassName`` in ``PassConfig.passes``).
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar, Optional, Protocol

import torch


class CompileRange(Protocol):
    """Inclusive token range ``[start, end]`` a piece is compiled for (``start == end``: one
    concrete size)."""

    start: int
    end: int


@dataclass(frozen=True)
class PassContext:
    """What a pass may depend on besides the graph; everything here enters ``uuid()`` through
    the pass's :meth:`GraphPass.config_factors`."""

    dtype: Optional[torch.dtype] = None
    """The model's activation dtype; ``None``: fusions register patterns for fp32/bf16/fp16."""
    quant_config_hash: Optional[str] = None
    """Hash of the quantization config (passes that depend on it put it in their factors)."""


def file_digest(path: str) -> str:
    """sha256 of a file's bytes, re-read when its size or mtime changes (uuid() is called
    once per compile; an edited pass must give a new key without restarting)."""
    st = os.stat(path)
    return _digest(path, st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=None)
def _digest(path: str, mtime_ns: int, size: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def class_source_files(cls: type) -> list[str]:
    """Source files of ``cls`` and of every base class outside torch and the stdlib: a pass's
    behaviour changes when its own file *or* a base it inherits (e.g. the pattern-matcher pass)
    changes, and both must change the cache key."""
    files = []
    for klass in cls.__mro__:
        module = klass.__module__ or ""
        if module == "builtins" or module.split(".")[0] in ("torch", "abc", "typing"):
            continue
        try:
            path = inspect.getsourcefile(klass)
        except TypeError:  # classes defined in C or interactively
            continue
        if path and path not in files:
            files.append(path)
    return files


class GraphPass:
    """Base class of compiler passes over post-grad FX graphs.

    Subclasses set ``name``, implement :meth:`__call__`, and set ``self.match_count`` to the
    number of rewrites the last call made (the manager records it per piece).  The docstring of
    each pass shows a graph before and after.
    """

    name: ClassVar[str] = ""
    """Registry name (set by ``@register_pass``; import-path passes get ``module:Class``)."""
    is_fusion: ClassVar[bool] = False
    """Fusions that match nothing in a whole model are reported by ``warn_unmatched``."""

    def __init__(self, context: Optional[PassContext] = None):
        self.context = context or PassContext()
        self.match_count = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(graph)")

    def is_applicable(self, compile_range: Optional[CompileRange]) -> bool:
        """Whether to run on a piece compiled for ``compile_range`` (``None``: any size)."""
        return True

    def config_factors(self) -> dict[str, Any]:
        """Configuration this pass's output depends on (hashed into :meth:`uuid`)."""
        return {}

    def source_files(self) -> list[str]:
        """Files whose text defines this pass's behaviour (hashed into :meth:`uuid`)."""
        return class_source_files(type(self))

    def uuid(self) -> str:
        """sha256 over the pass's name, source files and config factors."""
        h = hashlib.sha256()
        h.update(f"{type(self).__module__}.{type(self).__qualname__}".encode())
        for path in self.source_files():
            h.update(file_digest(path).encode())
        h.update(json.dumps(self.config_factors(), sort_keys=True, default=str).encode())
        return h.hexdigest()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def graph_device_types(graph: torch.fx.Graph) -> set[str]:
    """Device types of the placeholders' fake values (``meta['val']``) of ``graph``."""
    devices = set()
    for node in graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            devices.add(val.device.type)
    return devices
