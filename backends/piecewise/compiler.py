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
import logging
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional

import torch

from backends.piecewise.inductor_lean import (
    LEAN_FORMAT,
    LeanUnsupported,
    capture_aot_metadata,
    export_lean,
    load_lean,
)
from backends.piecewise.protocols import PieceGraphPass
from framework.compat import inductor as compat_inductor
from framework.core.compile_range import CompileRange
from framework.core.files import atomic_write_bytes, content_file_name, sweep_stale_temps
from framework.core.registry import Registry
from framework.core.symbolic import concretize_inputs

logger = logging.getLogger(__name__)

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
        graph_pass: Optional[PieceGraphPass] = None,
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
    ``CompilationConfig.compiler=name``."""

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
    """Inductor through ``torch._inductor.standalone_compile``.  One file per artifact (safe
    for several processes): a zip holding the binary-format ``CompiledArtifact`` and, where
    the piece allows it, its lean form (:mod:`backends.piecewise.inductor_lean`), which a warm start
    loads without importing Inductor's compile path or probing the compiler."""

    BASE_PATCHES: ClassVar[dict[str, Any]] = {"size_asserts": False}
    """Inductor options every piece compiles with unless ``inductor_config`` sets them.

    ``size_asserts``: Inductor's output code checks the size and stride of every input and of
    every extern kernel's output with an ``assert_size_stride`` call, 15 per layer piece of the
    default model.  In a split graph the pieces' inputs are the previous pieces' outputs and
    the model's tensors, whose layouts are those the piece was compiled for (the weights'
    re-layout and the kernel settings are in the cache key), so the checks cannot fail; they
    cost ~1.5 us each, 15-25 us a piece (a decode layer piece of the default model measured
    in isolation: 133 against 152-175 us a call; 9 pieces a step).  ``inductor_config=
    {"size_asserts": True}`` brings them back for debugging."""

    def compute_hash(self) -> str:
        base = hashlib.sha256(json.dumps(self.BASE_PATCHES, sort_keys=True).encode()).hexdigest()
        return f"{super().compute_hash()}-lean{LEAN_FORMAT}-{base[:8]}"

    def compile(self, graph, example_inputs, compile_range):
        graph = copy.deepcopy(graph)
        patches = {**self.BASE_PATCHES, **self.inductor_config}
        if self.graph_pass is not None:
            _register_custom_graph_pass(self.graph_pass)
            patches["post_grad_custom_post_pass"] = self.graph_pass
        if compile_range.is_single_size:
            inputs = concretize_inputs(example_inputs, compile_range.start)
            dynamic = "from_example_inputs"
        else:
            inputs, dynamic = example_inputs, "from_graph"
        with capture_aot_metadata() as metas:
            artifact = compat_inductor.standalone_compile(
                graph, inputs, dynamic_shapes=dynamic, options={"config_patches": patches}
            )
        try:
            lean = export_lean(artifact, metas)
        except LeanUnsupported as e:
            logger.info(
                "piece %s: no lean form (%s); warm starts load it through Inductor",
                compile_range,
                e,
            )
            lean = None

        def save(path: Path) -> None:
            with tempfile.TemporaryDirectory() as tmp:
                binary = Path(tmp) / "artifact.bin"
                artifact.save(path=str(binary), format="binary")
                with zipfile.ZipFile(path, "w") as zf:
                    zf.write(binary, ARTIFACT_MEMBER)
                    if lean is not None:
                        source, kernels = lean
                        zf.writestr(LEAN_SOURCE_MEMBER, source)
                        for name, so in kernels.items():
                            zf.write(so, f"{LEAN_KERNEL_DIR}/{name}.so")

        if lean is not None:
            # Run what a warm start will run: the lean module on the kernels just built.  A
            # cold-built instance and a warm-loaded one then execute the same code (measured:
            # the standard artifact's AOT wrappers made a cold-built LLM ~3% slower per
            # decode step than a warm-loaded one, a difference that read as an effect in A/A
            # sweeps, whose jobs are built cold).
            return load_lean(*lean), save
        return artifact, save

    def load(self, path: Path) -> Callable:
        with zipfile.ZipFile(path) as zf:
            names = set(zf.namelist())
            if LEAN_SOURCE_MEMBER in names:
                source = zf.read(LEAN_SOURCE_MEMBER).decode()
                kernels = {}
                for member in sorted(n for n in names if n.startswith(LEAN_KERNEL_DIR + "/")):
                    name = member[len(LEAN_KERNEL_DIR) + 1 : -len(".so")]
                    kernels[name] = _extract_kernel(zf.read(member), Path(path))
                try:
                    return load_lean(source, kernels)
                except LeanUnsupported as e:  # this torch cannot run it: the standard form
                    logger.info("%s: lean form not loadable (%s)", path, e)
            binary = zf.read(ARTIFACT_MEMBER)
        # No lean form: Inductor's own loader (imports its compile path).
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "artifact.bin").write_bytes(binary)
            return compat_inductor.load_artifact(str(Path(tmp) / "artifact.bin"), "binary")


def _register_custom_graph_pass(graph_pass: PieceGraphPass) -> None:
    """Inductor keys its FX-graph cache by a custom pass's ``uuid()`` only if the pass is a
    ``CustomGraphPass`` (``isinstance``).  The pass manager implements that interface without
    inheriting from it (importing ``torch._inductor`` imports Dynamo, kept off warm starts),
    so it is registered as a virtual subclass here, just before a compile."""
    CustomGraphPass = compat_inductor.custom_graph_pass_base()

    if not isinstance(graph_pass, CustomGraphPass):
        CustomGraphPass.register(type(graph_pass))


ARTIFACT_MEMBER = "artifact.bin"
LEAN_SOURCE_MEMBER = "lean/module.py"
LEAN_KERNEL_DIR = "lean/kernels"


def _extract_kernel(data: bytes, artifact: Path) -> Path:
    """A kernel's shared object as a file (dlopen needs one), named by its content so every
    process agrees: ``<model dir>/kernels/k<sha>.so`` beside the artifacts folder.

    A file already there is reused only if it holds exactly ``data`` (a damaged one is
    rewritten); a new one is written atomically and fsynced.  A disk that refuses the write
    raises ``OSError`` (the artifact itself is fine: callers must not drop it)."""
    directory = artifact.parent.parent / "kernels"
    target = directory / content_file_name(data)
    try:
        if target.read_bytes() == data:
            return target
        logger.warning("kernel %s is damaged; extracting it again from %s", target, artifact)
    except FileNotFoundError:
        pass
    sweep_stale_temps(directory)
    atomic_write_bytes(target, data)
    return target


@register_compiler("eager")
class Eager(CompilerAdaptor):
    """No compilation and no cache.  With passes, the piece is traced to a functional aten
    graph by AOTAutograd (Inductor's decompositions, so patterns see what they see under
    Inductor), the passes run on it, and the graph runs eagerly."""

    produces_artifacts = False

    def compile(self, graph, example_inputs, compile_range):
        if self.graph_pass is None:
            return graph, None
        if compile_range.is_single_size:
            example_inputs = concretize_inputs(example_inputs, compile_range.start)
        run = self.graph_pass.run_on_graph_module

        def fw_compiler(gm: torch.fx.GraphModule, _inputs):
            return run(gm)

        graph = copy.deepcopy(graph)
        output = graph.graph.output_node()
        single = not isinstance(output.args[0], (tuple, list))
        if single:  # AOTAutograd wants tuple outputs
            output.args = ((output.args[0],),)
            graph.recompile()
        compiled = compat_inductor.aot_module_simplified(
            graph,
            example_inputs,
            fw_compiler=fw_compiler,
            decompositions=compat_inductor.decomposition_table(),
        )
        if single:
            return (lambda *args: compiled(*args)[0]), None
        return compiled, None
