"""Differential check of passes (``PassConfig.verify_passes``).

For a piece graph the verifier runs the graph before the first pass and after every pass on
the same inputs (:mod:`passes.verify_inputs`: the piece's real weights and buffers, random
activations with the symbolic token count set to a concrete size from the compile range, and
for a graph that contains attention a private one-request batch) and reports the maximum
absolute and relative error of the outputs per pass.  Only values the piece defines are
compared: uninitialised allocations (``empty``) that the graph never writes, and their views,
are skipped as nodes and as outputs.  An error above the tolerance raises
:class:`PassVerificationError` naming the pass and the first diverging node, found by walking
the graph in order: a node the pass kept (same name) whose value changed, or a node the pass
inserted whose value differs from the node it replaced (compared where a kept node's input
changed), or else the node producing the first diverging output.  A quantized value that moved
by an allowed quantization step taints what it feeds: those later differences are excused,
since one step through a matmul can exceed a float tolerance without any pass being wrong.

An output passes when its max abs error, or that error relative to the output's largest
magnitude, is within ``tol`` (``verify_tolerance``, or per compute dtype: fp32 1e-3, bf16/fp16
5e-2); quantized outputs may differ by one quantization step (int8: 1; fp8 e4m3: 12.5%),
because fusing a norm into its quant removes an intermediate rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx

from framework.compat.ops import no_python_dispatcher, unset_fake_temporarily
from framework.core.compile_range import CompileRange
from passes.verify_inputs import (  # noqa: F401
    _FP8,
    AMPLIFYING_OPS,
    DEFAULT_TOKENS,
    UNINITIALIZED_OPS,
    PassVerificationError,
    _written_args,
    attention_calls,
    attention_context,
    concrete_size,
    op_name,
    random_inputs,
    symbol_bindings,
    undefined_nodes,
)

DTYPE_TOLERANCE = {
    torch.float32: 1e-3,
    torch.float64: 1e-6,
    torch.bfloat16: 5e-2,
    torch.float16: 5e-2,
}


@dataclass
class PassError:
    max_abs: float
    max_rel: float


class _Recorder(torch.fx.Interpreter):
    """Runs a graph, keeping a copy of every node's tensor value as produced (``values``) and,
    for tensors a later op writes in place, the value after the write (``written``): what the
    readers of a buffer that ``fix_functionalization`` made in-place see."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm)
        self.values: dict[str, Any] = {}
        self.written: dict[str, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.values[n.name] = out.detach().clone()
        if n.op == "call_function":
            for arg in _written_args(n):
                self.written[arg.name] = self.env[arg].detach().clone()
        return out


def _as_module(graph: torch.fx.Graph) -> torch.fx.GraphModule:
    copy = torch.fx.Graph()
    out = copy.graph_copy(graph, {})
    copy.output(out)
    root = graph.owning_module if graph.owning_module is not None else torch.nn.Module()
    return torch.fx.GraphModule(root, copy)


def _clone(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) else x


_SEEN = "seen:"
"""Key prefix of a node's value as its readers saw it (after in-place writes)."""

MAX_QUANT_STEPS = 2
"""Quantized values a fusion may move: one step from removing an intermediate rounding of the
value, one more from the same rounding moving a dynamic per-token scale."""


def _is_quantized(t: torch.Tensor) -> bool:
    return t.dtype == torch.int8 or t.dtype in _FP8


def compare(before: torch.Tensor, after: torch.Tensor, tol: float) -> tuple[float, float, bool]:
    """(max abs error, max abs error relative to ``before``'s largest magnitude, within
    tolerance).  Float tensors pass when either error is within ``tol``; int8 when no value
    moved more than ``MAX_QUANT_STEPS``; fp8 when the relative error is within one e4m3 step
    at the top of the range per allowed step."""
    if before.shape != after.shape or before.dtype != after.dtype:
        return math.inf, math.inf, False
    if before.numel() == 0:
        return 0.0, 0.0, True
    if not (before.dtype.is_floating_point or _is_quantized(before)):
        bad = bool((before != after).any())
        return float(bad), float(bad), not bad
    b, a = before.float(), after.float()
    finite_b, finite_a = torch.isfinite(b), torch.isfinite(a)
    if not torch.equal(finite_b, finite_a):
        return math.inf, math.inf, False
    b, a = b[finite_b], a[finite_a]
    if b.numel() == 0:
        return 0.0, 0.0, True
    max_abs = float((a - b).abs().max())
    scale = float(b.abs().max())
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    if before.dtype == torch.int8:
        ok = max_abs <= MAX_QUANT_STEPS
    elif before.dtype in _FP8:
        ok = max_rel <= max(tol, 0.125 * MAX_QUANT_STEPS)  # e4m3: 3 mantissa bits
    else:
        ok = max_abs <= tol or max_rel <= tol
    return max_abs, max_rel, ok


@dataclass
class _Divergence:
    node: Optional[str]
    """Description of the first node whose divergence the pass caused (None: none found)."""
    tainted: set[str]
    """Nodes downstream of an allowed quantization-step change (their divergence is excused:
    quantization is discontinuous, so a legitimately moved step can move later values by
    more than the float tolerance)."""


class PassVerifier:
    """Holds a piece's random inputs and the outputs of its graph before the current pass."""

    def __init__(
        self, tolerance: Optional[float] = None, dtype: Optional[torch.dtype] = None, seed: int = 0
    ):
        self.tolerance = tolerance
        self.dtype = dtype
        self.seed = seed
        self._inputs: list[Any] = []
        self._values: dict[str, Any] = {}
        self._outputs: list[Any] = []
        self._input_names: dict[str, list[str]] = {}
        self._undefined: set[str] = set()
        self._output_names: list[Optional[str]] = []
        self._size = DEFAULT_TOKENS
        self.tol = 0.0

    def _tolerance_for(self, graph: torch.fx.Graph) -> float:
        if self.tolerance is not None:
            return self.tolerance
        dtypes = (
            {self.dtype}
            if self.dtype is not None
            else {
                n.meta["val"].dtype
                for n in graph.find_nodes(op="placeholder")
                if isinstance(n.meta.get("val"), torch.Tensor)
            }
        )
        # The loosest compute dtype decides: one bf16 input makes the whole piece bf16-precise.
        return max((DTYPE_TOLERANCE.get(d, 1e-4) for d in dtypes if d is not None), default=1e-4)

    def _run(self, graph: torch.fx.Graph) -> tuple[dict[str, Any], list[Any]]:
        gm = _as_module(graph)
        rec = _Recorder(gm)
        # Inductor calls the passes with the Python dispatcher on.  A collective issued here
        # hands that thread-local state to the process group's worker thread (gloo), whose
        # own ops (``narrow`` of the gathered buffer) then need the GIL, which this thread
        # holds while it blocks in ``wait_tensor``: a deadlock.  Real tensors need no
        # Python dispatcher.
        with torch.no_grad(), no_python_dispatcher():
            outs = rec.run(*[_clone(x) for x in self._inputs])
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        # Inputs swapped by a pass are compared as their readers saw them: after any write.
        rec.values.update({f"{_SEEN}{k}": v for k, v in {**rec.values, **rec.written}.items()})
        return rec.values, outs

    def start_piece(
        self,
        graph: torch.fx.Graph,
        compile_range: Optional[CompileRange],
        known_inputs: Optional[dict[int, torch.Tensor]] = None,
    ) -> None:
        """Run the piece's graph before any pass; the reference for the first pass.
        ``known_inputs``: real values of some inputs by position (weights, buffers)."""
        # Compilers may call passes with a fake mode active; verification needs real tensors.
        with unset_fake_temporarily():
            self._size = concrete_size(compile_range)
            self._known = known_inputs or {}
            self._start_piece(graph, compile_range)

    def check_pass(self, pass_name: str, graph: torch.fx.Graph) -> PassError:
        """Run ``graph`` (after ``pass_name``) and compare with the graph before that pass."""
        with unset_fake_temporarily():
            return self._check_pass(pass_name, graph)

    def _start_piece(self, graph: torch.fx.Graph, compile_range: Optional[CompileRange]) -> None:
        self.tol = self._tolerance_for(graph)
        self._inputs = random_inputs(graph, concrete_size(compile_range), self.seed, self._known)
        self._remember(graph)
        try:
            with attention_context(graph, self._size):
                self._values, self._outputs = self._run(graph)
        except Exception as e:
            raise PassVerificationError(
                f"verify_passes: the piece does not run on random inputs before any pass "
                f"({type(e).__name__}: {e})"
            ) from e

    def _check_pass(self, pass_name: str, graph: torch.fx.Graph) -> PassError:
        try:
            with attention_context(graph, self._size):
                values, outputs = self._run(graph)
        except Exception as e:
            raise PassVerificationError(
                f"verify_passes: pass {pass_name!r} produced a graph that fails to run "
                f"({type(e).__name__}: {e})"
            ) from e
        if len(outputs) != len(self._outputs):
            raise PassVerificationError(
                f"verify_passes: pass {pass_name!r} changed the number "
                f"of outputs from {len(self._outputs)} to {len(outputs)}"
            )
        undefined = undefined_nodes(graph)
        walk = self._walk(graph, values, undefined)
        producers = _output_producers(graph)
        max_abs = max_rel = 0.0
        failures = []
        for i, (b, a) in enumerate(zip(self._outputs, outputs)):
            if (
                not isinstance(b, torch.Tensor)
                or self._output_names[i] in self._undefined
                or _name(producers[i]) in undefined
            ):
                continue  # garbage before or after: nothing the piece defines
            ea, er, ok = compare(b, a, self.tol)
            max_abs, max_rel = max(max_abs, ea), max(max_rel, er)
            producer = producers[i] if i < len(producers) else None
            excused = isinstance(producer, torch.fx.Node) and producer.name in walk.tainted
            if not ok and not excused:
                failures.append(i)
        if walk.node is not None or failures:
            where = walk.node or _describe(producers[failures[0]])
            raise PassVerificationError(
                f"verify_passes: pass {pass_name!r} changed the piece beyond tolerance "
                f"{self.tol:g} (outputs: max abs error {max_abs:.4g}, max rel error "
                f"{max_rel:.4g}); first diverging node: {where}"
            )
        self._values, self._outputs = values, outputs
        self._remember(graph)
        return PassError(max_abs, max_rel)

    def _remember(self, graph: torch.fx.Graph) -> None:
        """What the next pass's check compares against, besides the values."""
        self._input_names = _input_names(graph)
        self._undefined = undefined_nodes(graph)
        self._output_names = [_name(p) for p in _output_producers(graph)]

    def _walk(
        self, graph: torch.fx.Graph, values: dict[str, Any], undefined: set[str]
    ) -> _Divergence:
        """Graph order walk comparing every node the pass kept (same name) and every input the
        pass swapped under a kept node (old input's value vs. new input's value)."""
        tainted: set[str] = set()
        by_name = {n.name: n for n in graph.nodes}

        def check(name_before: str, node_after: torch.fx.Node, seen: bool) -> Optional[str]:
            if name_before in self._undefined or node_after.name in undefined:
                return None
            prefix = _SEEN if seen else ""
            before = self._values.get(prefix + name_before)
            after = values.get(prefix + node_after.name)
            if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)):
                return None
            max_abs, _, ok = compare(before, after, self.tol)
            if not ok:
                return _describe(node_after)
            if _is_quantized(before) and max_abs > 0:
                tainted.add(node_after.name)
            return None

        for node in graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            old_inputs = self._input_names.get(node.name)
            new_inputs = [a.name for a in node.all_input_nodes]
            if old_inputs is not None and len(old_inputs) == len(new_inputs):
                for old, new in zip(old_inputs, new_inputs):
                    if old != new and new not in tainted:
                        problem = check(old, by_name[new], seen=True)
                        if problem:
                            return _Divergence(problem, tainted)
            if any(n in tainted for n in new_inputs):
                tainted.add(node.name)
                continue
            if op_name(node) in AMPLIFYING_OPS and self._input_moved(
                old_inputs or new_inputs, new_inputs, values
            ):
                tainted.add(node.name)
                continue
            if node.name in self._values and node.target not in UNINITIALIZED_OPS:
                problem = check(node.name, node, seen=False)
                if problem:
                    return _Divergence(problem, tainted)
        return _Divergence(None, tainted)

    def _input_moved(
        self, old_inputs: list[str], new_inputs: list[str], values: dict[str, Any]
    ) -> bool:
        """Whether any input tensor of a node differs at all from its value before the pass."""
        for old, new in zip(old_inputs, new_inputs):
            before, after = self._values.get(_SEEN + old), values.get(_SEEN + new)
            if isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor):
                if before.shape != after.shape or not torch.equal(before, after):
                    return True
        return False


def _input_names(graph: torch.fx.Graph) -> dict[str, list[str]]:
    return {n.name: [a.name for a in n.all_input_nodes] for n in graph.nodes}


def _output_producers(graph: torch.fx.Graph) -> list[Any]:
    producers = torch.fx.node.map_arg(graph.output_node().args[0], lambda n: n)
    return list(producers) if isinstance(producers, (tuple, list)) else [producers]


def _name(node: Any) -> Optional[str]:
    return node.name if isinstance(node, torch.fx.Node) else None


def _describe(node: Any) -> str:
    if isinstance(node, torch.fx.Node):
        return f"{node.name} ({node.format_node()})"
    return repr(node)
