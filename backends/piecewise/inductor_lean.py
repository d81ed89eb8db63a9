"""A loadable form of an Inductor CPU artifact that a warm start runs without the compiler.

``CompiledArtifact.load`` (torch 2.13) imports ``torch._inductor.compile_fx`` (and with it
AOTAutograd and Dynamo, ~3 s) and, through ``async_compile.cpp_pybinding``, probes the CPU's
vector ISAs by compiling and running test programs and pre-compiles a header (~4 s more).
None of that is needed to *run* code that was already compiled: the Inductor output module is
plain Python calling C++ kernels that are already built as Python extension modules.

So on a miss, right after compiling, :func:`export_lean` keeps the output module's source,
with its ``torch._inductor`` imports replaced by the small runtime below, plus the kernels'
``.so`` files; :func:`load_lean` runs them on a hit, importing nothing of Inductor.  The lean
form is written only when the compiled callable is exactly the output module's ``call``
behind a trivial AOTAutograd wrapper (no runtime input mutations, aliased outputs, tokens,
subclasses, rng state); otherwise :func:`export_lean` says why and the caller keeps the
standard artifact.  The facts the kernels were built for (CPU ISA, compiler, torch version)
are in the cache key (``framework.cache.key``), so a hit may skip the probing.

Everything that reads Inductor or AOTAutograd internals is in :func:`export_lean` (runs only
after a compile, when those modules are loaded anyway), through :mod:`framework.compat.inductor`
(checked on torch 2.11 and 2.13).  Where this torch lacks one of them, the lean path is off
(one warning) and pieces keep the standard artifact; a cold compile never depends on it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import re
import sys
import types
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from backends.piecewise.replay import PieceReplay, piece_replay, replay_wanted
from framework.compat import inductor as compat_inductor
from framework.compat import warn_once
from framework.core import ops as core_ops
from framework.core.forward_context import native_tape_sink

LEAN_FORMAT = 1
ALIGN_BYTES = 64  # torch._inductor.utils.ALIGN_BYTES (torch 2.13); checked by export_lean

_IMPORT = re.compile(r"^from (torch\._inductor[\w.]*) import (.+)$", re.M)
_KERNEL_DEF = re.compile(r"^(\w+) = async_compile\.cpp_pybinding\(", re.M)
_ASYNC_USE = re.compile(r"async_compile\.(\w+)")
_EXTERN_USE = re.compile(r"extern_kernels\.(\w+)")


# ---------------------------------------------------------------- runtime (no Inductor)
def align(nbytes: int) -> int:
    """Inductor's ``align`` (round up to ALIGN_BYTES)."""
    return (nbytes + ALIGN_BYTES - 1) & -ALIGN_BYTES


_align = align


@contextlib.contextmanager
def maybe_profile(should_profile: bool, *args: Any, **kwargs: Any):
    if should_profile:
        with torch.profiler.profile(*args, **kwargs) as p:
            yield p
    else:
        yield


def run_intermediate_hooks(name: str, val: Any) -> None:
    """Inductor's debugging hooks; none are registered outside Inductor's own tests."""


class _ExternKernels:
    """``extern_kernels.mm`` etc.: each is the torch function of that name (export_lean
    checks the identity against Inductor's registry for every name a module uses)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


extern_kernels = _ExternKernels()

_SHIM_NAMES = {
    "AsyncCompile",
    "extern_kernels",
    "run_intermediate_hooks",
    "maybe_profile",
    "_align as align",
    "align",
}


class AsyncCompile:
    """Stands in for Inductor's AsyncCompile in a lean module: hands out prebuilt kernels."""

    kernels: dict[str, Callable] = {}

    def __init__(self) -> None:
        self.argtypes: dict[str, list[str]] = {}
        """Each kernel's C++ argument types, as the module declares them (piece replay)."""

    def cpp_pybinding_named(self, name: str, argtypes: Any, source: str) -> Callable:
        self.argtypes[name] = list(argtypes)
        return self.kernels[name]

    def wait(self, scope: dict) -> None:
        pass


def _load_extension(path: Path, module_name: str) -> Callable:
    # The kernels resolve tensor data pointers through a function torch exports to them by
    # address (as CppPythonBindingsCodeCache._load_library_inner does).
    address = compat_inductor.tensor_data_ptr_address()
    if address is None:
        raise LeanUnsupported("this torch exports no tensor data-pointer function to kernels")
    os.environ["_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"] = str(address)
    if module_name in sys.modules:
        return sys.modules[module_name].kernel
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load kernel {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[module_name] = module
    return module.kernel


def load_lean(source: str, kernels: dict[str, Path]) -> Callable:
    """The output module's ``call`` as ``fn(*args) -> tuple``, built from the rewritten source
    and the kernel files (name -> path).  Imports nothing of Inductor."""
    loaded = {}
    for name, path in kernels.items():
        loaded[name] = _load_extension(path, f"piecewise_lean_{path.stem}.kernel")
    compiler = AsyncCompile()
    compiler.kernels = loaded
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    module = types.ModuleType(f"piecewise_lean_{digest}")
    module.__dict__["__piecewise_async_compile__"] = compiler
    exec(compile(source, f"<piecewise lean module {digest}>", "exec"), module.__dict__)
    call = module.__dict__["call"]
    body, direct = bind_direct_calls(source)
    if direct:  # a second copy of the module, its op calls bound to the kernels
        fast = types.ModuleType(f"piecewise_lean_{digest}_direct")
        fast.__dict__["__piecewise_async_compile__"] = compiler
        fast.__dict__.update(direct)
        exec(compile(body, f"<piecewise lean module {digest} direct>", "exec"), fast.__dict__)
        replay, refusal = piece_replay(
            digest,
            body,
            fast.__dict__["call"],
            {k: (fn, compiler.argtypes.get(k, []), kernels[k]) for k, fn in loaded.items()},
            direct,
        )
        call = _either(fast.__dict__["call"], call)
    else:
        replay, refusal = None, "no op call is bound to a direct kernel"
    graph = LeanGraph(call, replay, refusal)

    def run(*args: Any) -> Any:
        return graph(list(args))

    run.lean = True  # type: ignore[attr-defined]
    run.code_digest = code_digest(source)  # type: ignore[attr-defined]
    run.direct_calls = sorted(direct)  # type: ignore[attr-defined]
    run.replay = replay  # type: ignore[attr-defined]
    run.replay_refusal = refusal  # type: ignore[attr-defined]  # why there is no replay
    return run


def _either(direct: Callable, plain: Callable) -> Callable:
    """The piece's call: its direct-call copy unless, for this call, an override or a watcher
    (dispatch mode, profiler) needs every op to go through the dispatcher
    (``framework.core.ops.direct_calls_allowed``, checked once a piece call)."""
    allowed = core_ops.direct_calls_allowed

    def call(args: list) -> Any:
        return (direct if allowed() else plain)(args)

    return call


_OP_CALL = re.compile(r"\btorch\.ops\.piecewise\.(\w+)\.default\(")
"""The start of an op call; :func:`_call_arguments` finds where its arguments end."""


def _call_arguments(source: str, start: int) -> Optional[int]:
    """The index of the ``)`` closing the call whose arguments begin at ``start``, if they are
    positional expressions (names, literals, nested calls and tuples such as Inductor's
    ``reinterpret_tensor(buf, (s0, 512), (512, 1), 0)``); None for keyword arguments, strings
    or an unbalanced call."""
    depth = 0
    for i in range(start, len(source)):
        ch = source[i]
        if ch in "([":
            depth += 1
        elif ch in ")]":
            if depth == 0:
                return i
            depth -= 1
        elif ch in "=\"'\n{":
            return None  # keywords, strings, a call over several lines, dicts: the dispatcher
    return None


def bind_direct_calls(source: str) -> tuple[str, dict[str, Callable]]:
    """The module's ``torch.ops.piecewise.<op>.default(...)`` calls of ops with a direct
    kernel (``framework.core.ops.direct_kernel``: the op's C++ CPU kernel as a Python module
    function), with positional arguments only, renamed to module globals bound to it; and
    those globals.  A piece is CPU-only and runs real tensors, which is what the kernel
    takes; the dispatcher's boxing of each call's arguments is what it saves (a decode
    step's linears: ~1.2 µs a call).  Other calls keep the dispatcher."""
    direct: dict[str, Callable] = {}
    out: list[str] = []
    at = 0  # the source up to here is in out
    for m in _OP_CALL.finditer(source):
        if _call_arguments(source, m.end()) is None:
            continue
        name = f"_pw_direct_{m.group(1)}"  # no leading "__": `call` is a method
        if name not in direct:
            fn = core_ops.direct_kernel(f"piecewise::{m.group(1)}")
            if fn is None:
                continue
            direct[name] = fn
        out += [source[at : m.start()], name, "("]
        at = m.end()
    out.append(source[at:])
    return "".join(out), direct


def code_digest(source: str) -> str:
    """What a lean module runs, as a digest: its source (the C++ kernels' code included)
    without Inductor's ``# AOT ID`` comment, which numbers compiles within a process.  Two
    pieces with equal digests execute the same code."""
    body = "\n".join(l for l in source.splitlines() if not l.startswith("# AOT ID"))
    return hashlib.sha256(body.encode()).hexdigest()[:24]


class LeanGraph:
    """A lean module's ``call``: takes the (boxed) input list, like Inductor's CompiledFxGraph,
    so tools that hook compiled graphs (the CUDA-graph emulation) hook this one too.  With a
    :class:`~backends.piecewise.replay.PieceReplay`, a call the forward lets replay
    (:func:`~backends.piecewise.replay.replay_wanted`) goes through it."""

    def __init__(
        self,
        call: Callable[[list], Any],
        replay: Optional[PieceReplay] = None,
        refusal: Optional[str] = None,
    ):
        self._call = call
        self._replay = replay
        self._refusal = refusal or "no replay"
        """Why there is no replay: what a whole forward being recorded is told."""

    def __call__(self, inputs: list) -> Any:
        replay = self._replay
        if replay is not None and replay_wanted():
            return replay(inputs, self._call)
        if replay is None:
            sink = native_tape_sink()
            if sink is not None:
                sink.refuse(f"a lean piece without replay: {self._refusal}")
        return self._call(inputs)


def rewrite_source(source: str) -> str:
    """Point the module's Inductor imports at this runtime and name each kernel."""

    def imp(m: re.Match) -> str:
        names = [n.strip() for n in m.group(2).split(",")]
        bad = [n for n in names if n not in _SHIM_NAMES]
        if bad:
            raise LeanUnsupported(f"imports {bad} from {m.group(1)}")
        return f"from backends.piecewise.inductor_lean import {m.group(2)}"

    out = _IMPORT.sub(imp, source)
    out = out.replace(
        "async_compile = AsyncCompile()", "async_compile = __piecewise_async_compile__"
    )
    out = _KERNEL_DEF.sub(
        lambda m: f'{m.group(1)} = async_compile.cpp_pybinding_named("{m.group(1)}", ', out
    )
    return out


# ---------------------------------------------------------------- export (after a compile)
class LeanUnsupported(Exception):
    """The compiled artifact has no lean form; the reason says what it needs."""


def capture_aot_metadata() -> contextlib.AbstractContextManager[Optional[list]]:
    """Collects the AOTAutograd runtime metadata (ViewAndMutationMeta) of the compiles run
    inside (:func:`framework.compat.inductor.aot_metadata_spy`); yields None, with one
    warning, where this torch has no such hook: the pieces then get no lean form, and the
    compile itself is untouched."""
    return compat_inductor.aot_metadata_spy()


def _find_compiled_graphs(
    obj: Any, CompiledFxGraph: type, depth: int = 0, seen: Optional[set] = None
) -> list:
    """CompiledFxGraph objects reachable from the artifact's callable through closures and
    attributes (torch 2.13: AOT wrapper -> SerializableCompiledFunction -> CompiledFxGraph)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 12:
        return []
    seen.add(id(obj))
    if isinstance(obj, CompiledFxGraph):
        return [obj]
    children = [c.cell_contents for c in (getattr(obj, "__closure__", None) or ()) if _full(c)]
    if hasattr(obj, "__dict__") and not isinstance(obj, (types.ModuleType, type)):
        children += [v for v in vars(obj).values() if callable(v)]
    found = []
    for c in children:
        found += _find_compiled_graphs(c, CompiledFxGraph, depth + 1, seen)
    return found


def _full(cell: Any) -> bool:
    try:
        cell.cell_contents
        return True
    except ValueError:
        return False


def export_lean(artifact: Any, metas: Optional[list]) -> tuple[str, dict[str, Path]]:
    """The rewritten source and kernel files of a fresh ``standalone_compile`` artifact;
    raises :class:`LeanUnsupported` with the reason when there is no faithful lean form.

    Only ever raises :class:`LeanUnsupported`: a change in the internals it reads (a renamed
    field, say) disables the lean path with one warning and never fails the compile."""
    try:
        return _export_lean(artifact, metas)
    except LeanUnsupported:
        raise
    except Exception as e:
        warn_once(compat_inductor.LEAN_FEATURE, f"export failed ({type(e).__name__}: {e})")
        raise LeanUnsupported(f"export failed ({type(e).__name__}: {e})") from e


def _export_lean(artifact: Any, metas: Optional[list]) -> tuple[str, dict[str, Path]]:
    # ``metas`` from capture_aot_metadata around the compile (None: no hook on this torch).
    if metas is None:
        raise LeanUnsupported("this torch has no AOTAutograd metadata hook")
    facts = compat_inductor.lean_export_facts()
    if facts is None:
        raise LeanUnsupported("this torch lacks an Inductor fact the lean export checks")
    graphs = _find_compiled_graphs(
        getattr(artifact, "_compiled_fn", artifact), facts.compiled_fx_graph
    )
    if graphs and not metas:
        warn_once(compat_inductor.LEAN_FEATURE, "the AOTAutograd hook saw no compile")
    if any(m is None for m in metas):
        raise LeanUnsupported("the AOTAutograd hook got no runtime metadata")
    if len(graphs) != 1 or len(metas) != 1:
        raise LeanUnsupported(f"found {len(graphs)} compiled graphs, {len(metas)} AOT metadata")
    graph, meta = graphs[0], metas[0]
    if meta.num_mutated_inp_runtime_indices or meta.num_intermediate_bases:
        raise LeanUnsupported("input mutations or intermediate bases handled at run time")
    subclasses = [m for m in meta.subclass_inp_meta if type(m).__name__ == "SubclassCreationMeta"]
    if meta.tokens or meta.is_rng_op_functionalized or subclasses:
        raise LeanUnsupported("effect tokens, functionalized rng or tensor subclasses")
    if meta.num_unsafe_view_outputs:
        raise LeanUnsupported("unsafe-view outputs")
    kinds = {o.output_type for o in meta.output_info}
    if not kinds <= {facts.non_alias_output}:
        raise LeanUnsupported(f"outputs alias inputs or each other ({sorted(map(str, kinds))})")
    module = sys.modules.get(getattr(graph.current_callable, "__module__", ""), None)
    call = getattr(module, "call", None)
    if module is None or graph.current_callable != call:
        raise LeanUnsupported("the compiled callable is wrapped (input alignment, cudagraphs)")
    if facts.align_bytes != ALIGN_BYTES:
        raise LeanUnsupported(f"Inductor aligns to {facts.align_bytes} bytes")
    source = Path(module.__file__).read_text()
    unknown = set(_ASYNC_USE.findall(source)) - {"cpp_pybinding", "wait"}
    if unknown:
        raise LeanUnsupported(f"kernels of kinds {sorted(unknown)}")
    for name in set(_EXTERN_USE.findall(source)):
        if getattr(facts.extern_kernels, name, None) is not getattr(torch, name, object()):
            raise LeanUnsupported(f"extern kernel {name} is not torch.{name}")
    kernels = {}
    for name in _KERNEL_DEF.findall(source):
        fn = getattr(module, name, None)
        so = getattr(getattr(fn, "__self__", None), "__file__", None)
        if so is None or not so.endswith(".so"):
            raise LeanUnsupported(f"kernel {name} is not a loaded extension module")
        kernels[name] = Path(so)
    lean = rewrite_source(_executed_part(source))
    for banned in (*compat_inductor.PRIVATE_MODULE_PREFIXES, "import triton"):
        if banned in lean:
            raise LeanUnsupported(f"the module still refers to {banned}")
    try:  # the lean form must at least load here, or warm starts would discard it
        load_lean(lean, kernels)
    except Exception as e:
        raise LeanUnsupported(f"the lean module does not load ({type(e).__name__}: {e})") from e
    return lean, kernels


def _executed_part(source: str) -> str:
    """The module without its leading docstring and the benchmark helpers at its end."""
    body = source.split('"""', 2)[-1] if source.startswith('r"""') else source
    return body.split("\ndef get_args():")[0]
