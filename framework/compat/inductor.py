"""Inductor and AOTAutograd internals (checked on torch 2.11.0 and 2.13.0).

Nothing here imports Inductor at import time (importing ``torch._inductor`` imports Dynamo,
which a warm start must not pay for); each function imports what it needs.

Required entry points (:func:`standalone_compile`, :func:`load_artifact`, the pattern matcher,
...) raise :class:`~framework.compat.Unavailable` when missing.  The lean warm start
(:mod:`backends.piecewise.inductor_lean`) is optional: its hooks (:func:`aot_metadata_spy`,
:func:`lean_export_facts`, :func:`tensor_data_ptr_address`) report a missing private API with
one warning (:data:`LEAN_FEATURE`) and the standard artifact is used; a cold compile never
depends on them.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from framework.compat.versions import Unavailable, warn_once

if TYPE_CHECKING:  # the pattern matcher's types, for annotations only
    from torch._inductor.pattern_matcher import Match, PatternMatcherPass  # noqa: F401

AOT_METADATA_HOOK = ("torch._functorch._aot_autograd.runtime_wrappers", "_create_runtime_wrapper")
"""Where :func:`aot_metadata_spy` hooks in: (module, function taking ``runtime_metadata=``)."""
LEAN_FEATURE = "lean warm start (Inductor artifacts loaded without the compiler)"
PRIVATE_MODULE_PREFIXES = ("torch._inductor", "torch._dynamo")
"""Module names a lean module must not mention (it runs without the compiler)."""


def _import(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise Unavailable(module, str(e)) from e


def _attr(module: str, name: str) -> Any:
    mod = _import(module)
    try:
        return getattr(mod, name)
    except AttributeError as e:
        raise Unavailable(f"{module}.{name}", str(e)) from e


# ------------------------------------------------------------------ compile and load
def standalone_compile(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
    """``torch._inductor.standalone_compile`` (torch 2.11, 2.13): an FX graph to a saveable
    ``CompiledArtifact``."""
    return _attr("torch._inductor", "standalone_compile")(gm, example_inputs, **kwargs)


def load_artifact(path: str, format: str = "binary") -> Callable:
    """``torch._inductor.CompiledArtifact.load`` (torch 2.11, 2.13)."""
    return _attr("torch._inductor", "CompiledArtifact").load(path=path, format=format)


def custom_graph_pass_base() -> type:
    """``torch._inductor.custom_graph_pass.CustomGraphPass`` (torch 2.11, 2.13): Inductor
    keys its FX-graph cache by a post-grad pass's ``uuid()`` only for its (virtual)
    subclasses."""
    return _attr("torch._inductor.custom_graph_pass", "CustomGraphPass")


def aot_module_simplified(*args: Any, **kwargs: Any) -> Any:
    """``torch._functorch.aot_autograd.aot_module_simplified`` (torch 2.11, 2.13)."""
    return _attr("torch._functorch.aot_autograd", "aot_module_simplified")(*args, **kwargs)


def decomposition_table() -> dict:
    """Inductor's decompositions (``torch._inductor.decomposition.select_decomp_table``,
    torch 2.11, 2.13)."""
    return _attr("torch._inductor.decomposition", "select_decomp_table")()


def pattern_matcher() -> Any:
    """``torch._inductor.pattern_matcher`` (torch 2.11, 2.13): ``PatternMatcherPass``,
    ``register_replacement``, ``fwd_only``, ``stable_topological_sort``, ``Match``."""
    return _import("torch._inductor.pattern_matcher")


def register_replacement(*args: Any, pattern_name: Optional[str] = None, **kwargs: Any) -> bool:
    """``torch._inductor.pattern_matcher.register_replacement`` (torch 2.11, 2.13).
    ``pattern_name`` (a label in Inductor's pattern-matcher logs) exists from torch 2.13 on;
    torch 2.11 rejects it, so it is passed only where the signature takes it (the patterns
    and their matches are the same either way)."""
    fn = pattern_matcher().register_replacement
    if pattern_name is not None and "pattern_name" in inspect.signature(fn).parameters:
        kwargs["pattern_name"] = pattern_name
    return fn(*args, **kwargs)


# ------------------------------------------------------------------ configuration
def inductor_config() -> Any:
    """``torch._inductor.config`` (torch 2.11, 2.13; ``torch.compile(options=...)`` is its
    public face)."""
    return _import("torch._inductor.config")


def functorch_config() -> Any:
    """``torch._functorch.config`` (AOTAutograd's settings; torch 2.11, 2.13)."""
    return _import("torch._functorch.config")


def config_patch(**changes: Any) -> Any:
    """``torch._inductor.config.patch(...)``: a context manager (torch 2.11, 2.13)."""
    return inductor_config().patch(**changes)


def clear_caches() -> None:
    """Inductor's in-process caches (``torch._inductor.utils.clear_inductor_caches``, torch
    2.11, 2.13), so the next compile reads the on-disk caches named by the environment."""
    _attr("torch._inductor.utils", "clear_inductor_caches")()


def cpp_compiler_identity() -> tuple[str, str]:
    """Inductor's C++ compiler and its version text (``torch._inductor.cpp_builder``, torch
    2.11, 2.13).  Raises whatever the probe raises when no compiler is installed."""
    cpp_builder = _import("torch._inductor.cpp_builder")
    compiler = cpp_builder.get_cpp_compiler()
    return compiler, cpp_builder.get_compiler_version_info(compiler)


# ------------------------------------------------------------------ CUDA-graph emulation
def compiled_fx_graph_class() -> Optional[type]:
    """``torch._inductor.output_code.CompiledFxGraph`` (torch 2.11, 2.13): every
    Inductor-compiled graph runs through its ``__call__``.  None (with one warning) where it is
    missing."""
    try:
        return _attr("torch._inductor.output_code", "CompiledFxGraph")
    except Unavailable as e:
        warn_once("CUDA-graph emulation hooks", str(e))
        return None


# ------------------------------------------------------------------ the lean warm start
@contextlib.contextmanager
def aot_metadata_spy() -> Iterator[Optional[list]]:
    """Collects the AOTAutograd runtime metadata (``ViewAndMutationMeta``) of the compiles run
    inside, by wrapping ``torch._functorch._aot_autograd.runtime_wrappers.
    _create_runtime_wrapper`` for the duration (torch 2.11, 2.13 keep the metadata only inside
    generated wrapper code; single-threaded compile).

    Yields the list, or None (one warning: the lean path is off) where the hook is missing or
    no longer takes ``runtime_metadata``.  The wrapper only records and forwards, so a changed
    hook can cost the lean form, never the compile."""
    try:
        _import("torch._functorch.aot_autograd")  # the package's own import order first
        module_name, hook = AOT_METADATA_HOOK
        runtime_wrappers = _import(module_name)
        original = getattr(runtime_wrappers, hook)
        takes_meta = "runtime_metadata" in inspect.signature(original).parameters
    except (Unavailable, AttributeError, TypeError, ValueError) as e:
        warn_once(LEAN_FEATURE, f"no AOTAutograd runtime-wrapper hook ({e})")
        yield None
        return
    if not takes_meta:
        warn_once(LEAN_FEATURE, "_create_runtime_wrapper takes no runtime_metadata")
        yield None
        return
    seen: list = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("runtime_metadata"))
        return original(*args, **kwargs)

    setattr(runtime_wrappers, hook, spy)
    try:
        yield seen
    finally:
        if getattr(runtime_wrappers, hook, None) is spy:
            setattr(runtime_wrappers, hook, original)


@dataclass(frozen=True)
class LeanExportFacts:
    """What :func:`backends.piecewise.inductor_lean.export_lean` reads of Inductor (torch
    2.11, 2.13)."""

    compiled_fx_graph: type
    """``torch._inductor.output_code.CompiledFxGraph``"""
    non_alias_output: Any
    """``torch._functorch._aot_autograd.schemas.OutputType.non_alias``"""
    align_bytes: int
    """``torch._inductor.utils.ALIGN_BYTES``"""
    extern_kernels: Any
    """``torch._inductor.select_algorithm.extern_kernels``"""


def lean_export_facts() -> Optional[LeanExportFacts]:
    """The Inductor facts a lean export checks, or None (one warning) where one is missing."""
    try:
        return LeanExportFacts(
            compiled_fx_graph=_attr("torch._inductor.output_code", "CompiledFxGraph"),
            non_alias_output=_attr(
                "torch._functorch._aot_autograd.schemas", "OutputType"
            ).non_alias,
            align_bytes=_attr("torch._inductor.utils", "ALIGN_BYTES"),
            extern_kernels=_attr("torch._inductor.select_algorithm", "extern_kernels"),
        )
    except (Unavailable, AttributeError) as e:
        warn_once(LEAN_FEATURE, str(e))
        return None


def tensor_data_ptr_address() -> Optional[int]:
    """The address of the function Inductor's C++ kernels resolve tensor data pointers through
    (``torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr``, exported to them in
    ``_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR`` as ``CppPythonBindingsCodeCache`` does; torch
    2.11, 2.13).  None (one warning) where it is missing."""
    import torch

    guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    address = getattr(guards, "_torchinductor_pyobject_tensor_data_ptr", None)
    if address is None:
        warn_once(LEAN_FEATURE, "torch._C._dynamo.guards has no tensor data-pointer export")
    return address
