"""CUDA-graph wrapper: control flow on CPU through EmulatedGraphOps (same code path, graph
calls emulated), real capture/replay on CUDA."""

import gc

import pytest
import torch

from framework.core.forward_context import (
    BatchDescriptor,
    CUDAGraphMode,
    ForwardContext,
    set_forward_context,
)
from framework.cudagraph.wrapper import (
    CUDAGraphOps,
    CUDAGraphWrapper,
    EmulatedGraphOps,
    clear_all_graphs,
    live_wrappers,
    total_stats,
    weak_ref_tensor,
)

FULL, PIECEWISE, NONE = CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE
D8, D16 = BatchDescriptor(8), BatchDescriptor(16)


def ctx(mode, desc=None):
    return set_forward_context(
        ForwardContext(
            attn_metadata={}, kv_caches={}, cudagraph_runtime_mode=mode, batch_descriptor=desc
        )
    )


class Counting:
    """y = x * 2 + 1, counting real executions."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        return x * 2 + 1


class RecordingOps(EmulatedGraphOps):
    def __init__(self):
        super().__init__()
        self.pools = []

    def capture(self, fn, pool, *, collect_garbage):
        self.pools.append(pool)
        return super().capture(fn, pool, collect_garbage=collect_garbage)


@pytest.fixture(autouse=True)
def fresh_registry():
    gc.collect()  # wrappers of earlier tests' models (reference cycles) die first
    clear_all_graphs()
    yield
    clear_all_graphs()


def test_calls_through_without_forward_context():
    fn = Counting()
    w = CUDAGraphWrapper(fn, FULL, graph_ops=EmulatedGraphOps())
    x = torch.ones(4)
    assert torch.equal(w(x), x * 2 + 1)
    assert fn.calls == 1 and w.stats.captures == 0 and w.descriptors == []


@pytest.mark.parametrize(
    "wrapper_mode,step_mode",
    [(FULL, NONE), (PIECEWISE, NONE), (FULL, PIECEWISE), (PIECEWISE, FULL)],
)
def test_calls_through_on_none_or_other_mode(wrapper_mode, step_mode):
    fn = Counting()
    w = CUDAGraphWrapper(fn, wrapper_mode, graph_ops=EmulatedGraphOps())
    x = torch.ones(4)
    with ctx(step_mode, D8):
        first, second = w(x), w(x)
    assert first is not second and fn.calls == 2
    assert w.stats.captures == 0 and w.stats.replays == 0


def test_configuration_mode_in_context_is_an_error():
    w = CUDAGraphWrapper(Counting(), FULL, graph_ops=EmulatedGraphOps())
    with ctx(CUDAGraphMode.FULL_AND_PIECEWISE, D8), pytest.raises(ValueError, match="runtime"):
        w(torch.ones(2))


def test_missing_descriptor_is_an_error():
    w = CUDAGraphWrapper(Counting(), PIECEWISE, graph_ops=EmulatedGraphOps())
    with ctx(PIECEWISE, None), pytest.raises(RuntimeError, match="batch_descriptor is None"):
        w(torch.ones(2))


def test_rejects_none_mode_at_construction():
    with pytest.raises(ValueError, match="FULL or PIECEWISE"):
        CUDAGraphWrapper(Counting(), NONE)


def test_one_capture_per_key_and_replay_returns_captured_output():
    fn = Counting()
    w = CUDAGraphWrapper(fn, PIECEWISE, graph_ops=EmulatedGraphOps())
    x8, x16 = torch.zeros(8), torch.zeros(16)  # the runner's static buffers
    with ctx(PIECEWISE, D8):
        captured = w(x8)
    with ctx(PIECEWISE, D16):
        w(x16)
    x8.fill_(3.0)
    with ctx(PIECEWISE, D8):
        r1 = w(x8)
    with ctx(PIECEWISE, D8):
        r2 = w(x8)
    assert w.stats.captures == 2 and w.stats.replays == 2
    assert set(w.descriptors) == {D8, D16}
    # Every replay returns the same stored object, aliasing the captured output's memory.
    assert r1 is r2 and r1.data_ptr() == captured.data_ptr()
    assert torch.equal(r1, torch.full((8,), 7.0))  # fresh values from the buffer
    assert captured is not r1  # the capture returned the strong one


def test_replay_reads_captured_buffers_like_a_graph():
    """Without debug, a replay ignores a new input tensor and reads the captured buffer --
    what a real graph does; this is why inputs must live in persistent buffers."""
    w = CUDAGraphWrapper(Counting(), FULL, graph_ops=EmulatedGraphOps())
    buf = torch.zeros(8)
    with ctx(FULL, D8):
        w(buf)
        out = w(torch.full((8,), 100.0))
    assert torch.equal(out, torch.ones(8))


def two_piece_model(ops=None, debug=False, in_place=True):
    """piece_a -> relu -> piece_b.  Like the attention op writing into a buffer the previous
    piece allocated, the eager op between pieces works in place on piece_a's output, so
    piece_b always reads a graph-owned (static) address."""
    kw = dict(graph_ops=ops) if ops is not None else {}
    piece_a = CUDAGraphWrapper(Counting(), PIECEWISE, debug=debug, name="a", **kw)
    piece_b = CUDAGraphWrapper(Counting(), PIECEWISE, debug=debug, name="b", **kw)

    def model(x):
        h = piece_a(x)
        h = torch.relu_(h) if in_place else torch.relu(h)
        return piece_b(h)

    return piece_a, piece_b, model


def expected(x):
    return torch.relu(x * 2 + 1) * 2 + 1


def test_nesting_full_around_piecewise_only_one_active():
    ops = EmulatedGraphOps()
    piece_a, piece_b, model = two_piece_model(ops)
    full = CUDAGraphWrapper(model, FULL, graph_ops=ops, name="model")
    x = torch.zeros(8)

    for mode, desc in ((FULL, BatchDescriptor(8, 8, True)), (PIECEWISE, D8)):
        with ctx(mode, desc):
            for start in (0.0, -4.0, 2.0):
                x.copy_(torch.arange(start, start + 8))
                assert torch.equal(full(x), expected(x)), (mode, start)
    # FULL step: the model graph captured once and replayed; the pieces ran inside it.
    assert (full.stats.captures, full.stats.replays) == (1, 2)
    # PIECEWISE step: the outer wrapper called through, each piece captured once.
    for piece in (piece_a, piece_b):
        assert (piece.stats.captures, piece.stats.replays) == (1, 2)
        assert piece.descriptors == [D8]

    with ctx(NONE, D8):
        assert torch.equal(full(x), expected(x))
    assert total_stats().captures == 3


def test_debug_catches_a_non_static_intermediate():
    """An eager op between pieces that allocates a fresh output breaks piece_b's graph
    (it reads the capture-time address); debug mode names the argument."""
    piece_a, piece_b, model = two_piece_model(EmulatedGraphOps(), debug=True, in_place=False)
    x = torch.arange(8.0)
    with ctx(PIECEWISE, D8):
        model(x)
        with pytest.raises(RuntimeError, match=r"CUDAGraphWrapper\(b\).*argument 0 address"):
            model(x)


def test_gc_only_before_first_capture_and_one_pool_per_ops():
    """GC before the first capture into an ops object's pool only; every wrapper on one ops
    object shares its pool, and another ops object (another engine) has its own."""
    ops = RecordingOps()
    w1 = CUDAGraphWrapper(Counting(), PIECEWISE, graph_ops=ops)
    w2 = CUDAGraphWrapper(Counting(), FULL, graph_ops=ops)
    with ctx(PIECEWISE, D8):
        w1(torch.zeros(8))
    with ctx(PIECEWISE, D16):
        w1(torch.zeros(16))
    with ctx(FULL, D8):
        w2(torch.zeros(8))
    assert ops.gc_requests == [True, False, False]
    assert len(ops.pools) == 3 and all(p is ops.pools[0] for p in ops.pools)
    other = RecordingOps()
    assert other.shared_pool() is not ops.pools[0]
    w3 = CUDAGraphWrapper(Counting(), PIECEWISE, graph_ops=other)
    with ctx(PIECEWISE, D8):
        w3(torch.zeros(8))
    assert other.gc_requests == [True]  # its own first capture


def test_debug_mode_names_the_moved_argument():
    def fn(a, b, n):
        return a + b[:n]

    w = CUDAGraphWrapper(fn, PIECEWISE, debug=True, graph_ops=EmulatedGraphOps())
    a, b = torch.zeros(4), torch.zeros(4)
    with ctx(PIECEWISE, D8):
        w(a, b, 4)
        w(a, b, 4)  # same buffers: fine
        with pytest.raises(RuntimeError, match=r"argument 1 address changed"):
            w(a, b.clone(), 4)
        with pytest.raises(RuntimeError, match=r"argument 2 value changed \(captured 4, now 3"):
            w(a, b, 3)
        with pytest.raises(RuntimeError, match=r"argument 0 address changed"):
            w(a.clone(), b, 4)
    assert w.stats.replays == 1


def test_debug_mode_checks_keyword_arguments():
    w = CUDAGraphWrapper(lambda x, *, y: x + y, FULL, debug=True, graph_ops=EmulatedGraphOps())
    x, y = torch.zeros(4), torch.ones(4)
    with ctx(FULL, D8):
        w(x, y=y)
        with pytest.raises(RuntimeError, match="keyword argument 'y' address changed"):
            w(x, y=y.clone())


def test_registry_clears_every_graph():
    ops = EmulatedGraphOps()
    ws = [CUDAGraphWrapper(Counting(), PIECEWISE, graph_ops=ops) for _ in range(3)]
    with ctx(PIECEWISE, D8):
        for w in ws:
            w(torch.zeros(8))
    assert all(w in live_wrappers() for w in ws)
    assert clear_all_graphs() == 3
    assert all(w.descriptors == [] for w in ws)
    with ctx(PIECEWISE, D8):
        ws[0](torch.zeros(8))
    assert ws[0].stats.captures == 2  # captured again after clearing
    doomed = ws.pop()
    del doomed
    gc.collect()
    assert len([w for w in live_wrappers() if w in ws]) == 2
    assert len(live_wrappers()) >= 2


def test_attribute_passthrough():
    lin = torch.nn.Linear(3, 2)
    w = CUDAGraphWrapper(lin, FULL, graph_ops=EmulatedGraphOps())
    assert w.weight is lin.weight and w.unwrap() is lin
    assert w.runtime_mode is FULL  # own attributes win
    with pytest.raises(AttributeError):
        w.no_such_attribute


def test_weak_ref_tensor_aliases_without_owning():
    base = torch.arange(12.0).view(3, 4)
    t = base[:, 1:]
    uses = torch._C._storage_Use_Count(t.untyped_storage()._cdata)
    w = weak_ref_tensor(t)
    assert torch._C._storage_Use_Count(t.untyped_storage()._cdata) == uses
    assert (w.data_ptr(), w.shape, w.stride()) == (t.data_ptr(), t.shape, t.stride())
    base.add_(1)
    assert torch.equal(w, t)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error message")
def test_real_graph_ops_need_cuda():
    w = CUDAGraphWrapper(Counting(), FULL)
    with ctx(FULL, D8), pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
        w(torch.zeros(8))


# ---------------------------------------------------------------------------- real CUDA --

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_cuda_capture_and_replay():
    fn = Counting()
    w = CUDAGraphWrapper(fn, FULL, graph_ops=CUDAGraphOps(), debug=True)
    x = torch.zeros(8, device="cuda")
    fn(x)  # warm-up, as the runner does
    with ctx(FULL, D8):
        captured = w(x)
        first = captured.clone()  # a capture alone runs nothing: the wrapper replays once
        x.fill_(2.0)
        out = w(x)
    torch.cuda.synchronize()
    assert torch.equal(first, torch.ones(8, device="cuda"))
    assert fn.calls == 2  # warm-up + capture; replay runs no Python
    assert out.data_ptr() == captured.data_ptr()
    assert torch.equal(out, torch.full((8,), 5.0, device="cuda"))
    assert (w.stats.captures, w.stats.replays) == (1, 1)


@pytest.mark.gpu
@needs_cuda
def test_cuda_nested_piecewise_and_full_share_the_pool():
    piece_a, piece_b, model = two_piece_model(debug=True)
    full = CUDAGraphWrapper(model, FULL)
    x = torch.zeros(16, device="cuda")
    model(x)  # warm-up
    for mode, desc in ((PIECEWISE, D16), (FULL, BatchDescriptor(16, 16, True))):
        with ctx(mode, desc):
            for start in (0.0, -8.0, 3.0):
                x.copy_(torch.arange(start, start + 16, device="cuda"))
                out = full(x).clone()
                torch.cuda.synchronize()
                assert torch.equal(out, expected(x)), (mode, start)
    assert (piece_a.stats.captures, piece_b.stats.captures, full.stats.captures) == (1, 1, 1)
    assert (piece_a.stats.replays, full.stats.replays) == (2, 2)
    assert piece_a.graph_ops is full.graph_ops  # wrappers built without ops share one pool
    assert CUDAGraphOps().shared_pool() != full.graph_ops.shared_pool()  # a new ops: its own
