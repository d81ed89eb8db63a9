"""Replay of a lean piece's native calls: the CPU counterpart of a CUDA graph.

A lean piece (:mod:`backends.piecewise.inductor_lean`) is Python that allocates buffers and
calls native code: Inductor's C++ kernels (norms, RoPE, activations) and the direct kernels of
the project's ops (the small-M linears).  At a decode step's sizes that Python -- argument
parsing, tensor allocations, views, a call frame per kernel -- costs about as much as a
layer's norms and activations themselves: ~20 µs of a ~120 µs layer of the default tiny model
at batch 1 (measured by recording and replaying a piece in a loop: 118 against 98 µs).

So a piece records, for a set of inputs, the native calls one run made -- each a C function's
address and its arguments as 64-bit words -- and the buffers they wrote (:class:`Tape`); a
later call with the same inputs runs those calls from C++ in one ctypes call
(``csrc/replay.cpp``) and returns the same output tensors.  As with a CUDA graph:

* **Same inputs means same addresses.**  A tape is keyed by its inputs' data pointers and its
  integer arguments (the token count among them).  Every other property of the inputs (dtype,
  shape, strides) is fixed by the compiled code for a token count, which assumes them anyway.
  The engine's inputs live in persistent buffers and each piece's outputs are the next one's
  inputs, so from the second step of a batch shape on every piece call finds its tape.
* **Outputs are the tape's buffers**, rewritten by each replay: a caller must be done with a
  piece's outputs before the same piece runs again on the same inputs.  The engine's runner
  is (each step's hidden states are read by its LM head and sampler before the next step),
  so it asks for replay through the forward context
  (:attr:`framework.core.forward_context.ForwardContext.cpu_replay`), for steps of at most
  ``CompilationConfig.cpu_replay_max_tokens`` tokens; nothing else replays.
* **Only what can be replayed is recorded.**  The piece's ``call`` may only allocate, view
  and call kernels (:func:`replay_refusal` checks its source: no other call, no control
  flow); every Inductor kernel must take pointers and integers only; every op call must come
  from a recording direct kernel (``framework.core.ops.set_direct_recorder``) that reports
  the native call it made, and none may have taken a path it cannot report (the op's Python
  twin, a copy of its input).  Anything else leaves the piece to run as always, and
  :attr:`PieceReplay.refusals` says why.  A profiler, a dispatch mode or a kernel override
  turns replay off for the call (``framework.core.ops.direct_calls_allowed``), so they see
  every op.
* **Memory is bounded.**  A tape keeps the buffers its calls wrote (a decode step's
  intermediate activations: the tiny model's 36 tapes after b1 and b8 generations held
  3.8 MB); each piece keeps its most recently used
  tapes, at most :data:`MAX_TAPES` and :data:`MAX_TAPE_BYTES` of buffers.  Inputs are recorded
  the first time they are seen: the next piece's inputs are this piece's recorded outputs,
  so one step records every piece of a batch shape and the next replays them all.

Bits: a replay runs the same functions on the same buffers in the same order as the recorded
run, so its outputs are those the piece would compute (tests compare them over many steps).
"""

from __future__ import annotations

import ast
import collections
import ctypes
import functools
import logging
import platform
import sys
import types
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from framework.core import ops as core_ops
from framework.core.forward_context import cpu_replay_requested, native_tape_sink
from framework.core.native_build import KernelBuildError, NativeLibrary, compiler
from framework.core.native_tape import NativeCall, native_call

MAX_WORDS = 32
"""Most arguments of a recorded call (``kMaxWords`` in ``csrc/replay.cpp``)."""
MAX_TAPES = 256
"""Tapes a piece keeps (least recently used dropped first; a piece's code is shared by the
layers it stands for, each with its own tape per batch shape) ..."""
MAX_TAPE_BYTES = 64 << 20
"""... and the most bytes of buffers they may hold together (inputs not counted)."""
_MAX_REFUSED = 256
_WORD_MASK = (1 << 64) - 1


class _Call(ctypes.Structure):
    """One recorded call: ``Call`` in ``csrc/replay.cpp``."""

    _fields_ = [
        ("fn", ctypes.c_uint64),
        ("kind", ctypes.c_int64),  # 0: returns nothing; 1: returns an int, nonzero on error
        ("nargs", ctypes.c_int64),
        ("args", ctypes.c_uint64 * MAX_WORDS),
    ]


def _declare(lib: ctypes.CDLL) -> None:
    lib.piecewise_replay.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.piecewise_replay.restype = ctypes.c_int64
    lib.piecewise_replay_max_words.restype = ctypes.c_int64
    lib.piecewise_replay_call_bytes.restype = ctypes.c_int64


LIBRARY = NativeLibrary(
    "piecewise_replay",
    Path(__file__).resolve().parent / "csrc" / "replay.cpp",
    portable_env="PIECEWISE_REPLAY_PORTABLE",
    declare=_declare,
)

_PLATFORMS = {("linux", "x86_64"), ("linux", "amd64"), ("linux", "aarch64")}
"""Where every integer or pointer argument takes one 64-bit slot (csrc/replay.cpp)."""


@functools.lru_cache(maxsize=1)
def load_replayer() -> Optional[ctypes.CDLL]:
    """The replay library (built on first use), or None -- with one warning where it cannot
    be built -- on a platform whose calling convention it does not cover or without a
    compiler: pieces then run as always."""
    if (sys.platform, platform.machine().lower()) not in _PLATFORMS or compiler() is None:
        return None
    log = logging.getLogger(__name__)
    try:
        lib = LIBRARY.load()
    except KernelBuildError as e:
        log.warning("piecewise: no piece replay (%s)", e)
        return None
    words, size = lib.piecewise_replay_max_words(), lib.piecewise_replay_call_bytes()
    if words != MAX_WORDS or size != ctypes.sizeof(_Call):
        log.warning(
            "piecewise: no piece replay (%s: %d words, %d-byte calls; replay.py: %d, %d)",
            LIBRARY,
            words,
            size,
            MAX_WORDS,
            ctypes.sizeof(_Call),
        )
        return None
    return lib


# ---------------------------------------------------------------- what may be replayed
_PURE_CALLS = frozenset(
    {"empty_strided_cpu", "reinterpret_tensor", "assert_size_stride", "assert_alignment", "align"}
)
"""Calls of a lean ``call`` that allocate, view or check, and move no data."""
_INT_TYPES = frozenset(
    {"int64_t", "int32_t", "int16_t", "int8_t", "uint64_t", "uint32_t", "int", "long", "bool"}
)


def word_kind(argtype: str) -> Optional[str]:
    """``"ptr"`` or ``"int"`` for a C++ kernel argument type Inductor declares (``const
    at::BFloat16*``, ``const int64_t``), None for any other (a float is passed in a vector
    register, which a replay of integer words does not reach)."""
    t = " ".join(w for w in argtype.replace("*", " * ").split() if w not in ("const", "volatile"))
    if t.endswith("*"):
        return "ptr"
    return "int" if t in _INT_TYPES else None


def _call_function(source: str) -> Optional[ast.FunctionDef]:
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Runner":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "call":
                    return item
        if isinstance(node, ast.FunctionDef) and node.name == "call":
            return node
    return None


_STATEMENTS = (ast.Assign, ast.Expr, ast.Delete, ast.Return, ast.Pass)


def replay_refusal(source: str, callees: set[str]) -> Optional[str]:
    """Why a lean module's ``call`` cannot be replayed from the calls of ``callees`` (the
    names whose calls are recorded), or None where it can: its body may only assign, delete,
    return and call those, the pure calls of :data:`_PURE_CALLS` and ``args.clear()``."""
    fn = _call_function(source)
    if fn is None:
        return "no call function"
    for stmt in fn.body:
        if not isinstance(stmt, _STATEMENTS):
            return f"a {type(stmt).__name__} statement at line {stmt.lineno}"
    for node in ast.walk(fn):
        if isinstance(node, (ast.Lambda, ast.Yield, ast.Await, ast.NamedExpr)):
            return f"a {type(node).__name__} at line {node.lineno}"
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and (f.id in callees or f.id in _PURE_CALLS):
            continue
        if (
            isinstance(f, ast.Attribute)
            and f.attr == "clear"
            and isinstance(f.value, ast.Name)
            and f.value.id == "args"
        ):
            continue
        return f"calls {ast.unparse(f)} at line {node.lineno}"
    return None


# ---------------------------------------------------------------- tapes
def _owned(touched: list[torch.Tensor], inputs: list) -> list[torch.Tensor]:
    """One tensor per storage of ``touched`` that is not an input's: the buffers the recorded
    run allocated, which its tape must keep alive.  Inputs are not kept: a replay reads
    whatever tensor is at the recorded addresses then (the key guarantees one is), and a
    tape must not keep an engine's weights alive after the engine."""
    seen = {a.untyped_storage().data_ptr() for a in inputs if isinstance(a, torch.Tensor)}
    owned = []
    for t in touched:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            owned.append(t)
    return owned


class Tape:
    """The native calls of one recorded run of a piece and the buffers they wrote."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        calls: list[NativeCall],
        outputs: Any,
        keep: list[torch.Tensor],
        parts: Sequence[Any] = (),
    ):
        self.calls = calls
        """The recorded calls, ``(address, kind, words, label)`` each (a whole-forward tape
        is made of its parts' calls)."""
        self.labels = [label for *_, label in calls]
        self._array = (_Call * max(1, len(calls)))()
        for c, (fn, kind, words, _) in zip(self._array, calls):
            c.fn, c.kind, c.nargs = fn, kind, len(words)
            for i, w in enumerate(words):
                c.args[i] = w & _WORD_MASK
        self._status = ctypes.c_int64(0)
        self._args = (ctypes.addressof(self._array), len(calls), ctypes.addressof(self._status))
        self._run = lib.piecewise_replay
        self.outputs = outputs
        self._keep = keep
        self._parts = list(parts)
        """Tapes whose calls these are (a whole forward's: its pieces'), kept alive: their
        buffers are this tape's."""
        self.nbytes = sum(t.untyped_storage().nbytes() for t in keep)
        """Bytes of the buffers it keeps alive."""

    def run(self, what: str) -> Any:
        """Replay; ``what`` names the tape in an error (``piece submod_2``, ``forward``)."""
        failed = self._run(*self._args)
        if failed:
            raise RuntimeError(
                f"{what}: replayed native call {failed - 1} ({self.labels[failed - 1]}) "
                f"returned error {self._status.value}"
            )
        return self.outputs


class PieceReplay:
    """Records and replays one lean piece (see the module docstring).

    ``method``: the piece's ``call`` in its direct-call module (a bound method whose code
    names the kernels and the direct ops); ``kernels``: kernel name -> (its Python binding,
    the C++ argument types Inductor declared, its C function's address); ``recorders``:
    module global -> recording direct kernel."""

    def __init__(
        self,
        name: str,
        method: Callable,
        kernels: dict[str, tuple[Callable, list[str], int]],
        recorders: dict[str, Callable],
        lib: ctypes.CDLL,
    ):
        self.name = name
        self._what = f"piece {name}"
        self._code = method.__func__.__code__  # type: ignore[attr-defined]
        self._self = method.__self__  # type: ignore[attr-defined]
        self._globals = method.__func__.__globals__  # type: ignore[attr-defined]
        self._kernels = kernels
        self._recorders = recorders
        self._lib = lib
        self._tapes: collections.OrderedDict[tuple, Tape] = collections.OrderedDict()
        self._refused: collections.OrderedDict[tuple, bool] = collections.OrderedDict()
        self.tape_bytes = 0
        """Bytes of the buffers the kept tapes hold."""
        self.refusals: dict[str, int] = {}
        """Why inputs were not recorded (reason -> inputs keys); those keys then run as
        always."""
        self.recorded = 0
        self.replayed = 0

    def __call__(self, inputs: list, run: Callable[[list], Any]) -> Any:
        key = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in inputs)
        tapes = self._tapes
        tape = tapes.get(key)
        sink = native_tape_sink()  # a whole forward being recorded: report what ran
        if tape is not None:
            tapes.move_to_end(key)
            self.replayed += 1
            outputs = tape.run(self._what)
            if sink is not None:
                sink.add(tape.calls, tape)
            return outputs
        if key in self._refused:
            if sink is not None:
                sink.refuse(f"piece {self.name}: inputs it could not record")
            return run(inputs)
        outputs, tape, refusal = self._record(inputs)
        if tape is None:  # the run was real, its outputs stand; these inputs stay unrecorded
            self._refused[key] = True
            if len(self._refused) > _MAX_REFUSED:
                self._refused.popitem(last=False)
            self.refusals[refusal] = self.refusals.get(refusal, 0) + 1
            if sink is not None:
                sink.refuse(f"piece {self.name}: {refusal}")
            return outputs
        tapes[key] = tape
        self.tape_bytes += tape.nbytes
        while len(tapes) > MAX_TAPES or (self.tape_bytes > MAX_TAPE_BYTES and len(tapes) > 1):
            self.tape_bytes -= tapes.popitem(last=False)[1].nbytes
        self.recorded += 1
        if sink is not None:
            sink.add(tape.calls, tape)
        return outputs

    def _record(self, inputs: list) -> tuple[Any, Optional[Tape], str]:
        """Run the piece with every native call recorded: its outputs, and the tape or why
        there is none."""
        calls: list[NativeCall] = []
        keep: list[torch.Tensor] = []
        problems: list[str] = []
        g = dict(self._globals)
        for name, (fn, argtypes, address) in self._kernels.items():
            g[name] = self._kernel_recorder(name, fn, argtypes, address, calls, keep, problems)
        for name, recorder in self._recorders.items():
            g[name] = self._op_recorder(name, recorder, calls, keep, problems)
        outputs = types.FunctionType(self._code, g)(self._self, list(inputs))
        if any(len(words) > MAX_WORDS for _, _, words, _ in calls):
            problems.append(f"a call of more than {MAX_WORDS} arguments")
        if problems:
            return outputs, None, problems[0]
        owned = _owned(keep, inputs)
        return outputs, Tape(self._lib, calls, outputs, owned), ""

    @staticmethod
    def _kernel_recorder(name, fn, argtypes, address, calls, keep, problems) -> Callable:
        kinds = [word_kind(t) for t in argtypes]

        def record(*args: Any) -> None:
            fn(*args)
            if len(args) != len(kinds):
                problems.append(f"kernel {name}: {len(args)} arguments for {len(kinds)} types")
                return
            words = []
            for a, kind in zip(args, kinds):
                if isinstance(a, torch.Tensor) and kind == "ptr":
                    keep.append(a)
                    words.append(a.data_ptr())
                elif kind == "int" and isinstance(a, int):
                    words.append(int(a))
                else:
                    problems.append(f"kernel {name}: an argument of type {type(a).__name__}")
                    return
            calls.append((address, 0, words, name))

        return record

    @staticmethod
    def _op_recorder(name, recorder, calls, keep, problems) -> Callable:
        def record(*args: Any) -> Any:
            out, native = recorder(*args)
            if not native:
                problems.append(f"{name}: a call its kernel cannot replay")
                return out
            keep.extend(a for a in args if isinstance(a, torch.Tensor))
            keep.append(out)
            calls.append(native_call(native, name))
            return out

        return record


def piece_replay(
    name: str,
    source: str,
    method: Callable,
    kernels: dict[str, tuple[Callable, list[str], Path]],
    direct: dict[str, Callable],
) -> tuple[Optional[PieceReplay], Optional[str]]:
    """The replay of a lean piece's direct-call module, or None and why there is none.
    ``source``: the module's source (direct calls bound); ``method``: its ``call``;
    ``kernels``: name -> (binding, argument types, library file); ``direct``: the module
    globals bound to direct kernels (``_pw_direct_<op>``)."""
    lib = load_replayer()
    if lib is None:
        return None, "no replay library on this platform"
    recorders = {}
    for g in direct:
        recorder = core_ops.direct_recorder("piecewise::" + g.removeprefix("_pw_direct_"))
        if recorder is None:
            return None, f"{g} has no recording kernel"
        recorders[g] = recorder
    refusal = replay_refusal(source, set(kernels) | set(recorders))
    if refusal is not None:
        return None, refusal
    bindings = {}
    for k, (binding, argtypes, path) in kernels.items():
        if any(word_kind(t) is None for t in argtypes):
            return None, f"kernel {k} takes {argtypes}"
        try:
            address = ctypes.cast(ctypes.CDLL(str(path)).kernel, ctypes.c_void_p).value
        except (OSError, AttributeError) as e:
            return None, f"kernel {k}: no C entry point ({e})"
        bindings[k] = (binding, argtypes, address)
    return PieceReplay(name, method, bindings, recorders, lib), None


def replay_wanted() -> bool:
    """This call may replay: the forward asked for it and nothing watches or overrides ops."""
    return cpu_replay_requested() and core_ops.direct_calls_allowed()
