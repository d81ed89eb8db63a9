"""Attention backends.  Importing this package registers the ``piecewise::attention`` op and
every backend whose implementation is available on this machine."""

import importlib.util

from backends.attention import (
    cpu_paged,  # noqa: F401  (registers "cpu_paged"; built on first use)
    torch_paged,  # noqa: F401  (registers "torch")
)
from backends.attention.common import (
    AttentionBackend,
    AttentionCGSupport,
    available_backends,
    get_backend,
    register_backend,
)
from framework.core.attention_metadata import AttentionMetadata

if importlib.util.find_spec("triton") is not None:  # triton is imported at first kernel call
    from backends.attention import triton_paged  # noqa: F401  (registers "triton")

__all__ = [
    "AttentionBackend",
    "AttentionCGSupport",
    "AttentionMetadata",
    "available_backends",
    "get_backend",
    "register_backend",
]
