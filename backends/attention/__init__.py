"""Attention backends.  Importing this package registers the ``piecewise::attention`` op and
every backend whose implementation is available on this machine."""
from backends.attention.common import (AttentionBackend, AttentionCGSupport, AttentionMetadata,
                                       available_backends, get_backend, register_backend)
from backends.attention import torch_paged  # noqa: F401  (registers "torch")

__all__ = ["AttentionBackend", "AttentionCGSupport", "AttentionMetadata", "available_backends",
           "get_backend", "register_backend"]
