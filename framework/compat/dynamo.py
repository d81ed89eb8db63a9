"""Dynamo internals (checked on torch 2.11.0 and 2.13.0).

Nothing here imports Dynamo at import time; :func:`dynamo_imported` lets a warm start check
that it never did.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch


def dynamo_imported() -> bool:
    """Whether this process has imported Dynamo (``torch._dynamo``)."""
    return "torch._dynamo" in sys.modules


def inductor_imported(module: str = "") -> bool:
    """Whether this process has imported Inductor (``torch._inductor``), or its submodule
    ``module`` (e.g. ``"compile_fx"``)."""
    return ("torch._inductor" + (f".{module}" if module else "")) in sys.modules


def forget_code_cache(code: types.CodeType) -> None:
    """Drop Dynamo's cache entries for one code object (``torch._dynamo.reset_code``, torch
    2.11, 2.13).  There is no public way to drop one code object's entries;
    ``torch.compiler.reset()`` would drop every compiled function of the process, so where
    ``reset_code`` is missing this does nothing (the entries stay until Dynamo's recompile
    limit, which only many LLMs in one process reach)."""
    import torch._dynamo

    reset_code = getattr(torch._dynamo, "reset_code", None)
    if reset_code is not None:
        reset_code(code)


def mark_dynamic(t: torch.Tensor, dim: int) -> None:
    """``torch._dynamo.mark_dynamic`` (torch 2.11, 2.13; documented, but only under the private
    module name)."""
    import torch._dynamo

    torch._dynamo.mark_dynamic(t, dim)


def placeholder_source_types() -> tuple[type, type]:
    """``(LocalSource, TensorPropertySource)`` of ``torch._dynamo.source`` (torch 2.11, 2.13):
    how Dynamo says where a graph input came from."""
    from torch._dynamo.source import LocalSource, TensorPropertySource

    return LocalSource, TensorPropertySource


def reset() -> None:
    """Forget every compiled function of the process (public: ``torch.compiler.reset``)."""
    torch.compiler.reset()


def set_recompile_limit(limit: int) -> None:
    """Dynamo's per-code-object recompile limit (``torch._dynamo.config.recompile_limit``,
    torch 2.11, 2.13; ``cache_size_limit`` before)."""
    import torch._dynamo.config as config

    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, limit)


def config() -> Any:
    """``torch._dynamo.config`` (torch 2.11, 2.13)."""
    import torch._dynamo.config as config

    return config
