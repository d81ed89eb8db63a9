"""The piecewise torch.compile backend: split at the splitting ops, compile each piece per
token range (or load it from the artifact cache), and hand back the split module.

Flow for the one Dynamo graph of a model:
1. :func:`backends.piecewise.split.split_graph` cuts it with
   ``split_module(keep_original_order=True)`` so every splitting op (attention by default)
   sits in its own submodule, run eagerly.
2. :class:`PiecewiseBackend` walks the split module on Dynamo's fake inputs to learn each
   piece's example inputs, compiles every (piece, range) once per *unique* piece graph, and
   swaps each piece for a :class:`PiecewiseRuntime`.
3. The program skeleton (split graph + which artifact each piece/range uses) is saved, so a
   warm start can rebuild the whole callable with no Dynamo trace (:meth:`restore`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from backends.piecewise.compiler import CompilerAdaptor, CompileRange, compile_ranges
from backends.piecewise.graph_serde import NotSerializable, graph_from_json, graph_to_json
from backends.piecewise.protocols import PieceGraphPass, PieceStore
from backends.piecewise.runtime import PiecewiseRuntime, RangeEntry
from backends.piecewise.split import (
    PieceInfo,
    bind_direct_splitting_ops,
    graph_hash,
    inline_splitting_ops,
    module_code,
    native_parts,
    piece_example_inputs,
    split_graph,
    static_piece_inputs,
    token_source,
    traced_files,
)
from framework.core.files import is_environment_error

logger = logging.getLogger(__name__)

PROGRAM_BLOB = "program.json"


@dataclass
class BackendStats:
    split_time_s: float = 0.0
    compile_time_s: float = 0.0
    num_pieces: int = 0
    num_splitting_ops: int = 0
    unique_graphs: int = 0
    compiles: int = 0
    loads: int = 0
    shared: int = 0
    piece_times: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class PiecewiseBackend:
    """``backend(gm, example_inputs) -> callable`` for
    :class:`framework.compile.trace_once.TraceOnce`.

    ``store`` is a :class:`~backends.piecewise.protocols.PieceStore` (the artifact cache's
    store) or None (no disk cache).  ``graph_pass`` is a
    :class:`~backends.piecewise.protocols.PieceGraphPass` (the pass manager) or None: it gets
    ``set_current_piece(name, range)`` before each compile and ``piece_done`` after it.
    """

    def __init__(
        self,
        *,
        compiler: CompilerAdaptor,
        splitting_ops: list[str],
        compile_ranges_endpoints: list[int],
        compile_sizes: list[int],
        max_num_tokens: int,
        store: Optional[PieceStore] = None,
        graph_pass: Optional[PieceGraphPass] = None,
        progress: bool = False,
        dump_path: Optional[str] = None,
        wrap_piece: Optional[Callable[[Callable, PieceInfo], Callable]] = None,
    ):
        self.compiler = compiler
        self.splitting_ops = list(splitting_ops)
        self.ranges = compile_ranges(compile_ranges_endpoints, compile_sizes, max_num_tokens)
        self.max_num_tokens = max_num_tokens
        self.store = store
        self.graph_pass = graph_pass
        self.progress = progress
        self.dump_path = dump_path
        self.wrap_piece = wrap_piece
        self.stats = BackendStats()
        self.pieces: list[PieceInfo] = []
        self.runtimes: dict[str, PiecewiseRuntime] = {}
        self._compiled: dict[str, Callable] = {}
        """Artifact id (:func:`_artifact_id`) -> its callable: identical pieces share code."""
        self._compiled_by: dict[str, str] = {}
        self._static_inputs: dict[str, dict[int, torch.Tensor]] = {}
        self._program: Optional[dict] = None
        self._installed: dict[str, Callable] = {}
        self.traced_files: list[str] = []
        """Non-torch source files whose code produced nodes of the Dynamo graph."""
        self.split: Optional[fx.GraphModule] = None
        """The split module the compiled forward runs (once traced or restored)."""

    # ------------------------------------------------------------------ compile
    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        t0 = time.perf_counter()
        self.traced_files = traced_files(gm)
        split, self.pieces = split_graph(gm, self.splitting_ops)
        self.stats.split_time_s = time.perf_counter() - t0
        self.stats.num_pieces = sum(not p.is_splitting_op for p in self.pieces)
        self.stats.num_splitting_ops = sum(p.is_splitting_op for p in self.pieces)
        fakes = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
        self._static_inputs = static_piece_inputs(gm, split, example_inputs)
        self._dump("split_graph.py", module_code(split))
        program = {"pieces": {}, "ranges": [[r.start, r.end] for r in self.ranges]}
        t1 = time.perf_counter()
        lock = self.store.lock() if self.store is not None else contextlib.nullcontext()
        with lock:
            piece_inputs = piece_example_inputs(split, fakes)
            bar = _progress(self.progress, len(self.pieces) - self.stats.num_splitting_ops)
            for info in self.pieces:
                if info.is_splitting_op:
                    continue
                sub = getattr(split, info.name)
                inputs = piece_inputs[info.name]
                ts = time.perf_counter()
                runtime, record = self._build_piece(info, sub, inputs)
                self.stats.piece_times[info.name] = time.perf_counter() - ts
                self._install(split, info, runtime)
                program["pieces"][info.name] = record
                bar.update(1)
            bar.close()
        self.stats.compile_time_s = time.perf_counter() - t1
        self.stats.unique_graphs = len({r["graph_hash"] for r in program["pieces"].values()})
        try:
            program["graph"] = graph_to_json(split, skip_submodules=set(program["pieces"]))
            self._program = program
        except NotSerializable as e:
            logger.info("split graph not serializable (%s): warm starts will re-trace", e)
        inline_splitting_ops(split)  # after the program is saved: it keeps the submodules
        bind_direct_splitting_ops(split)
        self.split = split
        return split

    def _build_piece(
        self, info: PieceInfo, sub: fx.GraphModule, inputs: list
    ) -> tuple[PiecewiseRuntime, dict]:
        ghash = graph_hash(sub, inputs)
        self._dump(f"{info.name}.py", sub.code)
        single = not isinstance(sub.graph.output_node().args[0], (tuple, list))
        entries, record = (
            [],
            {
                "graph_hash": ghash,
                "size_from": list(token_source(inputs)),
                "single_output": single,
                "entries": {},
            },
        )
        for rng in self.ranges:
            fn, source = self._compile_or_load(info, sub, inputs, rng, ghash, single)
            entries.append(RangeEntry(rng, fn, source))
            record["entries"][str(rng)] = self._entry_key(info, rng)
        size_from = tuple(record["size_from"])
        return PiecewiseRuntime(info.name, entries, self.max_num_tokens, size_from), record

    def _entry_key(self, info: PieceInfo, rng: CompileRange) -> str:
        return f"{rng}/piece_{info.index}/{self.compiler.name}"

    def _compile_or_load(
        self,
        info: PieceInfo,
        sub: fx.GraphModule,
        inputs: list,
        rng: CompileRange,
        ghash: str,
        single: bool,
    ) -> tuple[Callable, str]:
        artifact = _artifact_id(ghash, rng)
        key = self._entry_key(info, rng)
        if artifact in self._compiled:  # an identical piece of this model: share its code
            self.stats.shared += 1
            if self._uses_store():
                self.store.link(key, artifact)  # and its stored artifact
            self._piece_done(info.name, rng, "shared", self._compiled_by.get(artifact))
            return self._compiled[artifact], "shared"
        fn = self._load(key, single)
        source = "loaded"
        if fn is None:
            if self.graph_pass is not None:
                self.graph_pass.set_current_piece(
                    info.name, rng, static_inputs=self._static_inputs.get(info.name, {})
                )
            fn, save = self.compiler.compile(sub, inputs, rng)
            if single and getattr(fn, "lean", False):  # a lean module returns a flat list
                fn = _first_output(fn)
            self.stats.compiles += 1
            source = "compiled"
            if self.store is not None and save is not None:
                self.store.store(key, artifact, save)
        self._compiled[artifact] = fn
        self._compiled_by[artifact] = info.name
        self._piece_done(info.name, rng, source)
        return fn, source

    def _piece_done(
        self, piece: str, rng: CompileRange, source: str, shared_with: Optional[str] = None
    ) -> None:
        """Tell the pass manager how this piece instance got its code (for its records)."""
        if self.graph_pass is not None:
            self.graph_pass.piece_done(piece, rng, source, shared_with)

    def _must_compile(self) -> bool:
        """The pass manager verifies or dumps: every piece is compiled, nothing loaded."""
        return self.graph_pass is not None and self.graph_pass.must_run

    def _uses_store(self) -> bool:
        return self.store is not None and self.compiler.produces_artifacts

    def _load(self, key: str, single_output: bool) -> Optional[Callable]:
        if not self._uses_store() or self._must_compile():
            return None
        path = self.store.lookup(key)
        if path is None:
            return None
        try:
            fn = self.compiler.load(path)
        except Exception as e:
            if is_environment_error(e):
                # The disk refused (e.g. no space to extract a kernel): the artifact verified
                # and is kept; this process compiles the piece in memory and stops writing.
                self.store.refuse_writes(e)
                return None
            # A verified file that no longer loads: drop it, recompile
            # (left in the index, the recompiled artifact would be deduplicated onto it)
            self.store.discard(key, f"failed to load ({type(e).__name__}: {e}); recompiling")
            return None
        self.stats.loads += 1
        if single_output:  # a loaded artifact returns a flat list even for one output
            return _first_output(fn)
        return fn

    def _register(self, info: PieceInfo, runtime: PiecewiseRuntime) -> Callable:
        """Record the runtime; returns what stands in the piece's place (maybe wrapped)."""
        self.runtimes[info.name] = runtime
        fn = self.wrap_piece(runtime, info) if self.wrap_piece else runtime
        self._installed[info.name] = fn
        return fn

    def _install(self, split: fx.GraphModule, info: PieceInfo, runtime: PiecewiseRuntime):
        split.__dict__[info.name] = self._register(info, runtime)  # instance dict wins

    def split_wrappers(self) -> list:
        """What stands in each piece's place in the split module (runtime or its wrapper)."""
        return list(self._installed.values())

    # ------------------------------------------------------------------ warm start
    def save_program(self, extra: dict) -> None:
        """Persist the program skeleton (plus ``extra``, e.g. the argument binding)."""
        if self.store is None or self._program is None:
            return
        self.store.store_blob(PROGRAM_BLOB, json.dumps({**self._program, **extra}).encode())

    def restore(self) -> Optional[tuple[fx.GraphModule, dict]]:
        """Rebuild the compiled program from the cache without Dynamo; None if incomplete."""
        if not self._uses_store() or self._must_compile():
            return None
        blob = self.store.load_blob(PROGRAM_BLOB)
        if blob is None:
            return None
        try:
            program = json.loads(blob)
            if program["ranges"] != [[r.start, r.end] for r in self.ranges]:
                return None
            modules, loaded = {}, []
            for name, rec in program["pieces"].items():
                entries = []
                for rng in self.ranges:
                    key = rec["entries"][str(rng)]
                    artifact = _artifact_id(rec["graph_hash"], rng)
                    fn = self._compiled.get(artifact) or self._load(key, rec["single_output"])
                    if fn is None:
                        return None
                    self._compiled[artifact] = fn
                    entries.append(RangeEntry(rng, fn, "loaded"))
                    loaded.append((name, rng))
                size_from = (rec["size_from"][0], rec["size_from"][1])
                runtime = PiecewiseRuntime(name, entries, self.max_num_tokens, size_from)
                info = PieceInfo(name, int(name.removeprefix("submod_")), False)
                modules[name] = self._register(info, runtime)
            split = graph_from_json(program["graph"], modules)
            inline_splitting_ops(split)
            bind_direct_splitting_ops(split)
            for name, rng in loaded:
                self._piece_done(name, rng, "loaded")
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            warnings.warn(f"{self.store.dir / PROGRAM_BLOB} is unusable ({e}); re-tracing")
            return None
        self.stats.num_pieces = len(program["pieces"])
        self.stats.unique_graphs = len({r["graph_hash"] for r in program["pieces"].values()})
        self.split = split
        return split, program

    def native_parts(self) -> Optional[tuple[int, Optional[str]]]:
        """Parts of one forward that report their native calls to a recording of the whole
        forward, or why none can be made (:func:`backends.piecewise.split.native_parts`);
        None until the model is traced (or restored)."""
        if self.split is None:
            return None
        return native_parts(self.split, set(self.runtimes))

    def code_digest(self) -> Optional[str]:
        """One digest of the code every compiled piece runs (each piece's lean module digest,
        by piece and range); None when a piece has no lean form (its code is not known as
        text).  Two models with equal digests run the same compiled code: an ablation whose
        toggle changed nothing compiles to the baseline's digest."""
        parts = []
        for name, runtime in sorted(self.runtimes.items()):
            for rng, entry in sorted(runtime.entries.items(), key=lambda kv: str(kv[0])):
                digest = getattr(entry.runnable, "code_digest", None)
                if digest is None:
                    return None
                parts.append(f"{name}|{rng}|{digest}")
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24] if parts else None

    def code_digests(self) -> Optional[dict[str, str]]:
        """Per compile range (its name), one digest of the code every piece runs on that
        range; None when a piece has no lean form.  A toggle whose decode range digests equal
        its baseline's changed nothing a decode step runs."""
        per_range: dict[str, list[str]] = {}
        for name, runtime in sorted(self.runtimes.items()):
            for rng, entry in runtime.entries.items():
                digest = getattr(entry.runnable, "code_digest", None)
                if digest is None:
                    return None
                per_range.setdefault(str(rng), []).append(f"{name}|{digest}")
        return {
            rng: hashlib.sha256("\n".join(sorted(parts)).encode()).hexdigest()[:24]
            for rng, parts in sorted(per_range.items())
        }

    def range_for(self, num_tokens: int) -> Optional[str]:
        """The name of the range a step of ``num_tokens`` (padded) tokens runs: an exact
        single size first, else the range holding it; None outside every range."""
        exact = [r for r in self.ranges if r.is_single_size and num_tokens in r]
        holding = [r for r in self.ranges if not r.is_single_size and num_tokens in r]
        chosen = (exact or holding or [None])[0]
        return None if chosen is None else str(chosen)

    def _dump(self, name: str, text: str) -> None:
        if self.dump_path:
            import pathlib

            p = pathlib.Path(self.dump_path)
            p.mkdir(parents=True, exist_ok=True)
            (p / name).write_text(text)


def _first_output(fn: Callable) -> Callable:
    def call(*args):
        return fn(*args)[0]

    call.lean = getattr(fn, "lean", False)  # type: ignore[attr-defined]  # lean artifact
    call.code_digest = getattr(fn, "code_digest", None)  # type: ignore[attr-defined]
    return call


def _artifact_id(ghash: str, rng: CompileRange) -> str:
    """What a compiled piece depends on beyond the cache key: its graph and its range. The
    in-memory sharing above and the store's artifact dedup (its ``graph_hash``) use this one
    id."""
    return f"{ghash}-{rng}"


def _progress(enabled: bool, total: int):
    if enabled:
        try:
            from tqdm import tqdm

            return tqdm(total=total, desc="compiling pieces", leave=False)
        except ImportError:  # pragma: no cover
            pass

    class _Silent:
        def update(self, n): ...

        def close(self): ...

    return _Silent()
