"""A torch.compile backend for pass tests: Inductor with the pass manager as its post-grad
custom pass, keeping a snapshot of every graph before and after the passes.

    backend = TestBackend(manager)
    out = torch.compile(fn, backend=backend, dynamic=False)(*args)
    assert count_op(backend.graph_after, torch.ops.piecewise.fused_add_rms_norm) == 1

Its ``uuid()`` is ``None`` so Inductor's FX-graph cache never replays a graph without running
the passes (the compiled C++ of identical kernels is still reused from Inductor's code cache).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch._inductor import config as inductor_config
from torch._inductor.compile_fx import compile_fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from passes.fx_utils import count_op  # noqa: F401  (re-exported for tests)

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    new = torch.fx.Graph()
    out = new.graph_copy(graph, {})
    new.output(out)
    return new


class _SnapshotPass(CustomGraphPass):
    def __init__(self, backend: "TestBackend"):
        self.backend = backend

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.backend.graphs_before.append(copy_graph(graph))
        self.backend.run_passes(graph)
        self.backend.graphs_after.append(copy_graph(graph))

    def uuid(self) -> Optional[Any]:
        return None


class TestBackend:
    """``torch.compile`` backend: ``compile_fx`` with ``passes`` (a PassManager, or any callables
    on a graph) as ``post_grad_custom_post_pass``."""

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        *passes: Callable[[torch.fx.Graph], None],
        inductor_options: Optional[dict[str, Any]] = None,
    ):
        self.passes = passes
        self.inductor_options = dict(inductor_options or {})
        self.graphs_before: list[torch.fx.Graph] = []
        self.graphs_after: list[torch.fx.Graph] = []

    def run_passes(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]):
        options = {"post_grad_custom_post_pass": _SnapshotPass(self), **self.inductor_options}
        with inductor_config.patch(options):
            return compile_fx(gm, example_inputs)

    @property
    def graph_before(self) -> torch.fx.Graph:
        assert len(self.graphs_before) == 1, f"{len(self.graphs_before)} graphs were compiled"
        return self.graphs_before[0]

    @property
    def graph_after(self) -> torch.fx.Graph:
        assert len(self.graphs_after) == 1, f"{len(self.graphs_after)} graphs were compiled"
        return self.graphs_after[0]


def compile_with(fn: Callable, backend: TestBackend, *args: Any) -> Any:
    """Compile ``fn`` with ``backend`` (static shapes, fresh Dynamo state) and run it."""
    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)(*args)


def assert_close_to_eager(
    actual: Any,
    expected: Any,
    dtype: torch.dtype,
    quant_step: bool = True,
    relative_to_max: bool = False,
) -> None:
    """Outputs match eager within the dtype's tolerance; int8 outputs within one step.

    ``relative_to_max``: judge float errors against each output's largest magnitude instead of
    element by element -- for chains of quantized matmuls, where one moved quantization step
    spreads over a whole output row, near-zero elements included."""
    actual = actual if isinstance(actual, (tuple, list)) else (actual,)
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)
    assert len(actual) == len(expected)
    tol = TOLERANCE[dtype]
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.dtype == e.dtype and a.shape == e.shape, (
            f"output {i}: {a.dtype} {a.shape} vs eager {e.dtype} {e.shape}"
        )
        if e.dtype == torch.int8:
            diff = (a.int() - e.int()).abs()
            assert int(diff.max()) <= (1 if quant_step else 0), f"output {i}: int8 differs"
        elif e.dtype == torch.float8_e4m3fn:  # one e4m3 step: 3 mantissa bits
            torch.testing.assert_close(
                a.float(), e.float(), atol=1e-2, rtol=0.125 if quant_step else 0
            )
        elif relative_to_max:
            err = float((a.float() - e.float()).abs().max())
            scale = float(e.float().abs().max())
            assert err <= tol * max(scale, 1.0), (
                f"output {i}: max abs error {err:.4g} is above {tol:g} x max|eager| = {scale:.4g}"
            )
        else:
            torch.testing.assert_close(
                a.float(), e.float(), atol=tol, rtol=tol, msg=lambda m: f"output {i}: {m}"
            )
