"""The compiler-pass base class and the context every pass is built with.

A pass is one class in one file: ``__call__(graph)`` rewrites a post-grad FX graph in place and
sets ``match_count``; ``uuid()`` names its behaviour for the cache key; ``is_applicable(range)``
lets it skip token ranges it cannot help.  Register it with :func:`passes.registry.register_pass`
(or name it by import path ``module.sub:ClassName`` in ``PassConfig.passes``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

from framework.core.class_sources import class_modules
from framework.core.compile_range import CompileRange
from passes.code_hash import module_code_hash


@dataclass(frozen=True)
class PassContext:
    """What a pass may depend on besides the graph; everything here enters ``uuid()`` through
    the pass's :meth:`GraphPass.config_factors`."""

    dtype: Optional[torch.dtype] = None
    """The model's activation dtype; ``None``: fusions register patterns for fp32/bf16/fp16."""
    quant_config_hash: Optional[str] = None
    sequence_parallel_min_tokens: int = 256
    """``PassConfig.sequence_parallel_min_tokens`` (the sequence-parallelism threshold)."""
    """Hash of the quantization config (passes that depend on it put it in their factors)."""


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

    def code_modules(self) -> list[str]:
        """Modules whose code defines this pass's behaviour (hashed into :meth:`uuid`): its
        class's module and its bases' (outside torch).  Override to add a helper module."""
        return class_modules(type(self))

    def uuid(self) -> str:
        """sha256 over the pass's name, the live code of :meth:`code_modules` (what this process
        will execute, see :mod:`passes.code_hash`) and its config factors."""
        h = hashlib.sha256()
        h.update(f"{type(self).__module__}.{type(self).__qualname__}".encode())
        for module in self.code_modules():
            h.update(module_code_hash(module).encode())
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
