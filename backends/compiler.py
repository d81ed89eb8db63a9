"""Compiler adaptors: one interface, a registry by name (``COMPILERS``, on the one
:class:`~framework.core.registry.Registry` helper; installed packages add adaptors through the
entry-point group ``piecewise.compilers``).

Contract: ``compute_hash()`` (compiler + config factors for the cache key),
``compile(graph, example_inputs, compile_range) -> (callable, save | None)`` where ``save``
writes a loadable artifact to a path, and ``load(path) -> callable`` restores it in a new
process.  The graph is copied before compiling because Inductor may mutate it.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional

import torch

from framework.core.compile_range import CompileRange
from framework.core.registry import Registry
from framework.core.symbolic import concretize_inputs

SaveFn = Callable[[Path], None]


def compile_ranges(
    endpoints: list[int], sizes: list[int], max_num_tokens: int
) -> list[CompileRange]:
    """[1, e0], [e0+1, e1], ... up to max_num_tokens, plus one single-size range per size."""
    ranges, start = [], 1
    for e in [e for e in endpoints if e < max_num_tokens] + [max_num_tokens]:
        if e >= start:
            ranges.append(CompileRange(start, e))
            start = e + 1
    return ranges + [CompileRange(s, s) for s in sorted(set(sizes))]


class CompilerAdaptor:
    name: ClassVar[str]
    produces_artifacts: ClassVar[bool] = True
    """Whether ``compile`` returns a ``save`` and ``load`` restores it (the artifact cache is
    used only for such adaptors)."""

    def __init__(
        self,
        graph_pass: Optional[Callable] = None,
        inductor_config: Optional[dict[str, Any]] = None,
    ):
        self.graph_pass = graph_pass
        self.inductor_config = dict(inductor_config or {})

    def compute_hash(self) -> str:
        factors = {"compiler": self.name, "inductor_config": self.inductor_config}
        return hashlib.sha256(
            json.dumps(factors, sort_keys=True, default=str).encode()
        ).hexdigest()[:16]

    def compile(
        self, graph: torch.fx.GraphModule, example_inputs: list, compile_range: CompileRange
    ) -> tuple[Callable, Optional[SaveFn]]:
        raise NotImplementedError

    def load(self, path: Path) -> Callable:
        raise NotImplementedError(f"the {self.name} compiler produces no artifacts to load")


COMPILERS: Registry[type[CompilerAdaptor]] = Registry(
    "compiler adaptor", entry_point_group="piecewise.compilers"
)


def register_compiler(name: str) -> Callable[[type[CompilerAdaptor]], type[CompilerAdaptor]]:
    """Class decorator: make a :class:`CompilerAdaptor` subclass selectable as
    ``CompilationConfig.backend=name``."""

    def deco(cls: type[CompilerAdaptor]) -> type[CompilerAdaptor]:
        if not (isinstance(cls, type) and issubclass(cls, CompilerAdaptor)):
            raise TypeError(f"@register_compiler({name!r}): {cls!r} is not a CompilerAdaptor")
        COMPILERS.add(name, cls)
        cls.name = name
        return cls

    return deco


def make_compiler(name: str, **kwargs: Any) -> CompilerAdaptor:
    """An instance of the adaptor registered as ``name`` (``ValueError`` listing the
    registered names if there is none)."""
    return COMPILERS.get(name)(**kwargs)


@register_compiler("inductor")
class InductorStandalone(CompilerAdaptor):
    """Inductor through ``torch._inductor.standalone_compile``; artifacts in the binary format
    (one self-contained file, safe for several processes)."""

    def compile(self, graph, example_inputs, compile_range):
        from torch._inductor import standalone_compile

        graph = copy.deepcopy(graph)
        patches = dict(self.inductor_config)
        if self.graph_pass is not None:
            patches["post_grad_custom_post_pass"] = self.graph_pass
        if compile_range.is_single_size:
            inputs = concretize_inputs(example_inputs, compile_range.start)
            dynamic = "from_example_inputs"
        else:
            inputs, dynamic = example_inputs, "from_graph"
        artifact = standalone_compile(
            graph, inputs, dynamic_shapes=dynamic, options={"config_patches": patches}
        )

        def save(path: Path) -> None:
            artifact.save(path=str(path), format="binary")

        return artifact, save

    def load(self, path: Path) -> Callable:
        from torch._inductor import CompiledArtifact

        return CompiledArtifact.load(path=str(path), format="binary")


@register_compiler("eager")
class Eager(CompilerAdaptor):
    """No compilation and no cache.  With passes, the piece is traced to a functional aten
    graph by AOTAutograd (Inductor's decompositions, so patterns see what they see under
    Inductor), the passes run on it, and the graph runs eagerly."""

    produces_artifacts = False

    def compile(self, graph, example_inputs, compile_range):
        if self.graph_pass is None:
            return graph, None
        from torch._functorch.aot_autograd import aot_module_simplified
        from torch._inductor.decomposition import select_decomp_table

        if compile_range.is_single_size:
            example_inputs = concretize_inputs(example_inputs, compile_range.start)
        run = getattr(self.graph_pass, "run_on_graph_module", None)

        def fw_compiler(gm: torch.fx.GraphModule, _inputs):
            if run is not None:
                run(gm)
            else:
                self.graph_pass(gm.graph)
                gm.recompile()
            return gm

        graph = copy.deepcopy(graph)
        output = graph.graph.output_node()
        single = not isinstance(output.args[0], (tuple, list))
        if single:  # AOTAutograd wants tuple outputs
            output.args = ((output.args[0],),)
            graph.recompile()
        compiled = aot_module_simplified(
            graph, example_inputs, fw_compiler=fw_compiler, decompositions=select_decomp_table()
        )
        if single:
            return (lambda *args: compiled(*args)[0]), None
        return compiled, None
