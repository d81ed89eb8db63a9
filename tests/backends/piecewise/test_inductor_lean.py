"""The lean form's direct op calls (backends/piecewise/inductor_lean.py, bind_direct_calls): a
piece's calls of ops that have a direct call (framework/core/ops.py) skip the dispatcher,
the others keep it, and the piece computes the same bits either way."""

import torch

from backends.piecewise.compiler import make_compiler
from backends.piecewise.inductor_lean import bind_direct_calls
from framework.core import ops as core_ops

SOURCE = """def call(self, args):
    a = torch.ops.piecewise.packed_linear.default(x, w, None, None, 8, 8, 64)
    b = torch.ops.piecewise.rms_norm.default(y)
    c = torch.ops.piecewise.packed_linear.default(reinterpret_tensor(a, (8, 8), (8, 1), 0), w, None)
    d = torch.ops.piecewise.packed_linear.default(a, w, md=None)
    e = torch.ops.piecewise.packed_linear.default(a, w, getattr(a, "md"))
    f = torch.ops.piecewise.packed_linear.default(a, w, (x == 1))
    g = torch.ops.piecewise.packed_linear.default(a,
        w)
    return torch.ops.piecewise.packed_linear.default(a, w, None, None, 8, 8, 64)
"""


def test_only_ops_with_a_direct_call_are_renamed(monkeypatch):
    monkeypatch.setattr(core_ops, "_DIRECT", {})  # whatever other tests registered
    body, direct = bind_direct_calls(SOURCE)
    assert body == SOURCE and direct == {}  # nothing registered: unchanged
    monkeypatch.setitem(core_ops._DIRECT, "piecewise::packed_linear", lambda *a: a)
    body, direct = bind_direct_calls(SOURCE)
    assert body.count("_pw_direct_packed_linear(") == 3
    assert "_pw_direct_packed_linear(x, w, None, None, 8, 8, 64)" in body
    assert "torch.ops.piecewise.rms_norm.default(y)" in body
    # positional expressions (Inductor's views of a buffer) are bound too
    assert "_pw_direct_packed_linear(reinterpret_tensor(a, (8, 8), (8, 1), 0), w, None)" in body
    # keyword arguments, strings, comparisons and calls over several lines keep the dispatcher
    assert "torch.ops.piecewise.packed_linear.default(a, w, md=None)" in body
    assert 'torch.ops.piecewise.packed_linear.default(a, w, getattr(a, "md"))' in body
    assert "torch.ops.piecewise.packed_linear.default(a, w, (x == 1))" in body
    assert "torch.ops.piecewise.packed_linear.default(a,\n" in body
    assert list(direct) == ["_pw_direct_packed_linear"]
    assert direct["_pw_direct_packed_linear"](1, 2) == (1, 2)


def test_a_compiled_piece_calls_the_packed_linear_kernel_directly(
    tmp_path, native_ops_loaded, count_direct_calls, request
):
    """A piece with a packed linear (the layer's op in the graph): its lean module binds the
    op's kernel where the native library has one and gives the dispatcher's bits; under the
    profiler (or an override, a dispatch mode) the piece's calls go through the dispatcher,
    which records them."""
    calls = count_direct_calls("piecewise::packed_linear")
    compiled, save, f, x, w = request.getfixturevalue("linear_piece")
    assert compiled.direct_calls == ["_pw_direct_packed_linear"]
    want = f(x, w)[0]
    assert torch.equal(compiled(x, w)[0], want)
    save(tmp_path / "piece.bin")
    loaded = make_compiler("inductor").load(tmp_path / "piece.bin")
    assert loaded.direct_calls == ["_pw_direct_packed_linear"]
    calls.clear()
    assert torch.equal(loaded(x, w)[0], want)
    assert calls == [7]
    with torch.profiler.profile() as prof:
        assert torch.equal(loaded(x, w)[0], want)
    assert calls == [7]  # not the direct kernel: the dispatcher's call, recorded
    assert any(e.name == "piecewise::packed_linear" for e in prof.events())
