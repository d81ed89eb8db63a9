"""Preparing the loaded model before it is compiled: weight quantization, then the weights
re-laid out once for the kernels that read them (vLLM's ``process_weights_after_loading``).

After :func:`process_weights` every CPU linear the ``prepack_linear`` pass covers holds its
weight once, packed (``PackedLinearMethod``; int8 layers: ``PackedInt8LinearMethod``); the plain
originals are gone.  A weight shared
by several modules (a tied LM head and embedding) stays plain: packing it would hold it twice.

:func:`prepare_model` does all of it through the processed-weights cache
(:mod:`framework.cache.weights`): the first start loads, quantizes and re-lays the weights and
saves the result; later starts with the same checkpoint, quantization, kernel settings and code
map that file instead (nothing read, copied or re-laid out; pages arrive as they are touched).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, runtime_checkable

import torch

from framework.core.config import CompilationConfig
from framework.core.huge_pages import HugePageAllocator
from framework.core.quantization import QuantizationConfig
from models.loader import CheckpointError, NonFiniteWeightWarning, build_model, load_model
from passes import native_ops
from passes.ops.int8_packed_linear import PackedInt8LinearMethod
from passes.ops.packed_linear import PackedLinearMethod
from passes.ops.packed_moe import PackedExpertsMethod
from passes.quant_schemes import (
    apply_expert_scheme,
    apply_scheme,
    expert_modules,
    expert_plan,
    quantize_model,
    quantize_plan,
)


def quantize(model: torch.nn.Module, quantization: Any) -> tuple[Any, Optional[str], Any]:
    """Quantize ``model`` in place per ``quantization`` (a scheme name, dict or config);
    returns (the parsed config, its hash, the quantized layers), all None without one."""
    if quantization is None:
        return None, None, None

    qc = QuantizationConfig.parse(quantization)
    if qc is None:
        return None, None, None
    return qc, qc.compute_hash(), quantize_model(model, qc)


def load_quantized(
    model_dir: str, dtype: torch.dtype, device: Any, quantization: Any, *, strict: bool = False
) -> tuple[torch.nn.Module, Any, tuple[Any, Optional[str], Any]]:
    """:func:`models.loader.load_model`, quantizing each selected layer as soon as its weight
    is read (the float weights never all sit in memory at once).  Returns (model, model
    config, (quantization config, its hash, ``{layer: scheme}``)), as :func:`quantize` does.
    ``strict``: a non-finite checkpoint tensor is an error (see ``load_model``)."""
    qc = QuantizationConfig.parse(quantization) if quantization is not None else None
    if qc is None:
        model, model_config = load_model(model_dir, dtype, device, strict=strict)
        return model, model_config, (None, None, None)
    plan: list = []
    pending: dict[str, tuple[torch.nn.Module, Any]] = {}

    def prepare(model: torch.nn.Module):
        plan.extend(quantize_plan(model, qc))  # raises before any weight is read
        for name, layer, scheme in plan:
            pending[f"{name}.weight"] = (layer, scheme)

        def loaded(param_name: str) -> None:
            entry = pending.pop(param_name, None)
            if entry is not None:
                apply_scheme(*entry)
                release_free_memory()

        return loaded

    model, model_config = load_model(model_dir, dtype, device, strict=strict, prepare=prepare)
    for layer, scheme in pending.values():  # e.g. a tied weight, loaded under another name
        apply_scheme(layer, scheme)
    # MoE experts: quantized once the checkpoint is read (their stacked tensors fill from
    # many checkpoint tensors each), then their float weights are dropped.
    experts = expert_plan(model, qc)
    for _, module, scheme in experts:
        apply_expert_scheme(module, scheme)
        release_free_memory()
    layers = {name: type(scheme).name for name, _, scheme in plan + experts}
    return model, model_config, (qc, qc.compute_hash(), layers)


def process_weights(
    model: torch.nn.Module,
    config: CompilationConfig,
    allocator: Optional[HugePageAllocator] = None,
) -> list[str]:
    """Re-lay every eligible linear weight of ``model`` once, in place, when the
    ``prepack_linear`` pass is on; returns the names of the layers (and stacked MoE experts)
    packed.  Each re-laid tensor then moves into huge-page memory (``allocator``, default
    :meth:`~framework.core.huge_pages.HugePageAllocator.for_weights`: shared 2 MB-page slabs;
    :func:`place_relaid`): what a decode step streams is read through 2 MB pages, small
    weights included.

    Eligible: a module exposing ``linear_method`` (None: no quantization scheme took it) and
    a 2-D CPU bf16/fp32 weight that no other module shares.  The LM head is included (it runs
    outside the compiled graph and is the largest matmul of a small model).  int8 layers of
    the dynamic per-token and weight-only schemes are re-laid out for the small-M int8 kernel
    when ``kernel_config.int8_max_rows()`` is above 0.  Stacked MoE experts (``moe_method``
    None, bf16, the small-M kernel on) get their ``w13`` / ``w2`` re-laid out per expert
    (:class:`passes.ops.packed_moe.PackedExpertsMethod`)."""
    if "prepack_linear" not in config.pass_config.passes:
        return []
    allocator = HugePageAllocator.for_weights() if allocator is None else allocator
    owners = Counter(id(p) for _, m in model.named_modules() for p in m.parameters(recurse=False))
    max_rows = config.kernel_config.max_rows()
    int8_rows = config.kernel_config.int8_max_rows()
    layouts: dict = {}  # per shape: does oneDNN read the panel layout (found once per shape)
    packed = []
    for name, module in model.named_modules():
        if not hasattr(module, "linear_method"):
            continue
        if int8_rows > 0 and PackedInt8LinearMethod.applies_to(module):
            if owners[id(module.weight)] > 1:
                continue
            int8_method = PackedInt8LinearMethod(module.linear_method, int8_rows)
            if int8_method.process(module):
                module.linear_method = int8_method
                packed.append(name)
                place_relaid(module, allocator)
                release_free_memory()
            continue
        if not PackedLinearMethod.applies_to(module):
            continue
        if owners[id(module.weight)] > 1:
            continue  # tied: the other owner still reads the plain layout
        method = PackedLinearMethod(max_rows)
        if method.process(module, layouts):
            module.linear_method = method
            packed.append(name)
            place_relaid(module, allocator)
            release_free_memory()  # the original's pages go back to the system now
    expert_layouts: dict = {}
    for name, experts in list(expert_modules(model)):
        if not PackedExpertsMethod.applies_to(experts, max_rows):
            continue
        method = PackedExpertsMethod(max_rows)
        method.process(experts, expert_layouts)
        experts.moe_method = method
        packed.append(name)
        place_relaid(experts, allocator)
        release_free_memory()
    return packed


@runtime_checkable
class RowIndependence(Protocol):
    """What a re-laid layer's method says of its calls: ``rows_independent(module)`` is True
    where every call, whatever its row count, computes each row with bits that do not depend
    on the rows beside it (the small-M kernels at every row count: bf16 and int8 linears,
    stacked experts; :class:`PackedLinearMethod`, :class:`PackedInt8LinearMethod`,
    :class:`PackedExpertsMethod`)."""

    def rows_independent(self, module: torch.nn.Module) -> bool: ...


def rows_independent(model: torch.nn.Module, packed: list[str]) -> bool:
    """Every re-laid layer in ``packed`` (linears' ``linear_method``, stacked experts'
    ``moe_method``) computes each row with bits that do not depend on the rows beside it,
    at any row count (:class:`RowIndependence`): then a step of any size gives a row the bits
    a decode step gives it."""
    for name in packed:
        module = model.get_submodule(name)
        method = getattr(module, "linear_method", None) or getattr(module, "moe_method", None)
        if not (isinstance(method, RowIndependence) and method.rows_independent(module)):
            return False
    return bool(packed)


RELAID = ("weight", "w13", "w2")
"""The parameters a packed layer holds re-laid out: a linear's ``weight``, stacked experts'
``w13`` and ``w2``."""


def relaid_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The re-laid-out parameters of a packed module (:data:`RELAID`), by attribute."""
    return {a: p for a in RELAID if (p := module._parameters.get(a)) is not None}


def place_relaid(module: torch.nn.Module, allocator: HugePageAllocator) -> None:
    """Move a packed module's re-laid-out parameters into ``allocator``'s memory (huge pages
    where available; tensors under its ``min_bytes`` stay).  The Parameter objects stay the
    same (``.data`` is replaced); the old storage is freed once the copy is made, so at most
    two copies of one weight exist at a time."""
    for p in relaid_parameters(module).values():
        data = p.data
        placed = allocator.place(data)
        if placed is not data:
            p.data = placed


logger = logging.getLogger(__name__)


@dataclass
class PreparedModel:
    """What :func:`prepare_model` returns: the processed model and how it came to be."""

    model: torch.nn.Module
    model_config: Any
    quantized: tuple[Any, Optional[str], Any]
    """(quantization config, its hash, ``{layer: scheme name}``), all None without one."""
    packed_layers: list[str] = field(default_factory=list)
    weights_cache: str = "off"
    """``off`` (no cache), ``hit`` (mapped), ``written`` (computed and saved), ``miss``
    (computed, the disk refused the write), ``corrupt`` (a bad file was dropped, the weights
    recomputed and saved again), ``uncacheable`` (:class:`NotCacheable`), ``unprocessed``
    (nothing was quantized or re-laid out: not cached, the checkpoint itself is mapped)."""
    weights_path: Optional[str] = None
    load_s: float = 0.0
    page_cache_frac: Optional[float] = None
    """On a hit: the fraction of the mapped file the page cache held (None where unknown)."""


def prepare_model(
    model_dir: str,
    dtype: torch.dtype,
    device: Any,
    quantization: Any,
    config: CompilationConfig,
    *,
    strict: bool = False,
    model_tag: str = "model",
    allocator: Optional[HugePageAllocator] = None,
) -> PreparedModel:
    """The model of ``model_dir`` loaded, quantized and processed for ``config`` (a resolved
    compilation config): mapped from the processed-weights cache when it holds this
    combination, else computed (:func:`load_quantized` + :func:`process_weights`) and saved.

    The re-laid-out weights a decode step streams live in huge pages: a cold start moves them
    into ``allocator``'s memory after packing (default
    :meth:`~framework.core.huge_pages.HugePageAllocator.for_weights`: shared slabs); a warm
    start maps the file, whose
    large tensors lie on 2 MB boundaries, advised ``MADV_HUGEPAGE``
    (:mod:`framework.cache.weights`), nothing copied."""
    t0 = time.perf_counter()
    device = torch.device(device)
    allocator = HugePageAllocator.for_weights() if allocator is None else allocator
    cache = _open_cache(model_dir, dtype, device, quantization, config, model_tag)
    if cache is not None:
        got = cache.load()
        if got is not None:
            prepared = _restore(cache, got, model_dir, dtype, quantization, strict)
            if prepared is not None:
                prepared.load_s = time.perf_counter() - t0
                return prepared
    model, model_config, quantized = load_quantized(
        model_dir, dtype, device, quantization, strict=strict
    )
    packed = process_weights(model, config, allocator)
    prepared = PreparedModel(model, model_config, quantized, packed)
    if cache is not None:
        _save(cache, prepared, model_dir, dtype)
    prepared.load_s = time.perf_counter() - t0
    return prepared


def register_native_kernels(model: torch.nn.Module) -> bool:
    """Register the packed ops' C++ kernels (:func:`passes.native_ops.load`) when a layer of
    ``model`` runs one: a small-M panel layout, a packed int8 layout, or packed MoE experts.
    Packing a layer registers them (its method's ``process``); a warm start that maps the
    processed weights runs no ``process``, so without this every such call of the restored
    model would go through its op's Python body (~15-20 us more per linear call).  Returns
    whether the kernels are registered."""
    for module in model.modules():
        method = getattr(module, "linear_method", None)
        if isinstance(method, PackedInt8LinearMethod) or (
            isinstance(method, PackedLinearMethod) and method.layout == "panel"
        ):
            return native_ops.load()
        if isinstance(getattr(module, "moe_method", None), PackedExpertsMethod):
            return native_ops.load()  # the MoE layer's one C++ op
    return False


def _open_cache(model_dir, dtype, device, quantization, config, model_tag):
    """The processed-weights cache for this combination, or None where none is kept (cache
    off, not a CPU model)."""
    if not (config.use_cache and config.cache_weights) or device.type != "cpu":
        return None
    from framework.cache.store import default_cache_dir
    from framework.cache.weights import WeightCache, weight_factors

    qc = QuantizationConfig.parse(quantization) if quantization is not None else None
    factors = weight_factors(
        model_dir,
        dtype=dtype,
        quant_hash=qc.compute_hash() if qc is not None else None,
        kernel_config=config.kernel_config.compute_hash(),
        passes=list(config.pass_config.passes or []),
        device=str(device),
    )
    return WeightCache(config.cache_dir or default_cache_dir(), factors, f"weights-{model_tag}")


def _restore(cache, got, model_dir, dtype, quantization, strict) -> Optional[PreparedModel]:
    from framework.cache.module_state import restore

    tensors, meta = got
    model, model_config = build_model(model_dir, dtype)
    try:
        restore(model, tensors, meta["state"])
    except (KeyError, ValueError, TypeError, AttributeError, ImportError) as e:
        cache.corrupt(f"does not restore this model ({type(e).__name__}: {e})")
        return None
    register_native_kernels(model)
    model.requires_grad_(False)
    model.eval()
    check = getattr(model, "weight_check", None)
    if check is not None:
        check.check_s = 0.0  # nothing was checked now (the start that computed them did)
    if check is not None and check.non_finite:  # as the start that computed them said
        message = (
            f"{model_dir}: tensor(s) {check.non_finite[:5]} hold NaN or inf values; the "
            f"model's outputs will not be finite"
        )
        if strict:
            raise CheckpointError(message)
        warnings.warn(message, NonFiniteWeightWarning, stacklevel=3)
    qc = QuantizationConfig.parse(quantization) if quantization is not None else None
    layers = meta["quantized_layers"]
    quantized = (qc, qc.compute_hash(), layers) if qc is not None else (None, None, None)
    logger.info("processed weights mapped from %s", cache.path)
    return PreparedModel(
        model,
        model_config,
        quantized,
        list(meta["packed_layers"]),
        "hit",
        str(cache.path),
        page_cache_frac=cache.page_cache_frac,
    )


def _save(cache, prepared: PreparedModel, model_dir, dtype) -> None:
    from framework.cache.module_state import NotCacheable, describe, restore, snapshot

    if not prepared.packed_layers and not prepared.quantized[2]:
        prepared.weights_cache = "unprocessed"  # as loaded: the checkpoint is mapped directly
        return
    fresh, _ = build_model(model_dir, dtype)
    try:
        tensors, state = snapshot(prepared.model, fresh)
        restore(fresh, tensors, state)  # self-check: the description rebuilds the model
        if describe(fresh) != describe(prepared.model):
            raise NotCacheable("the restored model differs from the processed one")
    except NotCacheable as e:
        logger.info("processed weights not cached: %s", e)
        prepared.weights_cache = "uncacheable"
        return
    del fresh
    meta = {
        "state": state,
        "packed_layers": prepared.packed_layers,
        "quantized_layers": prepared.quantized[2],
    }
    found = cache.result  # miss, or corrupt (a bad file was dropped)
    path = cache.save(tensors, meta)
    prepared.weights_cache = found if found == "corrupt" or path is None else cache.result
    prepared.weights_path = str(path) if path is not None else None


def release_free_memory() -> None:
    """Return freed heap memory to the system (glibc ``malloc_trim``; a no-op elsewhere).
    Weights of a few MB live on the heap, where freeing one does not shrink the process."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.lru_cache(maxsize=1)
def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None
