"""Storage internals for CUDA-graph outputs and their emulation (torch 2.11.0, 2.13.0)."""

from __future__ import annotations

from typing import Optional

import torch

from framework.compat.versions import warn_once


def storage_use_count(t: torch.Tensor) -> Optional[int]:
    """How many tensors share ``t``'s storage (not counting the temporary storage object this
    call creates): ``torch._C._storage_Use_Count`` (torch 2.11, 2.13; no public API counts
    them).  None where it is missing: the caller must then treat the storage as held."""
    fn = getattr(torch._C, "_storage_Use_Count", None)
    if fn is None:
        warn_once(
            "CUDA-graph emulation: output-pool reuse", "torch._C._storage_Use_Count is missing"
        )
        return None
    return fn(t.untyped_storage()._cdata) - 1


def weak_ref_tensor(t: torch.Tensor) -> torch.Tensor:
    """A tensor aliasing ``t``'s memory without owning it (no reference on the storage):
    ``torch._C._construct_storage_from_data_pointer`` (torch 2.11, 2.13).  Without it, ``t``
    itself (a strong reference: correct values, the memory is only released later)."""
    fn = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if fn is None:
        warn_once(
            "weak references to CUDA-graph outputs",
            "torch._C._construct_storage_from_data_pointer is missing",
        )
        return t
    storage = t.untyped_storage()
    raw = fn(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        raw, t.storage_offset(), t.size(), t.stride()
    )
