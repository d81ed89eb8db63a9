import pytest
import torch

from framework.core.config import PassConfig
from passes.base import GraphPass
from passes.manager import PassManager
from passes.verify import PassVerificationError, compare, concrete_size, random_inputs

aten = torch.ops.aten


class MulToAdd(GraphPass):
    """Test-only broken pass: turns every ``a * b`` into ``a + b``."""

    def __call__(self, graph):
        self.match_count = 0
        for node in graph.find_nodes(op="call_function", target=aten.mul.Tensor):
            node.target = aten.add.Tensor
            self.match_count += 1


class _Range:
    def __init__(self, start, end):
        self.start, self.end = start, end


def _traced(fn, *args):
    return torch.fx.experimental.proxy_tensor.make_fx(fn, tracing_mode="symbolic")(*args)


def _f(x, w):
    h = torch.relu(x) * w
    return h.sum(-1), h - x


def test_broken_pass_fails_naming_pass_and_first_diverging_node():
    pm = PassManager(
        PassConfig(passes=["noop_elimination", f"{__name__}:MulToAdd"], verify_passes=True)
    )
    assert pm.uuid() != pm.uuid()  # verifying: Inductor's cache must not skip the passes
    pm.set_current_piece("submod_0", _Range(1, 64))
    gm = _traced(_f, torch.randn(5, 8), torch.randn(8))
    with pytest.raises(PassVerificationError) as e:
        pm.run_on_graph_module(gm)
    msg = str(e.value)
    assert f"pass '{__name__}:MulToAdd'" in msg
    assert "first diverging node: mul" in msg  # the node the pass changed (kept its name)


class ReluToAbs(GraphPass):
    """Test-only broken rewrite that inserts a new node (``abs``) in place of ``relu``."""

    def __call__(self, graph):
        self.match_count = 0
        for node in graph.find_nodes(op="call_function", target=aten.relu.default):
            with graph.inserting_before(node):
                new = graph.call_function(aten.abs.default, node.args)
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            self.match_count += 1


def test_broken_replacement_is_named_by_the_inserted_node():
    pm = PassManager(PassConfig(passes=[f"{__name__}:ReluToAbs"], verify_passes=True))
    with pytest.raises(PassVerificationError, match=r"ReluToAbs'.*first diverging node: abs"):
        pm.run_on_graph_module(_traced(_f, torch.randn(5, 8), torch.randn(8)))


def test_correct_passes_report_their_error():
    pm = PassManager(
        PassConfig(passes=["noop_elimination", "oot_pass_example:SubToAddNeg"], verify_passes=True)
    )
    pm.set_current_piece("submod_0", _Range(1, 64))
    pm.run_on_graph_module(_traced(_f, torch.randn(5, 8), torch.randn(8)))
    rec = pm.stats()["oot_pass_example:SubToAddNeg"]["pieces"][0]
    assert rec["matches"] == 1 and rec["max_abs_error"] == 0.0


def test_random_inputs_bind_the_token_count_from_the_range():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())

    def fake(t, *dims):  # only the token dimension is symbolic, as in a piece
        return mode.from_tensor(
            t,
            symbolic_context=StatelessSymbolicContext(
                dynamic_sizes=[DimDynamic.DYNAMIC if d else DimDynamic.STATIC for d in dims]
            ),
        )

    graph = torch.fx.Graph()
    for name, val in (
        ("x", fake(torch.randn(5, 8, dtype=torch.bfloat16), True, False)),
        ("pos", fake(torch.arange(5), True)),
        ("w", fake(torch.randn(8), False)),
    ):
        graph.placeholder(name).meta["val"] = val
    x, pos, w = random_inputs(graph, size=concrete_size(_Range(3, 3)))
    assert x.shape == (3, 8) and x.dtype == torch.bfloat16 and w.shape == (8,)
    assert pos.dtype == torch.int64 and pos.shape == (3,) and int(pos.min()) >= 0
    assert concrete_size(_Range(1, 512)) == 8 and concrete_size(_Range(100, 512)) == 100


def test_compare_allows_one_quant_step_and_dtype_tolerance():
    a = torch.tensor([1, 2, 3], dtype=torch.int8)
    assert compare(a, a + 2, 1e-4)[2]  # removed rounding of the value and of the scale
    assert not compare(a, a + 3, 1e-4)[2]
    b = torch.tensor([0.001, 4.0], dtype=torch.bfloat16)
    assert compare(b, b * 1.01, 5e-2)[2]
    assert compare(b, b + torch.tensor([0.1, 0], dtype=b.dtype), 5e-2)[2]  # judged vs scale 4
    assert not compare(b, b * 1.2, 5e-2)[2]
    assert not compare(b, b[:1], 5e-2)[2]  # shape change is a failure


def _with_buffer(x, w):
    """Like a piece before attention: computes a value and allocates the (uninitialised)
    output buffer the next splitting op writes."""
    h = torch.relu(x) * w
    return h - x, torch.empty_like(h).view(-1), torch.empty_like(h).zero_()


def test_uninitialised_outputs_are_not_compared_written_ones_are():
    from passes.verify import undefined_nodes

    gm = _traced(_with_buffer, torch.randn(5, 8), torch.randn(8))
    undefined = undefined_nodes(gm.graph)
    outs = gm.graph.output_node().args[0]
    assert outs[1].name in undefined  # view of an empty nobody writes
    assert outs[2].name not in undefined  # zero_() defined it
    assert outs[0].name not in undefined
    # A correct pass on such a piece passes, whatever garbage the buffer holds each run.
    pm = PassManager(
        PassConfig(passes=["noop_elimination", "oot_pass_example:SubToAddNeg"], verify_passes=True)
    )
    pm.set_current_piece("submod_0", _Range(1, 64))
    pm.run_on_graph_module(gm)
    assert pm.stats()["oot_pass_example:SubToAddNeg"]["pieces"][0]["matches"] == 1


def test_known_inputs_replace_random_ones_when_shape_and_dtype_match():
    gm = _traced(_f, torch.randn(5, 8), torch.randn(8))
    w = torch.arange(8.0)
    inputs = random_inputs(gm.graph, 3, known={1: w, 0: torch.zeros(2, 2)})
    assert inputs[1] is not None and torch.equal(inputs[1], w)
    assert inputs[0].shape == (3, 8)  # wrong shape: random instead


class ZeroToTiny(GraphPass):
    """Test-only pass within tolerance: ``x * 0`` becomes ``x * 1e-6`` (an error of ~1e-6)."""

    def __call__(self, graph):
        self.match_count = 0
        for node in graph.find_nodes(op="call_function", target=aten.mul.Tensor):
            if node.args[1] == 0:
                node.args = (node.args[0], 1e-6)
                self.match_count += 1


def _router(x):
    weights, ids = torch.ops.piecewise.topk_softmax(x * 0, 2, True)
    return weights, ids, x + 1


def test_an_amplifying_op_is_judged_on_its_input_not_its_output():
    """All-zero logits pick experts 0 and 1; moved by 1e-6 (within tolerance) they pick
    others: topk_softmax (``AMPLIFYING_OPS``) is a discrete choice, so its outputs are not
    compared once its input moved, and the pass verifies; the rest still is compared."""
    import passes.ops  # noqa: F401  (registers piecewise::topk_softmax)

    gm = _traced(_router, torch.randn(6, 8))
    pm = PassManager(PassConfig(passes=[f"{__name__}:ZeroToTiny"], verify_passes=True))
    pm.set_current_piece("submod_0", _Range(1, 64))
    pm.run_on_graph_module(gm)
    assert pm.stats()[f"{__name__}:ZeroToTiny"]["pieces"][0]["matches"] == 1
    # The exemption is the listed ops': the same move through a discrete op that is not
    # listed (argmax) is still a divergence.
    gm = _traced(lambda x: torch.argmax(x * 0, -1), torch.randn(6, 8))
    pm = PassManager(PassConfig(passes=[f"{__name__}:ZeroToTiny"], verify_passes=True))
    pm.set_current_piece("submod_0", _Range(1, 64))
    with pytest.raises(PassVerificationError, match="ZeroToTiny.*first diverging node: argmax"):
        pm.run_on_graph_module(gm)
