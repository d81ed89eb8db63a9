"""Trace a module's forward exactly once, then call the compiled graph without Dynamo.

:class:`TraceOnce` marks the token dimension of tensor inputs dynamic (dim 0 of every
argument annotated ``torch.Tensor`` in the forward's signature), compiles
with ``fullgraph=True`` and a guard filter that drops every guard, and records how each
graph input is obtained from the call (a module parameter/buffer, an argument, or a size of
an argument): the :class:`ArgBinding`.  Later calls bind their arguments with it and call the
backend's callable directly, so Dynamo runs once per model and adds nothing per step.  The
binding is plain data: with the compiled program restored from the artifact cache it lets a
warm start skip Dynamo entirely.

Any attempt to recompile (only possible when falling back to the Dynamo path) runs under
``torch.compiler.set_stance("fail_on_recompile")`` and is reported with its cause.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from framework.compat import dynamo as compat_dynamo
from framework.compat.dynamo import forget_code_cache as forget_dynamo_cache
from framework.core.errors import find_compile_step_error

logger = logging.getLogger(__name__)

Backend = Callable[[torch.fx.GraphModule, list], Callable]


class RecompileError(RuntimeError):
    pass


@dataclass(frozen=True)
class ArgBinding:
    """How each graph input is obtained: ``("state", name)`` for a parameter or buffer of the
    module, ``("arg", index)`` for a call argument, ``("size", index, dim)`` for a size."""

    specs: tuple[tuple, ...]
    single_output: bool
    arg_meta: tuple[tuple, ...] = ()
    """``(index, dtype name, ndim)`` of each tensor argument at trace time."""

    def to_json(self) -> dict:
        return {
            "specs": [list(s) for s in self.specs],
            "single_output": self.single_output,
            "arg_meta": [list(m) for m in self.arg_meta],
        }

    @classmethod
    def from_json(cls, data: dict) -> "ArgBinding":
        return cls(
            tuple(tuple(s) for s in data["specs"]),
            bool(data["single_output"]),
            tuple(tuple(m) for m in data.get("arg_meta", ())),
        )

    def check_args(self, args: tuple, arg_names: list[str]) -> None:
        """Raise :class:`RecompileError` when an argument differs in a way the compiled code
        was not traced for (the token dimension is the only dynamic one)."""
        for idx, dtype, ndim in self.arg_meta:
            a = args[idx] if idx < len(args) else None
            if not isinstance(a, torch.Tensor) or str(a.dtype) != dtype or a.dim() != ndim:
                got = f"{a.dtype}, {a.dim()}-d" if isinstance(a, torch.Tensor) else type(a).__name__
                raise RecompileError(
                    f"argument {arg_names[idx]!r} was traced as a {ndim}-d {dtype} tensor but "
                    f"got {got}: this would need a recompile, and piecewise compiles exactly "
                    f"once. Keep argument dtypes and ranks fixed (only the token dimension "
                    f"is dynamic)."
                )

    def bind(self, module: torch.nn.Module) -> Callable[[tuple], list]:
        """A fast per-call binder for ``module``'s state."""
        state = dict(module.named_parameters(remove_duplicate=False))
        state.update(module.named_buffers(remove_duplicate=False))
        template: list[Any] = []
        args_at: list[tuple[int, int]] = []
        sizes_at: list[tuple[int, int, int]] = []
        for i, spec in enumerate(self.specs):
            if spec[0] == "state":
                if spec[1] not in state:
                    raise KeyError(
                        f"compiled program expects module state {spec[1]!r}, which "
                        f"the model does not have; the cached program is stale — "
                        f"clear the cache entry"
                    )
                template.append(state[spec[1]])
            else:
                template.append(None)
                if spec[0] == "arg":
                    args_at.append((i, spec[1]))
                else:
                    sizes_at.append((i, spec[1], spec[2]))

        def binder(args: tuple) -> list:
            flat = template.copy()
            for i, a in args_at:
                flat[i] = args[a]
            for i, a, d in sizes_at:
                flat[i] = args[a].shape[d]
            return flat

        return binder


def tensor_arg_dims(fn: Callable) -> dict[str, int]:
    """Dim 0 of every parameter annotated as ``torch.Tensor`` (the token dimension)."""
    hints = typing.get_type_hints(fn)
    return {name: 0 for name, tp in hints.items() if name != "return" and tp is torch.Tensor}


def _binding_from_graph(
    gm: torch.fx.GraphModule, module: torch.nn.Module, arg_names: list[str], example_inputs: list
) -> Optional[ArgBinding]:
    """Derive the binding from Dynamo's placeholder sources; None if one is not understood."""
    LocalSource, TensorPropertySource = compat_dynamo.placeholder_source_types()

    by_id = {id(t): n for n, t in module.named_parameters(remove_duplicate=False)}
    by_id.update({id(t): n for n, t in module.named_buffers(remove_duplicate=False)})
    specs = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, example in zip(placeholders, example_inputs):
        grapharg = node.meta.get("grapharg")
        source = getattr(grapharg, "source", None)
        if isinstance(example, torch.Tensor) and id(example) in by_id:
            specs.append(("state", by_id[id(example)]))
        elif isinstance(source, LocalSource) and source.local_name in arg_names:
            specs.append(("arg", arg_names.index(source.local_name)))
        elif (
            isinstance(source, TensorPropertySource)
            and isinstance(source.base, LocalSource)
            and source.prop.name == "SIZE"
            and source.base.local_name in arg_names
        ):
            specs.append(("size", arg_names.index(source.base.local_name), source.idx))
        else:
            logger.info(
                "graph input %s (source %s) is not bindable; keeping the Dynamo path",
                node.name,
                source,
            )
            return None
    outputs = gm.graph.output_node().args[0]
    single = isinstance(outputs, (tuple, list)) and len(outputs) == 1
    return ArgBinding(tuple(specs), single, _arg_meta(arg_names, example_inputs, specs))


def _arg_meta(arg_names: list[str], example_inputs: list, specs: list[tuple]) -> tuple:
    meta = {}
    for spec, ex in zip(specs, example_inputs):
        if spec[0] == "arg" and isinstance(ex, torch.Tensor):
            meta[spec[1]] = (spec[1], str(ex.dtype), ex.dim())
    return tuple(sorted(meta.values()))


class TraceOnce:
    """Callable replacing ``module.forward``: Dynamo traces once, later calls go straight to
    the backend's compiled callable.

    ``backend(gm, example_inputs) -> callable`` is the torch.compile backend (the piecewise
    backend, or Inductor for the whole-graph mode).  ``restore`` optionally returns a ready
    ``(callable, ArgBinding)`` from a cache, skipping Dynamo altogether.
    """

    def __init__(
        self, module: torch.nn.Module, backend: Backend, *, dump_path: Optional[str] = None
    ):
        self.module = module
        self.backend = backend
        forward = module.forward
        self.arg_names = [p for p in inspect.signature(forward).parameters]
        self.dynamic_arg_dims = tensor_arg_dims(type(module).forward)
        self.dump_path = dump_path
        self.dynamo_time_s = 0.0
        """Time of the first call spent in Dynamo itself (backend compile excluded)."""
        self.backend_time_s = 0.0
        self.num_traces = 0
        self._compiled_fn: Optional[Callable] = None
        self._binding: Optional[ArgBinding] = None
        self._binder: Optional[Callable[[tuple], list]] = None
        self._dynamo_fn: Optional[Callable] = None

    @property
    def binding(self) -> Optional[ArgBinding]:
        """How graph inputs come from a call; None before the trace (or if not bindable)."""
        return self._binding

    @property
    def compiled_fn(self) -> Optional[Callable]:
        """The compiled program calls run (the backend's split module); None before the trace.
        :meth:`install` swaps it."""
        return self._compiled_fn

    @property
    def traced(self) -> bool:
        return self._binder is not None or self._dynamo_fn is not None

    def install(self, compiled_fn: Callable, binding: ArgBinding) -> None:
        """Use an already compiled program (warm start): no Dynamo trace at all."""
        self._compiled_fn, self._binding = compiled_fn, binding
        self._binder = binding.bind(self.module)

    def _capturing_backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        if self.num_traces:
            raise RecompileError(
                "Dynamo tried to trace the model a second time; piecewise compiles exactly "
                "once. Cause: a guard-relevant change in the inputs (dtype, rank, or a "
                "non-token dimension changed). Keep input dtypes/ranks fixed."
            )
        self.num_traces += 1
        t0 = time.perf_counter()
        compiled = self.backend(gm, example_inputs)
        self.backend_time_s += time.perf_counter() - t0
        binding = _binding_from_graph(gm, self.module, self.arg_names, example_inputs)
        if binding is not None:
            self._compiled_fn, self._binding = compiled, binding
        return compiled

    def _first_call(self, *args: Any) -> Any:
        for name, dim in self.dynamic_arg_dims.items():
            idx = self.arg_names.index(name)
            if idx < len(args) and isinstance(args[idx], torch.Tensor):
                compat_dynamo.mark_dynamic(args[idx], dim)
        fn = torch.compile(
            self.module.forward,
            fullgraph=True,
            dynamic=False,
            backend=self._capturing_backend,
            options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe},
        )
        t0 = time.perf_counter()
        with _decompiled_bytecode_dump(self.dump_path):
            try:
                out = fn(*args)
            except Exception as e:
                step_error = find_compile_step_error(e)
                if step_error is None:
                    raise
                logger.debug("the compile failed inside Dynamo/Inductor:", exc_info=e)
                raise step_error.with_traceback(None) from None
        self.dynamo_time_s = time.perf_counter() - t0 - self.backend_time_s
        if self._binding is not None:
            self._binder = self._binding.bind(self.module)
            forget_dynamo_cache(type(self.module).forward.__code__)
        else:
            self._dynamo_fn = fn
        return out

    def __call__(self, *args: Any) -> Any:
        if self._binder is not None:
            self._binding.check_args(args, self.arg_names)
            out = self._compiled_fn(*self._binder(args))
            return out[0] if self._binding.single_output else out
        if self._dynamo_fn is not None:
            try:
                with torch.compiler.set_stance("fail_on_recompile"):
                    return self._dynamo_fn(*args)
            except RuntimeError as e:
                if "recompil" in str(e).lower():
                    raise RecompileError(f"the compiled model would recompile: {e}") from e
                raise
        return self._first_call(*args)


def _decompiled_bytecode_dump(path: Optional[str]):
    """depyf writes Dynamo's transformed bytecode, decompiled to Python, under ``path``."""
    if not path:
        return contextlib.nullcontext()
    try:
        import depyf
    except ImportError:
        logger.warning("depyf is not installed: no decompiled bytecode in %s", path)
        return contextlib.nullcontext()
    return depyf.prepare_debug(str(Path(path) / "depyf"))
