"""CUDA-graph semantics on any device: debug graph-capture problems on a laptop.

:class:`EmulatedGraphOps` plugs into :class:`framework.cudagraph.wrapper.CUDAGraphWrapper` (and
``LLM(..., emulate_cuda_graphs=True)``) in place of real CUDA graphs.  It reproduces what
makes graphs hard, so the bugs show up on CPU exactly as they would on a GPU:

* **Capture records a tape; replay runs the tape, never the Python.**  Capture runs the
  callable once under a ``TorchDispatchMode`` and records every kernel it launches: each aten
  op with its arguments as they were (tensors by identity, Python numbers frozen), each
  Inductor-compiled graph (one opaque launch of ``CompiledFxGraph`` with its input list) and
  each Triton kernel launch (grid and arguments frozen).  Replay re-executes that record over
  the same tensors.  So a host-side value the callable reads (a Python attribute, a scalar
  computed from a config, a ``.tolist()``) keeps its capture-time value at every replay --
  the stale-host-value bug -- and a tensor passed in place of the captured one is ignored.
  A host read of a device value during capture (``.item()``, ``bool(t)``) is an error, as
  it is under ``torch.cuda.graph``.
* **Outputs live in the shared pool.**  Each graph's outputs are moved into blocks of the
  pool the graphs share.  Once nothing outside the pool holds a block (the caller dropped the
  strong output that capture returned; the wrapper keeps only a weak alias), a later capture
  in the same pool reuses it: that graph's replays then overwrite the memory the first
  graph's replay output aliases -- exactly the GPU behaviour behind "consume a graph's
  output before the next replay", and what happens to an output that was not held strongly.

Memory traffic differs from a GPU (functional ops compute a fresh result and copy it into the
recorded output; intermediates stay owned by the tape) but every value a replay produces is
the one a real graph would produce.  Private torch/triton hooks (named per use below; torch's
through :mod:`framework.compat`; torch 2.11 / 2.13, triton 3.6 / 3.9) are patched only while a
capture runs.  Where one is missing, a capture records the whole callable as one launch (one
warning): values stay right, but host values read during capture are no longer frozen.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Any, Callable, Optional

import torch

from framework.compat import inductor as compat_inductor
from framework.compat import tensors as compat_tensors
from framework.compat import warn_once
from framework.compat.ops import (
    LOCAL_SCALAR_DENSE,
    OpOverload,
    TorchDispatchMode,
    tree_flatten,
    tree_unflatten,
)

_NO_REPLAY = frozenset(
    getattr(torch.ops.aten, name)
    for name in ("empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided")
)
"""Allocations and no-ops: a graph replays no allocation (the memory is already there)."""


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def _use_count(t: torch.Tensor) -> Optional[int]:
    """Tensors sharing ``t``'s storage (None where torch cannot count them: never reused)."""
    return compat_tensors.storage_use_count(t)


class _Launch:
    """One recorded kernel launch."""

    __slots__ = ("name", "run", "outputs")

    def __init__(self, name: str, run: Callable[[], Any], outputs: list[torch.Tensor]):
        self.name, self.run, self.outputs = name, run, outputs

    def replay(self) -> None:
        fresh, _ = tree_flatten(self.run())
        for dst, src in zip(self.outputs, fresh):
            if (
                isinstance(dst, torch.Tensor)
                and isinstance(src, torch.Tensor)
                and dst.data_ptr() != src.data_ptr()
            ):
                dst.copy_(src)


def _is_functional(func: OpOverload) -> bool:
    schema = func._schema
    writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    aliases = any(r.alias_info is not None for r in schema.returns)
    return not writes and not aliases


class _Recorder(TorchDispatchMode):
    """Records the launches of one capture (see the module docstring)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch 2.13: without this, Dynamo skips compiled frames while the mode is active
        # and the capture would record the eager program instead of the compiled one.
        return True

    def __init__(self) -> None:
        super().__init__()
        self.tape: list[_Launch] = []
        self.opaque_depth = 0
        self.whole_callable = False  # no Inductor hook: replay re-runs the callable

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is LOCAL_SCALAR_DENSE and self.opaque_depth == 0:
            raise RuntimeError(
                "CUDA-graph capture (emulated): a device value was read on the host during "
                "capture (.item(), bool(tensor), int(tensor), .tolist()); a real "
                "torch.cuda.graph capture fails here. Keep such values on the device or "
                "compute them before the graph"
            )
        out = func(*args, **kwargs)
        if self.opaque_depth or func.overloadpacket in _NO_REPLAY:
            return out
        if _is_functional(func):
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            self.tape.append(_Launch(str(func), lambda: func(*args, **kwargs), outs))
        elif any(
            a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments
        ):
            self.tape.append(_Launch(str(func), lambda: func(*args, **kwargs), []))
        # view ops: the recorded alias already points at the right memory
        return out

    @contextlib.contextmanager
    def opaque(self):
        self.opaque_depth += 1
        try:
            yield
        finally:
            self.opaque_depth -= 1


@contextlib.contextmanager
def _patched(owner: Any, name: str, make: Callable[[Callable], Callable]):
    original = owner.__dict__[name]
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _opaque_hooks(rec: _Recorder) -> contextlib.ExitStack:
    """Record Inductor graphs and Triton launches as single opaque launches (their kernels
    run outside the dispatcher, so the dispatch mode alone would not see them)."""
    stack = contextlib.ExitStack()

    def inductor(original):
        def call(self, inputs):
            frozen = list(inputs)  # the compiled callable clears its (boxed) input list
            with rec.opaque():
                out = original(self, list(frozen))
            if rec.opaque_depth == 0:
                outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
                rec.tape.append(
                    _Launch("inductor graph", lambda: original(self, list(frozen)), outs)
                )
            return out

        return call

    def triton_launch(original):
        def run(self, *args, **kwargs):
            with rec.opaque():
                out = original(self, *args, **kwargs)
            if rec.opaque_depth == 0 and not kwargs.get("warmup", False):
                rec.tape.append(
                    _Launch(
                        f"triton {getattr(self, '__name__', 'kernel')}",
                        lambda: original(self, *args, **kwargs) and None,
                        [],
                    )
                )
            return out

        return run

    # Every Inductor-compiled graph runs through CompiledFxGraph.__call__ (None: not hookable).
    CompiledFxGraph = compat_inductor.compiled_fx_graph_class()

    from backends.piecewise.inductor_lean import LeanGraph  # a warm start's Inductor graphs

    if CompiledFxGraph is not None:
        stack.enter_context(_patched(CompiledFxGraph, "__call__", inductor))
    else:
        rec.whole_callable = True
    stack.enter_context(_patched(LeanGraph, "__call__", inductor))
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:
        return stack
    # triton 3.6, 3.9: kernel[grid](...) calls run(*args, grid=..., warmup=..., **kwargs).
    if not all("run" in cls.__dict__ for cls in (JITFunction, InterpretedFunction)):
        warn_once("CUDA-graph emulation hooks", "triton's JITFunction.run is missing")
        rec.whole_callable = True
        return stack
    stack.enter_context(_patched(JITFunction, "run", triton_launch))
    stack.enter_context(_patched(InterpretedFunction, "run", triton_launch))
    return stack


class _Block:
    """One output block of a pool: the memory, and the tensors graph tapes hold on it."""

    __slots__ = ("data", "tape_refs")

    def __init__(self, data: torch.Tensor):
        self.data = data
        self.tape_refs: list[weakref.ref] = []

    def is_free(self) -> bool:
        """Nothing but the pool and the tapes holds the block (no caller tensor or view)."""
        self.tape_refs = [r for r in self.tape_refs if r() is not None]
        return _use_count(self.data) == 1 + len(self.tape_refs)


class _EmulatedPool:
    """Output blocks shared by the graphs captured into one pool."""

    def __init__(self) -> None:
        self.blocks: list[_Block] = []

    def place(self, t: torch.Tensor, taken: list[_Block]) -> _Block:
        """A free block that fits ``t``'s storage (reused) or a new one; ``taken``: blocks
        this capture already used for its other outputs."""
        nbytes = t.untyped_storage().nbytes()
        for block in self.blocks:
            if (
                block.data.device == t.device
                and block.data.numel() >= nbytes
                and block.data.is_inference() == t.is_inference()
                and not any(block is b for b in taken)
                and block.is_free()
            ):
                return block
        block = _Block(torch.empty(nbytes, dtype=torch.uint8, device=t.device))
        self.blocks.append(block)
        return block


class _EmulatedGraph:
    __slots__ = ("tape", "replays")

    def __init__(self, tape: list[_Launch]):
        self.tape, self.replays = tape, 0


def _tape_tensors(tape: list[_Launch]) -> list[torch.Tensor]:
    found = []
    for launch in tape:
        found += launch.outputs
        cells = getattr(launch.run, "__closure__", None) or ()
        for cell in cells:
            found += [t for t in tree_flatten(cell.cell_contents)[0] if isinstance(t, torch.Tensor)]
    return found


def _new_alias(t: torch.Tensor) -> torch.Tensor:
    """A new tensor object over ``t``'s memory (an owning reference of its own)."""
    with torch.inference_mode(t.is_inference()):
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(
            t.untyped_storage(), t.storage_offset(), t.size(), t.stride()
        )


class EmulatedGraphOps:
    """CUDA-graph semantics without a GPU (module docstring): pass it as ``graph_ops`` to
    :class:`~framework.cudagraph.wrapper.CUDAGraphWrapper`; ``LLM(emulate_cuda_graphs=True)``
    uses it for a whole engine."""

    def __init__(self) -> None:
        self.gc_requests: list[bool] = []
        """``collect_garbage`` of every capture, in order (lets tests check the GC policy)."""
        self.first_capture_done = False
        self._pool: Optional[_EmulatedPool] = None

    def shared_pool(self) -> _EmulatedPool:
        """This object's pool (an engine makes one ops object for all of its wrappers)."""
        if self._pool is None:
            self._pool = _EmulatedPool()
        return self._pool

    def capture(
        self, fn: Callable[[], Any], pool: _EmulatedPool, *, collect_garbage: bool
    ) -> tuple[_EmulatedGraph, Any]:
        self.gc_requests.append(collect_garbage)
        if collect_garbage:
            gc.collect()
        rec = _Recorder()
        with _opaque_hooks(rec), rec:
            output = fn()
        if rec.whole_callable:  # values stay right; capture-time host values do not stick
            outs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
            rec.tape = [_Launch("callable (emulation hooks unavailable)", fn, outs)]
        graph = _EmulatedGraph(rec.tape)
        return graph, self._into_pool(graph, output, pool)

    def replay(self, graph: _EmulatedGraph) -> None:
        for launch in graph.tape:
            launch.replay()
        graph.replays += 1

    def synchronize(self) -> None:
        pass

    @staticmethod
    def _into_pool(graph: _EmulatedGraph, output: Any, pool: _EmulatedPool) -> Any:
        """Move each output storage the tape produced into a pool block and return fresh
        strong tensors over the blocks: what the caller owns (when it drops them, the block
        is free for the next capture)."""
        produced = {_storage_key(t) for launch in graph.tape for t in launch.outputs}
        leaves, spec = tree_flatten(output)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        tape_tensors = _tape_tensors(graph.tape)
        tape_ids = {id(t) for t in tape_tensors}
        moved: set[tuple[str, int]] = set()
        taken: list[_Block] = []
        for leaf in tensors:
            key = _storage_key(leaf)
            if key not in produced or key in moved:
                continue  # an input's memory (not the pool's), or already moved
            moved.add(key)
            # Inference tensors (the engine captures under inference_mode) may only be
            # written inside it; their blocks are inference tensors too.
            with torch.inference_mode(leaf.is_inference()):
                block = pool.place(leaf, taken)
                taken.append(block)
                EmulatedGraphOps._rebind(block, leaf, tape_tensors + tensors, tape_ids)

        pool_keys = {_storage_key(b.data) for b in pool.blocks}
        return tree_unflatten(
            [
                _new_alias(t) if isinstance(t, torch.Tensor) and _storage_key(t) in pool_keys else t
                for t in leaves
            ],
            spec,
        )

    @staticmethod
    def _rebind(
        block: _Block, leaf: torch.Tensor, candidates: list[torch.Tensor], tape_ids: set[int]
    ) -> None:
        """Copy ``leaf``'s storage into ``block`` and point every tensor on that storage
        (the tape's and the output's) at the block instead."""
        key = _storage_key(leaf)
        old = leaf.untyped_storage()
        block.data[: old.nbytes()].copy_(
            torch.empty(0, dtype=torch.uint8, device=leaf.device).set_(
                old, 0, (old.nbytes(),), (1,)
            )
        )
        seen: set[int] = set()
        for t in candidates:
            if id(t) not in seen and _storage_key(t) == key:
                seen.add(id(t))
                t.set_(block.data.untyped_storage(), t.storage_offset(), t.size(), t.stride())
                if id(t) in tape_ids:
                    block.tape_refs.append(weakref.ref(t))
