"""The pass manager: runs the configured passes, in order, on every piece.

It is Inductor's ``post_grad_custom_post_pass`` (a ``CustomGraphPass``, so :meth:`uuid` enters
Inductor's FX-graph cache key) and, through :meth:`run_on_graph_module`, the graph pass of the
eager adaptor.  Per pass and per piece it records wall time and match count; with
``debug_dump_path`` it writes each piece's graph before the first pass and after every pass;
with ``verify_passes`` it runs the differential check of :mod:`passes.verify` after each pass.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import re
import time
import uuid as uuid_module
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch

from framework.core.compile_range import range_name
from framework.core.config import PassConfig
from passes.base import CompileRange, GraphPass, PassContext
from passes.registry import order_passes, resolve_pass
from passes.verify_inputs import PassVerificationError

logger = logging.getLogger(__name__)


@dataclass
class PieceRecord:
    """One pass on one piece."""

    piece: str
    compile_range: Optional[tuple[int, int]]
    time_s: float
    matches: Optional[int]
    """None: the pass did not report a count (a plain callable that returned none)."""
    max_abs_error: Optional[float] = None
    max_rel_error: Optional[float] = None


RAN = "ran"
SKIPPED = "skipped"
"""The passes ran on the piece, but this pass's ``is_applicable(range)`` refused the range."""
NOT_RUN_LOADED = "not run: artifact loaded"
NOT_RUN_INDUCTOR_HIT = "not run: Inductor cache hit"


@dataclass
class PieceInstance:
    """One piece of the model (e.g. one layer) for one range, and whether the passes ran on
    its graph: directly (``shared_with`` None), on the identical piece it shares compiled code
    with, or not at all (its artifact came from a cache)."""

    piece: str
    compile_range: Optional[tuple[int, int]]
    status: str
    shared_with: Optional[str] = None


@dataclass
class PassRecord:
    name: str
    is_fusion: bool
    pieces: list[PieceRecord] = field(default_factory=list)
    """One record per run: per *unique* graph and range (identical layers compile once)."""

    @property
    def total_time_s(self) -> float:
        return sum(p.time_s for p in self.pieces)

    @property
    def total_matches(self) -> Optional[int]:
        """Sum over the runs; None when the pass reported no count in any run."""
        reported = [p.matches for p in self.pieces if p.matches is not None]
        return sum(reported) if reported or not self.pieces else None


def _status_text(by_range: dict[str, str]) -> str:
    """One line: ``ran`` when every range agrees, else ``ran on range_4-4; skipped on
    range_1-512`` (ranges with the same status grouped)."""
    if not by_range:
        return "not run: no piece"
    groups: dict[str, list[str]] = {}
    for rng, status in by_range.items():
        groups.setdefault(status, []).append(rng)
    if len(groups) == 1:
        return next(iter(groups))
    return "; ".join(f"{status} on {', '.join(rngs)}" for status, rngs in groups.items())


def _range_tuple(compile_range: Optional[CompileRange]) -> Optional[tuple[int, int]]:
    return None if compile_range is None else (int(compile_range.start), int(compile_range.end))


class PassManager:
    """Ordered passes from a resolved :class:`PassConfig` (``.passes`` is a list of names).

    It implements Inductor's ``CustomGraphPass`` interface (``__call__`` + ``uuid``) and is
    registered as one by the Inductor adaptor (``backends.piecewise.compiler``) only when a
    compile is about to run: importing ``torch._inductor`` imports Dynamo, which a warm start
    must not pay for.

    The backend calls :meth:`set_current_piece` before compiling each piece so records, dumps
    and ``is_applicable`` see the piece's name and token range.
    """

    def __init__(
        self,
        pass_config: PassConfig,
        *,
        dtype: Optional[torch.dtype] = None,
        quant_config_hash: Optional[str] = None,
        debug_dump_path: Optional[str] = None,
    ):
        if pass_config.passes is None:
            raise ValueError(
                "PassManager: PassConfig.passes is None; resolve the compilation "
                "config first (CompilationConfig.resolve) so the level fills it"
            )
        self.pass_config = pass_config
        self.context = PassContext(
            dtype=dtype,
            quant_config_hash=quant_config_hash,
            sequence_parallel_min_tokens=pass_config.sequence_parallel_min_tokens,
        )
        self.debug_dump_path = debug_dump_path
        self.names = order_passes(list(pass_config.passes))
        self.passes: list[GraphPass] = [resolve_pass(n)(self.context) for n in self.names]
        self.records = {p.name: PassRecord(p.name, p.is_fusion) for p in self.passes}
        self._piece = "graph"
        self._range: Optional[CompileRange] = None
        self._calls: dict[tuple[str, Optional[tuple[int, int]]], int] = {}
        self.instances: list[PieceInstance] = []
        """Every piece instance the backend reported (:meth:`piece_done`), in model order."""
        self._calls_before = 0
        self._static_inputs: dict[int, torch.Tensor] = {}
        self._verifier = None
        if pass_config.verify_passes:
            # Deferred: the verifier imports fake tensors (Dynamo's stack), which a warm
            # start without verification never needs.
            from passes.verify import PassVerifier

            self._verifier = PassVerifier(tolerance=pass_config.verify_tolerance, dtype=dtype)

    # --- the backend's hooks -----------------------------------------------------------------

    def set_current_piece(
        self,
        piece_name: str,
        compile_range: Optional[CompileRange] = None,
        static_inputs: Optional[dict[int, torch.Tensor]] = None,
    ) -> None:
        """``static_inputs``: real values of piece inputs by position (weights, buffers); the
        verifier feeds them instead of random values."""
        self._piece = piece_name
        self._range = compile_range
        self._static_inputs = dict(static_inputs or {})
        self._calls_before = self._calls.get((piece_name, _range_tuple(compile_range)), 0)

    def __call__(self, graph: torch.fx.Graph) -> None:
        piece, rng = self._piece, self._range
        key = (piece, _range_tuple(rng))
        # The same piece can reach us twice for one range (e.g. a recompile); keep both dumps.
        call_index = self._calls[key] = self._calls.get(key, 0) + 1
        dump_dir = self._dump_dir(piece, rng, call_index)
        if dump_dir:
            _write_graph(dump_dir, "00_before_passes.txt", graph, "input graph")
        if self._verifier:
            with self._naming_the_piece(piece, rng):
                self._verifier.start_piece(graph, rng, self._static_inputs)
        for i, p in enumerate(self.passes, start=1):
            if not p.is_applicable(rng):
                continue
            p.match_count = 0
            t0 = time.perf_counter()
            p(graph)
            elapsed = time.perf_counter() - t0
            graph.lint()
            count = p.match_count
            record = PieceRecord(
                piece, _range_tuple(rng), elapsed, None if count is None else int(count)
            )
            self.records[p.name].pieces.append(record)
            logger.debug(
                "pass %s on %s %s: %s match(es) in %.1f ms",
                p.name,
                piece,
                record.compile_range,
                record.matches,
                elapsed * 1e3,
            )
            if dump_dir:
                _write_graph(
                    dump_dir,
                    f"{i:02d}_after_{_safe(p.name)}.txt",
                    graph,
                    f"after pass {p.name} ({_matches_text(record.matches)})",
                )
            if self._verifier:
                with self._naming_the_piece(piece, rng):
                    err = self._verifier.check_pass(p.name, graph)
                record.max_abs_error, record.max_rel_error = err.max_abs, err.max_rel

    @staticmethod
    @contextlib.contextmanager
    def _naming_the_piece(piece: str, rng: Optional[CompileRange]) -> Iterator[None]:
        """A verification failure's message starts with the piece and the range."""
        try:
            yield
        except PassVerificationError as e:
            where = f"piece {piece}, {'any range' if rng is None else rng}"
            detail = str(e).removeprefix("verify_passes: ")
            raise PassVerificationError(f"verify_passes: {where}: {detail}") from None

    def verify_summary(self) -> Optional[str]:
        """One line after a verified compile: how much was checked and the largest error;
        None when not verifying (or nothing was compiled)."""
        if self._verifier is None:
            return None
        checked = [p for r in self.records.values() for p in r.pieces]
        if not checked:
            return None
        pieces = {(p.piece, p.compile_range) for p in checked}
        worst = max((p.max_abs_error or 0.0) for p in checked)
        return (
            f"verify_passes: OK: {len(self.records)} passes on {len(pieces)} piece compiles "
            f"(unique piece x range), max abs error {worst:.3g} "
            f"(tolerance {self._verifier.tol:g})"
        )

    def run_on_graph_module(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        """Eager adaptor path: run the passes on an aten-level functional ``gm``, recompile."""
        self(gm.graph)
        gm.recompile()
        return gm

    # --- results -----------------------------------------------------------------------------

    def piece_done(
        self,
        piece_name: str,
        compile_range: Optional[CompileRange],
        source: str,
        shared_with: Optional[str] = None,
    ) -> None:
        """The backend's report after each (piece, range): ``source`` is ``compiled``,
        ``shared`` (same compiled code as piece ``shared_with``) or ``loaded`` (artifact
        cache).  A compile during which the passes never ran was an Inductor cache hit."""
        rng = _range_tuple(compile_range)
        if source == "loaded":
            status = NOT_RUN_LOADED
        elif source == "shared":
            original = next(
                (
                    i
                    for i in reversed(self.instances)
                    if i.piece == shared_with and i.compile_range == rng
                ),
                None,
            )
            status = original.status if original is not None else RAN
        else:
            ran = self._calls.get((piece_name, rng), 0) > self._calls_before
            status = RAN if ran else NOT_RUN_INDUCTOR_HIT
        self.instances.append(
            PieceInstance(piece_name, rng, status, shared_with if source == "shared" else None)
        )
        if source == "shared" and self.debug_dump_path:
            # Identical pieces compile once; say where this one's graphs are.
            with open(
                os.path.join(self._dump_dir(piece_name, compile_range, 1), "same_graph_as.txt"), "w"
            ) as f:
                f.write(f"{shared_with}\n")

    def stats(self) -> dict[str, Any]:
        """Per pass: ``status`` (``ran``, or why not: ``not run: artifact loaded`` / ``not
        run: Inductor cache hit``), ``total_matches`` counted per piece instance (8 identical
        layers matching once each: 8), ``unique_graph_matches`` (per compiled graph: 1),
        total time, the per-run records (``pieces``) and the per-instance ones
        (``instances``)."""
        return {name: self._pass_stats(r) for name, r in self.records.items()}

    def _pass_stats(self, r: PassRecord) -> dict[str, Any]:
        runs = {(p.piece, p.compile_range): p.matches for p in r.pieces}
        instances = []
        for inst in self.instances:
            source = inst.shared_with or inst.piece
            matches = runs.get((source, inst.compile_range)) if inst.status == RAN else None
            instances.append({**vars(inst), "matches": matches})
        reported = {(i.piece, i.compile_range) for i in self.instances}
        # Runs the backend did not report (a manager used on its own): one instance each.
        unreported = sum(m or 0 for k, m in runs.items() if k not in reported)
        total = unreported + sum(i["matches"] or 0 for i in instances)
        counted = r.total_matches is not None
        by_range = self._status_by_range(r)
        return {
            "status": _status_text(by_range),
            "status_by_range": by_range,
            "total_time_s": r.total_time_s,
            "total_matches": total if counted else None,
            "unique_graph_matches": r.total_matches,
            "matches_reported": counted,
            "pieces": [vars(p).copy() for p in r.pieces],
            "instances": instances,
        }

    def _status_by_range(self, r: PassRecord) -> dict[str, str]:
        """Per compile range (its name): ``ran``, ``skipped`` (the passes ran on the range's
        pieces but this pass's ``is_applicable`` refused the range), or why no pass ran
        (``not run: artifact loaded`` / ``not run: Inductor cache hit``)."""
        ran_on = {p.compile_range for p in r.pieces}
        statuses: dict[Optional[tuple[int, int]], set[str]] = {}
        for inst in self.instances:
            st = inst.status
            if st == RAN and inst.compile_range not in ran_on:
                st = SKIPPED
            statuses.setdefault(inst.compile_range, set()).add(st)
        for rng in ran_on:  # runs the backend did not report (a manager used on its own)
            statuses.setdefault(rng, set()).add(RAN)
        return {
            "any" if rng is None else range_name(*rng): ", ".join(sorted(sts))
            for rng, sts in sorted(statuses.items(), key=lambda kv: kv[0] or (0, 0))
        }

    def warn_unmatched(self) -> list[str]:
        """Log a warning naming each enabled fusion that ran on at least one piece and matched
        nothing in all of them (unless ``PassConfig.warn_on_no_match`` is off); returns those
        names.  (Pieces loaded from a cache never run
        passes, so a fusion that never ran is not reported.)"""
        unmatched = [
            r.name
            for r in self.records.values()
            if r.is_fusion and r.pieces and r.total_matches == 0
        ]
        if not self.pass_config.warn_on_no_match:
            return unmatched
        for name in unmatched:
            logger.warning(
                "pass %s is enabled but matched nothing in the whole model (%d "
                "pieces); check the model's graph or disable it",
                name,
                len(self.records[name].pieces),
            )
        return unmatched

    # --- cache key ---------------------------------------------------------------------------

    def cache_factors(self) -> dict[str, Any]:
        """The artifact-cache key's ``passes`` factor: the run order and each pass's uuid by
        name, so ``python -m framework.cache explain`` can name the pass that differs."""
        return {
            "order": list(self.names),
            "uuid": {p.name: p.uuid() for p in self.passes},
            "dtype": str(self.context.dtype),
            "quant_config_hash": self.context.quant_config_hash,
        }

    def cache_uuid(self) -> str:
        """Changes when the pass list, a pass's code, or a pass's config changes."""
        return hashlib.sha256(json.dumps(self.cache_factors(), sort_keys=True).encode()).hexdigest()

    @property
    def must_run(self) -> bool:
        """Verifying or dumping: the passes must actually run on every piece, so neither
        Inductor's FX-graph cache nor the artifact cache may stand in for a compile."""
        return self._verifier is not None or bool(self.debug_dump_path)

    def uuid(self) -> Optional[str]:
        """Inductor's cache key part.  While verifying or dumping, a key no earlier compile
        had (a per-call nonce), because a cache hit would skip the passes entirely.  (Not
        ``None``: that makes Inductor bypass its cache, and then ``standalone_compile`` has no
        artifact to save.)"""
        if self.must_run:
            return f"{self.cache_uuid()}-run-{_PROCESS_NONCE}-{next(_NONCE)}"
        return self.cache_uuid()

    # --- dumps -------------------------------------------------------------------------------

    def _dump_dir(self, piece: str, rng: Optional[CompileRange], call_index: int) -> Optional[str]:
        if not self.debug_dump_path:
            return None
        rng_name = "any" if rng is None else range_name(rng.start, rng.end)
        suffix = "" if call_index == 1 else f"_call{call_index}"
        path = os.path.join(self.debug_dump_path, "passes", _safe(piece), rng_name + suffix)
        os.makedirs(path, exist_ok=True)
        return path


_PROCESS_NONCE = uuid_module.uuid4().hex
"""Distinguishes this process's forced-miss keys from every other process's."""
_NONCE = itertools.count()
"""One counter for every manager of the process: no forced-miss key is ever reused."""


def _matches_text(matches: Optional[int]) -> str:
    return "matches not reported" if matches is None else f"{matches} matches"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _write_graph(directory: str, filename: str, graph: torch.fx.Graph, title: str) -> None:
    with open(os.path.join(directory, filename), "w") as f:
        f.write(f"# {title}\n{graph}\n")
