"""TraceOnce: Dynamo runs once, later calls bypass it, recompiles are errors."""

import pytest
import torch

from framework.compile.trace_once import ArgBinding, RecompileError, TraceOnce, tensor_arg_dims


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("table", torch.randn(32, 8))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * 2 + self.table[pos]


def _counting_backend():
    seen = []

    def backend(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    return backend, seen


def test_dynamic_dims_inferred_from_type_hints():
    assert tensor_arg_dims(Toy.forward) == {"x": 0, "pos": 0}


def test_traces_once_for_every_token_count():
    torch.manual_seed(0)
    m = Toy()
    backend, seen = _counting_backend()
    f = TraceOnce(m, backend)
    for n in (5, 1, 2, 17, 3):
        x, pos = torch.randn(n, 8), torch.arange(n) % 32
        torch.testing.assert_close(f(x, pos), m(x, pos))
    assert len(seen) == 1 and f.num_traces == 1
    assert f._binder is not None, "later calls should bypass Dynamo through the binding"


def test_binding_round_trips_and_rebinds():
    m = Toy()
    backend, _ = _counting_backend()
    f = TraceOnce(m, backend)
    f(torch.randn(4, 8), torch.arange(4))
    binding = ArgBinding.from_json(f._binding.to_json())
    assert binding == f._binding
    kinds = {spec[0] for spec in binding.specs}
    assert kinds == {"state", "arg", "size"}
    g = TraceOnce(m, backend)
    g.install(f._compiled_fn, binding)
    x, pos = torch.randn(6, 8), torch.arange(6)
    torch.testing.assert_close(g(x, pos), m(x, pos))
    assert g.num_traces == 0


def test_call_needing_recompile_is_a_clear_error():
    m = Toy()
    backend, _ = _counting_backend()
    f = TraceOnce(m, backend)
    f(torch.randn(4, 8), torch.arange(4))
    with pytest.raises(RecompileError, match="'x'.*float64"):
        f(torch.randn(4, 8, dtype=torch.float64), torch.arange(4))
    with pytest.raises(RecompileError, match="'pos'.*2-d"):
        f(torch.randn(4, 8), torch.arange(4).view(2, 2))


def test_stale_binding_names_missing_state():
    binding = ArgBinding((("state", "does.not.exist"),), True)
    with pytest.raises(KeyError, match="does.not.exist"):
        binding.bind(Toy())
