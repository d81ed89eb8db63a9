"""Differential check of passes (``PassConfig.verify_passes``).

For a piece graph the verifier runs the graph before the first pass and after every pass on
the same random inputs (dtypes and shapes from the placeholders' fake values, the symbolic
token count set to a concrete size from the compile range) and reports the maximum absolute
and relative error of the outputs per pass.  An error above the tolerance raises
:class:`PassVerificationError` naming the pass and the first diverging node: the earliest node
(in graph order) that exists under the same name before and after the pass and changed value,
or else the node producing the first diverging output.

An output passes when its max abs error, or that error relative to the output's largest
magnitude, is within ``tol`` (``verify_tolerance``, or per compute dtype: fp32 1e-4, bf16/fp16
5e-2); quantized outputs may differ by one quantization step (int8: 1; fp8 e4m3: 12.5%),
because fusing a norm into its quant removes an intermediate rounding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import sympy
import torch
import torch.fx

from passes.base import CompileRange

DTYPE_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6, torch.bfloat16: 5e-2,
                   torch.float16: 5e-2}
_FP8 = tuple(d for d in (getattr(torch, "float8_e4m3fn", None),
                         getattr(torch, "float8_e5m2", None)) if d is not None)
DEFAULT_TOKENS = 8
"""Token count used when the graph has a symbolic size and no compile range is known."""


class PassVerificationError(AssertionError):
    """A pass changed a piece's outputs beyond the tolerance."""


@dataclass
class PassError:
    max_abs: float
    max_rel: float


def concrete_size(compile_range: Optional[CompileRange]) -> int:
    """The token count verification runs with: small, inside the compile range."""
    if compile_range is None:
        return DEFAULT_TOKENS
    return max(int(compile_range.start), min(int(compile_range.end), DEFAULT_TOKENS))


def _concretize(value: Any, bindings: dict[sympy.Symbol, int], size: int) -> int:
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
        for sym in expr.free_symbols:
            bindings.setdefault(sym, size)
        return int(expr.subs(bindings))
    return int(value)


def random_inputs(graph: torch.fx.Graph, size: int, seed: int = 0) -> list[Any]:
    """Random tensors matching the placeholders' fake values; every shape symbol = ``size``."""
    gen = torch.Generator().manual_seed(seed)
    bindings: dict[sympy.Symbol, int] = {}
    inputs = []
    for node in graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):
            inputs.append(_concretize(val, bindings, size))
        elif isinstance(val, torch.Tensor):
            shape = [_concretize(s, bindings, size) for s in val.shape]
            inputs.append(_random_tensor(shape, val.dtype, gen).to(val.device))
        elif isinstance(val, (int, float, bool)) or val is None:
            inputs.append(val)
        else:
            raise PassVerificationError(
                f"verify_passes: placeholder {node.name} has no fake value (meta['val']) to "
                f"build a random input from (got {type(val).__name__})")
    return inputs


def _random_tensor(shape: list[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point and dtype not in _FP8:
        return torch.randn(shape, generator=gen).to(dtype)
    if dtype in _FP8:
        return (torch.randn(shape, generator=gen) * 8).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype == torch.int8:
        return torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
    # Other integers are usually indices (positions, slots): keep them small and non-negative.
    return torch.randint(0, 4, shape, generator=gen).to(dtype)


class _Recorder(torch.fx.Interpreter):
    """Runs a graph and keeps every node's value (cloned: later in-place ops must not change
    what was recorded)."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm)
        self.values: dict[str, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.values[n.name] = out.detach().clone()
        return out


def _as_module(graph: torch.fx.Graph) -> torch.fx.GraphModule:
    copy = torch.fx.Graph()
    out = copy.graph_copy(graph, {})
    copy.output(out)
    root = graph.owning_module if graph.owning_module is not None else torch.nn.Module()
    return torch.fx.GraphModule(root, copy)


def _clone(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) else x


UNINITIALIZED_OPS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
                     torch.ops.aten.empty_strided.default, torch.ops.aten.new_empty.default}
"""Allocations whose values are garbage until an op writes them: never compared."""


def compare(before: torch.Tensor, after: torch.Tensor, tol: float) -> tuple[float, float, bool]:
    """(max abs error, max abs error relative to ``before``'s largest magnitude, within
    tolerance).  Errors are judged against the tensor's scale, not element by element: a
    fusion that removes one rounding moves a quantized activation by one step, and the
    matmul after it spreads that step over every output element, near-zero ones included."""
    if before.shape != after.shape or before.dtype != after.dtype:
        return math.inf, math.inf, False
    if before.numel() == 0:
        return 0.0, 0.0, True
    quantized = before.dtype == torch.int8 or before.dtype in _FP8
    if not (before.dtype.is_floating_point or quantized):
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
        ok = max_abs <= 1.0  # one quantization step
    elif before.dtype in _FP8:
        ok = max_rel <= max(tol, 0.125)  # one e4m3 step at the top of the range (3 mantissa bits)
    else:
        ok = max_abs <= tol or max_rel <= tol
    return max_abs, max_rel, ok


class PassVerifier:
    """Holds a piece's random inputs and the outputs of its graph before the current pass."""

    def __init__(self, tolerance: Optional[float] = None, dtype: Optional[torch.dtype] = None,
                 seed: int = 0):
        self.tolerance = tolerance
        self.dtype = dtype
        self.seed = seed
        self._inputs: list[Any] = []
        self._values: dict[str, Any] = {}
        self._outputs: list[Any] = []
        self._order: list[str] = []
        self.tol = 0.0

    def _tolerance_for(self, graph: torch.fx.Graph) -> float:
        if self.tolerance is not None:
            return self.tolerance
        dtypes = {self.dtype} if self.dtype is not None else {
            n.meta["val"].dtype for n in graph.find_nodes(op="placeholder")
            if isinstance(n.meta.get("val"), torch.Tensor)}
        # The loosest compute dtype decides: one bf16 input makes the whole piece bf16-precise.
        return max((DTYPE_TOLERANCE.get(d, 1e-4) for d in dtypes if d is not None), default=1e-4)

    def _run(self, graph: torch.fx.Graph) -> tuple[dict[str, Any], list[Any]]:
        gm = _as_module(graph)
        rec = _Recorder(gm)
        with torch.no_grad():
            outs = rec.run(*[_clone(x) for x in self._inputs])
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        return rec.values, outs

    def start_piece(self, graph: torch.fx.Graph, compile_range: Optional[CompileRange]) -> None:
        """Run the piece's graph before any pass; the reference for the first pass."""
        self.tol = self._tolerance_for(graph)
        self._inputs = random_inputs(graph, concrete_size(compile_range), self.seed)
        try:
            self._values, self._outputs = self._run(graph)
        except Exception as e:
            raise PassVerificationError(
                f"verify_passes: the piece does not run on random inputs before any pass "
                f"({type(e).__name__}: {e})") from e

    def check_pass(self, pass_name: str, graph: torch.fx.Graph) -> PassError:
        """Run ``graph`` (after ``pass_name``) and compare with the graph before that pass."""
        try:
            values, outputs = self._run(graph)
        except Exception as e:
            raise PassVerificationError(
                f"verify_passes: pass {pass_name!r} produced a graph that fails to run "
                f"({type(e).__name__}: {e})") from e
        out_node = graph.output_node()
        producers = torch.fx.node.map_arg(out_node.args[0], lambda n: n)
        producers = list(producers) if isinstance(producers, (tuple, list)) else [producers]
        if len(outputs) != len(self._outputs):
            raise PassVerificationError(f"verify_passes: pass {pass_name!r} changed the number "
                                        f"of outputs from {len(self._outputs)} to {len(outputs)}")
        max_abs = max_rel = 0.0
        failures = []
        for i, (b, a) in enumerate(zip(self._outputs, outputs)):
            if not isinstance(b, torch.Tensor):
                continue
            ea, er, ok = compare(b, a, self.tol)
            max_abs, max_rel = max(max_abs, ea), max(max_rel, er)
            if not ok:
                failures.append(i)
        if failures:
            node = self._first_diverging_node(graph, values, producers[failures[0]])
            raise PassVerificationError(
                f"verify_passes: pass {pass_name!r} changed the piece's outputs beyond "
                f"tolerance {self.tol:g}: max abs error {max_abs:.4g}, max rel error "
                f"{max_rel:.4g} (outputs {failures}); first diverging node: {node}")
        self._values, self._outputs = values, outputs
        return PassError(max_abs, max_rel)

    def _first_diverging_node(self, graph: torch.fx.Graph, values: dict[str, Any],
                              output_producer: Any) -> str:
        for node in graph.nodes:
            if (node.op == "placeholder" or node.name not in values
                    or node.target in UNINITIALIZED_OPS):
                continue
            before = self._values.get(node.name)
            if before is None:
                continue
            _, _, ok = compare(before, values[node.name], self.tol)
            if not ok:
                new_inputs = [a.name for a in node.all_input_nodes if a.name not in self._values]
                fed_by = f"; fed by nodes the pass inserted: {new_inputs}" if new_inputs else ""
                return f"{node.name} ({node.format_node()}){fed_by}"
        if isinstance(output_producer, torch.fx.Node):
            return f"{output_producer.name} ({output_producer.format_node()})"
        return repr(output_producer)
