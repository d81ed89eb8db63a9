"""The CUDA-graph wrapper: capture a runnable once per batch descriptor, replay it afterwards.

One class wraps anything callable -- a compiled piece (PIECEWISE) or the whole model (FULL).
Its mode is fixed at construction; on every call it reads the runtime mode and the batch
descriptor from the forward context and *trusts* them (the dispatcher chose them):

* no forward context, runtime mode NONE, or a runtime mode other than its own -> call through.
  This is what lets a FULL wrapper around the model and PIECEWISE wrappers around its pieces
  nest: only the wrapper whose mode matches the step captures or replays, the others are
  transparent (inside a FULL capture the pieces run plainly and land in the one big graph).
* first sight of a descriptor -> capture into its graph ops' memory pool and return the
  strong output, computed (a real capture runs nothing, so the ops replay the new graph once;
  the caller's warm-up must have run the callable before, outside any capture: kernels load
  on first use, and loading during a capture invalidates it); the entry keeps only a *weak*
  (non-owning) alias of the output, so once the
  caller drops it the pool can reuse that memory for the next capture, exactly as the eager
  allocator would have.
* later -> replay and return the stored alias.  Outputs are overwritten by the next replay of
  any graph in the pool: consume them before the next forward.

No input is copied: a graph reads its inputs at the addresses it was captured with, so callers
keep inputs in persistent buffers.  ``debug=True`` checks that at every replay.

The few real CUDA calls live behind :class:`GraphOps`.  :class:`EmulatedGraphOps`
(framework/cudagraph/emulation.py) implements them on any device with graph semantics --
capture records the launched kernels with host values frozen, replay runs the record without
the Python, outputs of graphs sharing the pool alias -- so graph-capture bugs (stale host
values, an output overwritten by another graph's replay) reproduce on a laptop.
"""

from __future__ import annotations

import gc
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Protocol

import torch

from framework.compat import tensors as compat_tensors
from framework.compat.ops import tree_map_only
from framework.core.forward_context import (
    BatchDescriptor,
    CUDAGraphMode,
    get_forward_context,
    is_forward_context_available,
)
from framework.cudagraph.emulation import EmulatedGraphOps  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

_RUNTIME_MODES = frozenset((CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL))

# ------------------------------------------------------------------------------------------
# Graph operations (the only place that touches torch.cuda graph APIs)
# ------------------------------------------------------------------------------------------


class GraphOps(Protocol):
    """What the wrapper needs from a graph implementation."""

    def shared_pool(self) -> Any:
        """The memory pool every wrapper using these ops captures into (one per ops object:
        an engine makes one for all of its wrappers, so two engines never share a pool)."""

    first_capture_done: bool
    """Garbage collection runs only before the first capture into these ops' pool (it is
    slow, and after the first graph the pool already holds what later captures need)."""

    def capture(
        self, fn: Callable[[], Any], pool: Any, *, collect_garbage: bool
    ) -> tuple[Any, Any]:
        """Run ``fn`` under capture; return ``(graph, output)`` with ``output`` computed and
        ``fn``'s effects done exactly once, as if it had run (a real capture replays once)."""

    def replay(self, graph: Any) -> None:
        """Re-execute a captured graph (outputs land in the captured output buffers)."""

    def synchronize(self) -> None:
        """Wait for the device (used in debug mode so errors surface at the right call)."""


class CUDAGraphOps:
    """The real thing: ``torch.cuda.CUDAGraph`` captures into this object's own pool.

    Capture is ``capture_begin``/``capture_end`` on a side stream, as ``torch.cuda.graph``
    does, but without its ``torch.cuda.empty_cache()`` on entry except before the first
    capture: between captures into one pool emptying the allocator cache only costs time
    (hundreds of captures at start-up).  Nothing process-wide is swapped or shared."""

    def __init__(self) -> None:
        self._pool: Any = None
        self._stream: Any = None
        self.first_capture_done = False

    def shared_pool(self) -> Any:
        self._require_cuda()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def capture(
        self, fn: Callable[[], Any], pool: Any, *, collect_garbage: bool
    ) -> tuple[Any, Any]:
        self._require_cuda()
        if self._stream is None:
            self._stream = torch.cuda.Stream()  # one capture stream per pool (memory reuse)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        if collect_garbage:
            gc.collect()
            torch.cuda.empty_cache()
        with torch.cuda.stream(self._stream):
            graph.capture_begin(pool, capture_error_mode="global")
            try:
                output = fn()
            finally:
                graph.capture_end()
        # Capture records the kernels without running them: the output buffers hold garbage
        # until the graph runs.  One replay makes capture mean "ran once", as the emulation
        # (which runs ``fn`` while recording) and the caller of a first-sight capture expect.
        graph.replay()
        return graph, output

    def replay(self, graph: Any) -> None:
        graph.replay()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    @staticmethod
    def _require_cuda() -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "CUDA graphs need a CUDA device. On CPU cudagraph_mode must resolve to NONE "
                "(CompilationConfig.resolve does this); tests can pass "
                "graph_ops=EmulatedGraphOps() to CUDAGraphWrapper."
            )


_DEFAULT_OPS: list[CUDAGraphOps] = []


def default_graph_ops() -> CUDAGraphOps:
    """The ops of wrappers built without ``graph_ops`` (stand-alone use: they share one pool).
    An engine never uses these: :func:`framework.cudagraph.graph_setup.setup_graphs` makes one
    ops object, with its own pool, per engine."""
    if not _DEFAULT_OPS:
        _DEFAULT_OPS.append(CUDAGraphOps())
    return _DEFAULT_OPS[0]


# ------------------------------------------------------------------------------------------
# Weak references to output tensors
# ------------------------------------------------------------------------------------------


def weak_ref_tensor(t: torch.Tensor) -> torch.Tensor:
    """A tensor aliasing ``t``'s memory without owning it (no refcount on the storage).

    The memory stays valid while the graph pool keeps it: after a capture the pool, not the
    Python tensor, is what holds a graph's output buffer.
    """
    return compat_tensors.weak_ref_tensor(t)


def weak_ref_tensors(obj: Any) -> Any:
    """:func:`weak_ref_tensor` applied to every tensor in a (nested) output."""
    return tree_map_only(torch.Tensor, weak_ref_tensor, obj)


# ------------------------------------------------------------------------------------------
# The wrapper
# ------------------------------------------------------------------------------------------


@dataclass
class CUDAGraphStats:
    """One wrapper's counters (each wrapper owns its own; sum them with :func:`sum_stats`)."""

    captures: int = 0
    replays: int = 0
    capture_time_s: float = 0.0


def sum_stats(wrappers: "Iterable[CUDAGraphWrapper]") -> CUDAGraphStats:
    """Captures, replays and capture time summed over ``wrappers``."""
    total = CUDAGraphStats()
    for wrapper in wrappers:
        total.captures += wrapper.stats.captures
        total.replays += wrapper.stats.replays
        total.capture_time_s += wrapper.stats.capture_time_s
    return total


@dataclass
class _CapturedGraph:
    descriptor: BatchDescriptor
    graph: Any
    output: Any
    """Weak aliases of the captured output (the pool owns the memory)."""
    input_signature: Optional[list[tuple[str, str, Any]]] = None
    """Debug mode: (argument label, kind, address or value) of every input at capture."""


_LIVE_WRAPPERS: "weakref.WeakSet[CUDAGraphWrapper]" = weakref.WeakSet()


class CUDAGraphWrapper:
    """Capture/replay ``runnable`` per batch descriptor when the step's runtime mode is
    ``runtime_mode`` (FULL or PIECEWISE); call through otherwise."""

    def __init__(
        self,
        runnable: Callable[..., Any],
        runtime_mode: CUDAGraphMode,
        *,
        debug: bool = False,
        graph_ops: Optional[GraphOps] = None,
        name: Optional[str] = None,
    ):
        runtime_mode = CUDAGraphMode.parse(runtime_mode)
        if runtime_mode not in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE):
            raise ValueError(
                f"CUDAGraphWrapper: runtime_mode must be FULL or PIECEWISE, got "
                f"{runtime_mode}; NONE means: do not wrap"
            )
        if not callable(runnable):
            raise TypeError(
                f"CUDAGraphWrapper: runnable must be callable, got {type(runnable).__name__}"
            )
        self.runnable = runnable
        self.runtime_mode = runtime_mode
        self.debug = debug
        self.graph_ops: GraphOps = graph_ops if graph_ops is not None else default_graph_ops()
        self.name = name or getattr(runnable, "__name__", type(runnable).__name__)
        self.stats = CUDAGraphStats()
        self._entries: dict[BatchDescriptor, _CapturedGraph] = {}
        _LIVE_WRAPPERS.add(self)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: expose the wrapped object's attributes so a
        # wrapped module still answers e.g. `.config` or `.named_parameters()`.
        runnable = self.__dict__.get("runnable")
        if runnable is None:
            raise AttributeError(name)
        return getattr(runnable, name)

    def __repr__(self) -> str:
        return (
            f"CUDAGraphWrapper({self.name}, {self.runtime_mode.name}, graphs={len(self._entries)})"
        )

    @property
    def descriptors(self) -> list[BatchDescriptor]:
        """Descriptors captured so far."""
        return list(self._entries)

    def unwrap(self) -> Callable[..., Any]:
        return self.runnable

    def clear_graphs(self) -> None:
        """Drop every captured graph (the next call per descriptor captures again)."""
        self._entries.clear()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not is_forward_context_available():
            return self.runnable(*args, **kwargs)
        ctx = get_forward_context()
        mode = ctx.cudagraph_runtime_mode
        if mode is not self.runtime_mode:
            if mode not in _RUNTIME_MODES:
                raise ValueError(
                    f"ForwardContext.cudagraph_runtime_mode is {mode}, a configuration mode; "
                    f"set the runtime mode the dispatcher returned (NONE, PIECEWISE or FULL)"
                )
            return self.runnable(*args, **kwargs)
        descriptor = ctx.batch_descriptor
        if descriptor is None:
            raise RuntimeError(
                f"CUDAGraphWrapper({self.name}): runtime mode is {mode.name} but "
                f"ForwardContext.batch_descriptor is None; set the descriptor the dispatcher "
                f"returned together with the mode"
            )
        entry = self._entries.get(descriptor)
        if entry is None:
            return self._capture(descriptor, args, kwargs)
        if self.debug and entry.input_signature is not None:
            self._check_inputs(entry, args, kwargs)
        self.graph_ops.replay(entry.graph)
        if self.debug:
            self.graph_ops.synchronize()
        self.stats.replays += 1
        return entry.output

    def _capture(self, descriptor: BatchDescriptor, args: tuple, kwargs: dict) -> Any:
        start = time.perf_counter()
        ops = self.graph_ops
        pool = ops.shared_pool()
        graph, output = ops.capture(
            lambda: self.runnable(*args, **kwargs), pool, collect_garbage=not ops.first_capture_done
        )
        ops.first_capture_done = True
        self._entries[descriptor] = _CapturedGraph(
            descriptor,
            graph,
            weak_ref_tensors(output),
            _input_signature(args, kwargs) if self.debug else None,
        )
        elapsed = time.perf_counter() - start
        self.stats.captures += 1
        self.stats.capture_time_s += elapsed
        logger.debug(
            "captured %s graph of %s for %s in %.1f ms",
            self.runtime_mode.name,
            self.name,
            descriptor,
            elapsed * 1e3,
        )
        # The strong output: the caller (and the rest of the capture) must see an owning
        # tensor so the allocator tracks its lifetime; the entry keeps only the alias.
        return output

    def _check_inputs(self, entry: _CapturedGraph, args: tuple, kwargs: dict) -> None:
        now = _input_signature(args, kwargs)
        if len(now) != len(entry.input_signature):
            raise RuntimeError(
                f"CUDAGraphWrapper({self.name}) replay for {entry.descriptor}: got {len(now)} "
                f"tensor/int arguments, captured with {len(entry.input_signature)}"
            )
        for (label, kind, then), (_, kind_now, value) in zip(entry.input_signature, now):
            if kind != kind_now or then != value:
                what = "address" if kind == "tensor" else "value"
                fmt = hex if kind == "tensor" and kind_now == "tensor" else repr
                raise RuntimeError(
                    f"CUDAGraphWrapper({self.name}) replay for {entry.descriptor}: {label} "
                    f"{what} changed (captured {fmt(then)}, now {fmt(value)}). A graph reads "
                    f"its inputs at the captured addresses: keep this input in a persistent "
                    f"buffer and pass the same tensor (or a view at the same offset) every step"
                )


def _input_signature(args: tuple, kwargs: dict) -> list[tuple[str, str, Any]]:
    """(label, kind, address-or-value) of every tensor and int argument."""
    items = [(f"argument {i}", a) for i, a in enumerate(args)]
    items += [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
    signature = []
    for label, value in items:
        if isinstance(value, torch.Tensor):
            signature.append((label, "tensor", value.data_ptr()))
        elif isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
            signature.append((label, "int", int(value)))
    return signature


def live_wrappers() -> list[CUDAGraphWrapper]:
    """Every CUDA-graph wrapper that is still alive."""
    return list(_LIVE_WRAPPERS)


def clear_all_graphs() -> int:
    """Drop the graphs of every live wrapper; returns how many graphs were dropped."""
    dropped = 0
    for wrapper in list(_LIVE_WRAPPERS):
        dropped += len(wrapper.descriptors)
        wrapper.clear_graphs()
    return dropped


def total_stats() -> CUDAGraphStats:
    """Summed over every live wrapper of the process (a debugging view: an engine reports its
    own wrappers' counts, :meth:`framework.cudagraph.graph_setup.GraphSetup.stats`)."""
    return sum_stats(list(_LIVE_WRAPPERS))
