"""EmulatedGraphOps reproduces CUDA-graph semantics on CPU: replay runs the recorded kernels
(never the Python), host values are frozen at capture, and outputs of graphs that share the
pool alias -- so the two classic graph bugs show up here exactly as on a GPU."""

import pytest
import torch

from framework.core.forward_context import (
    BatchDescriptor,
    CUDAGraphMode,
    ForwardContext,
    set_forward_context,
)
from framework.cudagraph.emulation import EmulatedGraphOps
from framework.cudagraph.wrapper import CUDAGraphWrapper, clear_all_graphs, weak_ref_tensors

FULL, PIECEWISE = CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE
D8 = BatchDescriptor(8)


def ctx(mode=PIECEWISE, desc=D8):
    return set_forward_context(
        ForwardContext(
            attn_metadata={}, kv_caches={}, cudagraph_runtime_mode=mode, batch_descriptor=desc
        )
    )


@pytest.fixture(autouse=True)
def fresh_graphs():
    clear_all_graphs()
    yield
    clear_all_graphs()


class AddBias:
    """y = x * 2 + bias, where bias is a host-side Python value (e.g. read from a config)."""

    def __init__(self, bias):
        self.bias, self.calls = bias, 0

    def __call__(self, x):
        self.calls += 1
        return x * 2 + self.bias


def test_replay_runs_the_record_not_the_python():
    fn = AddBias(1.0)
    w = CUDAGraphWrapper(fn, PIECEWISE, graph_ops=EmulatedGraphOps())
    x = torch.zeros(8)
    with ctx():
        w(x)
        for start in (3.0, -2.0):
            x.copy_(torch.arange(start, start + 8))  # new contents, same buffer
            assert torch.equal(w(x), x * 2 + 1)
        assert torch.equal(w(torch.full((8,), 100.0)), x * 2 + 1)  # a new tensor is ignored
    assert fn.calls == 1 and w.stats.replays == 3
    graph = w._entries[D8].graph
    assert [launch.name for launch in graph.tape] == ["aten.mul.Tensor", "aten.add.Tensor"]


def test_stale_host_value_gives_the_wrong_result_a_gpu_would_give():
    """The bug class graphs are infamous for: a host value changed after capture.  The replay
    keeps using the captured value (what torch.cuda.graph does); eager would not."""
    fn = AddBias(1.0)
    w = CUDAGraphWrapper(fn, PIECEWISE, graph_ops=EmulatedGraphOps())
    x = torch.arange(8.0)
    with ctx():
        w(x)
        fn.bias = 5.0  # e.g. a step counter, a scale
        replayed = w(x).clone()
    assert torch.equal(replayed, x * 2 + 1)  # frozen at capture: stale
    assert not torch.equal(replayed, fn(x))  # eager sees the new value


def test_host_read_of_a_device_value_during_capture_fails():
    def fn(x):
        n = int(x.sum().item())  # a sync: illegal under capture
        return x[:1] * n

    w = CUDAGraphWrapper(fn, PIECEWISE, graph_ops=EmulatedGraphOps())
    with ctx(), pytest.raises(RuntimeError, match="read on the host during capture"):
        w(torch.ones(8))


def _two_graphs(ops):
    a = CUDAGraphWrapper(lambda t: t * 2, PIECEWISE, graph_ops=ops, name="a")
    b = CUDAGraphWrapper(lambda t: t + 100, PIECEWISE, graph_ops=ops, name="b")
    return a, b


def test_outputs_of_graphs_sharing_the_pool_alias():
    """Capture returns the strong output; once the caller drops it, the next capture in the
    pool reuses the memory, so replaying b overwrites what a's replay returned -- as on a
    GPU.  Hence: consume a graph's output before the next replay."""
    ops = EmulatedGraphOps()
    x = torch.arange(8.0)
    a, b = _two_graphs(ops)
    with ctx():
        a(x)  # strong output dropped at once
        b(x)
        out_a = a(x)
        assert torch.equal(out_a, x * 2)
        out_b = b(x)
    assert out_a.data_ptr() == out_b.data_ptr()
    assert torch.equal(out_a, x + 100)  # a's output overwritten by b's replay


def test_an_output_held_strongly_is_not_reused():
    ops = EmulatedGraphOps()
    x = torch.arange(8.0)
    a, b = _two_graphs(ops)
    with ctx():
        held = a(x)  # the caller keeps a's capture output
        b(x)
        b(x)
    assert torch.equal(held, x * 2)  # b got its own memory


class ReturnsWeakAtCapture(CUDAGraphWrapper):
    """A wrapper bug: capture returns the weak alias instead of the strong output."""

    def _capture(self, descriptor, args, kwargs):
        return weak_ref_tensors(super()._capture(descriptor, args, kwargs))


def test_output_not_held_strongly_at_capture_is_overwritten():
    """What the strong return protects against: with a weak alias returned at capture, the
    caller's output does not keep the memory, the next capture takes it, and the next replay
    silently changes a tensor the caller still holds."""
    ops = EmulatedGraphOps()
    x = torch.arange(8.0)
    a = ReturnsWeakAtCapture(lambda t: t * 2, PIECEWISE, graph_ops=ops, name="a")
    b = CUDAGraphWrapper(lambda t: t + 100, PIECEWISE, graph_ops=ops, name="b")
    with ctx():
        held = a(x)
        b(x)
        b(x)
    assert torch.equal(held, x + 100)  # corrupted, as it would be on a GPU


def test_inplace_ops_and_views_replay_on_the_captured_memory():
    cache = torch.zeros(4, 8)

    def write(x, slot):
        cache[slot].copy_(x)  # slot: a host int, frozen
        return cache.sum(0)

    w = CUDAGraphWrapper(write, PIECEWISE, graph_ops=EmulatedGraphOps())
    x = torch.ones(8)
    with ctx():
        w(x, 1)
        x.fill_(3.0)
        out = w(x, 2)  # replays the write into slot 1
    assert torch.equal(cache[1], torch.full((8,), 3.0)) and cache[2].sum() == 0
    assert torch.equal(out, torch.full((8,), 3.0))


def test_inductor_compiled_piece_is_captured_and_replayed():
    """An Inductor graph's kernels run outside the dispatcher; the emulation records the
    compiled graph as one launch and replays it on the captured buffers."""
    compiled = torch.compile(lambda t: torch.sin(t * 2) + 1, backend="inductor", dynamic=False)
    calls = []

    def piece(x):
        calls.append(1)
        return compiled(x)

    x = torch.arange(8.0)
    piece(x)  # compile outside the graph
    w = CUDAGraphWrapper(piece, PIECEWISE, graph_ops=EmulatedGraphOps())
    with ctx():
        w(x)
        x.copy_(torch.linspace(-3, 3, 8))
        out = w(x)
    assert len(calls) == 2  # warm-up + capture, not the replay
    torch.testing.assert_close(out, torch.sin(x * 2) + 1)
    names = [launch.name for launch in w._entries[D8].graph.tape]
    assert "inductor graph" in names, names
