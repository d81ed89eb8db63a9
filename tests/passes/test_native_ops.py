"""The C++ CPU kernels of the piecewise linear ops (passes/native_ops.py, csrc/torch_ops.cpp):
registered with the dispatcher, built once per machine (cached), the bf16 small-M call taken
in C++ without entering Python, errors as the Python body raises them, and the same results
as the Python body."""

import pytest
import torch

from framework.core import ops as core_ops
from framework.core.native_build import kernel_dir
from passes import native_ops
from passes import small_m_linear as small_m
from passes.ops.packed_linear import PackedLinearMethod, mkldnn_available

pytestmark = [
    pytest.mark.skipif(not mkldnn_available(), reason="needs oneDNN (mkldnn)"),
    pytest.mark.skipif(
        not (small_m.kernel_available() and native_ops.load()),
        reason="the C++ op library does not build here",
    ),
]
BF16 = torch.bfloat16


def _layer(n, k, bias=True, max_rows=small_m.DEFAULT_MAX_ROWS):
    from models.layers import Linear

    layer = Linear(k, n, bias=bias, dtype=BF16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=g))
        if bias:
            layer.bias.copy_(torch.randn(n, generator=g))
    method = PackedLinearMethod(max_rows)
    assert method.process(layer)
    layer.linear_method = method
    return layer


def test_every_op_has_a_cpp_cpu_kernel_and_the_build_is_cached():
    for op in native_ops.OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"piecewise::{op}", "CPU"), op
    path = native_ops.LIBRARY.library_path()
    assert path.exists() and kernel_dir() in path.parents
    assert native_ops.LIBRARY.library_path() == path  # found again, not rebuilt
    assert "," in native_ops.isa()


@pytest.mark.parametrize("rows,max_rows", [(3, small_m.DEFAULT_MAX_ROWS), (40, 64), (64, 64)])
def test_bf16_small_m_call_runs_in_cpp_and_equals_the_python_body(monkeypatch, rows, max_rows):
    layer = _layer(96, 64, max_rows=max_rows)
    x = torch.randn(rows, 64).to(BF16)
    args = (x, layer.weight, layer.weight_md, layer.bias, 96, 64, max_rows)
    python = torch.ops.piecewise.packed_linear_python(*args)

    def no_python(*a, **k):
        raise AssertionError("the small-M call went through Python")

    monkeypatch.setattr(small_m, "run_packed", no_python)
    native = torch.ops.piecewise.packed_linear(*args)
    assert torch.equal(native, python)
    x3 = x.view(1, rows, 64)
    assert torch.equal(torch.ops.piecewise.packed_linear(x3, *args[1:]), python.view(1, rows, 96))


def test_cpp_errors_name_the_problem():
    layer = _layer(96, 64)
    x = torch.randn(1, 64).to(BF16)
    with pytest.raises(TypeError, match=r"x \(torch.float32\) and w \(torch.bfloat16\) differ"):
        torch.ops.piecewise.packed_linear(x.float(), layer.weight, None, None, 96, 64, 16)
    with pytest.raises(ValueError, match="bias .* torch.float32 for w .* torch.bfloat16"):
        torch.ops.piecewise.packed_linear(
            x, layer.weight, layer.weight_md, layer.bias.float(), 96, 64, 16
        )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)  # bf16 compared bit for bit (NaN included)


def _head(w: torch.Tensor, max_rows: int):
    from models.layers import Linear

    n, k = w.shape
    lin = Linear(k, n, dtype=BF16)
    with torch.no_grad():
        lin.weight.copy_(w)
    method = PackedLinearMethod(max_rows)
    assert method.process(lin)
    lin.linear_method = method
    return lin


@pytest.mark.parametrize(
    "n,k,rows,max_rows",
    [(32000, 64, 1, 16), (1000, 96, 3, 16), (130, 70, 7, 16), (64, 64, 1, 16), (4000, 64, 24, 16)],
)
def test_packed_linear_greedy_equals_the_head_then_the_samplers_pass(n, k, rows, max_rows):
    """The fused head (C++: each thread scans the logits it stored, the ranges folded in column
    order) gives the logits of packed_linear bit for bit, and per row the index and value the
    sampler's native pass over those logits finds, and the Python body's plain-torch rule:
    ties at the first index across the threads' ranges, a NaN's first index.  A call past
    max_rows (24 rows: oneDNN, then one pass per row in C++) included."""
    from framework.engine.greedy_native import greedy_argmax
    from passes.ops.packed_linear import packed_linear_greedy_cpu

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1)).to(BF16)
    w[n - 1] = w[3]  # the last column ties column 3 in every row (the same bits)
    w[n // 2 + 1] = w[n // 2]  # a tie inside the second half
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(2)).to(BF16)
    x[0] = (w[3].float() * 8).to(BF16)  # row 0's maximum: the tie of columns 3 and n - 1
    nan = w.clone()
    nan[n // 2 + 5 if n > 70 else 1] = float("nan")  # a NaN column in the second half...
    if n > 70:
        nan[n - 3] = float("nan")  # ...and a later one: the first must win
    for weights in (w, nan):
        lin = _head(weights, max_rows)
        args = (x, lin.weight, lin.weight_md, None, n, k, max_rows)
        out, idx, val = torch.ops.piecewise.packed_linear_greedy(*args)
        assert torch.equal(_bits(out), _bits(torch.ops.piecewise.packed_linear(*args)))
        want_idx, want_val = greedy_argmax(out)
        assert idx.tolist() == want_idx
        assert torch.allclose(val, torch.tensor(want_val), equal_nan=True)
        py_out, py_idx, py_val = packed_linear_greedy_cpu(*args)
        assert torch.equal(_bits(py_out), _bits(out)) and torch.equal(py_idx, idx)
        assert torch.allclose(py_val, val, equal_nan=True)
        fused = lin.linear_method.apply_greedy(lin, x)
        assert fused is not None and torch.equal(fused[1], idx)
        if weights is w and rows <= max_rows:  # ties: the first column wins
            assert out[0, 3] == out[0].max() and idx[0] == 3


def test_packed_linear_greedy_recorder_reports_a_call_that_replays():
    """The greedy head's recording kernel (``record_greedy``): the op's three tensors and the
    C call it made; replayed from its words over new rows written into the same input, the
    call writes what the op computes for them into the recorded buffers.  Past max_rows (the
    oneDNN path) it reports no call."""
    from backends.piecewise.replay import Tape, load_replayer
    from framework.core.native_tape import native_call

    lib = load_replayer()
    if lib is None:
        pytest.skip("no replay library on this platform")
    n, k = 1000, 96
    lin = _head(torch.randn(n, k, generator=torch.Generator().manual_seed(1)).to(BF16), 16)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2)).to(BF16)
    (out, idx, val), call = lin.linear_method.record_greedy(lin, x)
    args = (x, lin.weight, lin.weight_md, None, n, k, 16)
    want = torch.ops.piecewise.packed_linear_greedy(*args)
    assert call and torch.equal(idx, want[1]) and torch.equal(_bits(out), _bits(want[0]))
    x.copy_(torch.randn(3, k, generator=torch.Generator().manual_seed(3)).to(BF16))
    Tape(lib, [native_call(list(call), "head")], None, [out, idx, val]).run("head")
    again = torch.ops.piecewise.packed_linear_greedy(*args)
    assert torch.equal(idx, again[1]) and torch.equal(val, again[2])
    assert not torch.equal(idx, want[1])
    wide = torch.randn(24, k, generator=torch.Generator().manual_seed(4)).to(BF16)
    (_, wide_idx, _), none = lin.linear_method.record_greedy(lin, wide)
    assert not none and wide_idx.shape == (24,)


def test_packed_linear_greedy_rows_of_minus_inf_and_opcheck():
    """A -inf bias makes every logit -inf: index 0, value -inf (the sampler fails such a
    row); the op passes torch.library.opcheck (schema, fake, no aliasing)."""
    n, k = 200, 64
    layer = _layer(n, k, bias=True, max_rows=16)
    with torch.no_grad():
        layer.bias.fill_(float("-inf"))
    x = torch.randn(2, k).to(BF16)
    args = (x, layer.weight, layer.weight_md, layer.bias, n, k, 16)
    out, idx, val = torch.ops.piecewise.packed_linear_greedy(*args)
    assert idx.tolist() == [0, 0] and val.tolist() == [float("-inf")] * 2
    fine = _layer(n, k, bias=True, max_rows=16)
    torch.library.opcheck(
        torch.ops.piecewise.packed_linear_greedy.default,
        (x, fine.weight, fine.weight_md, fine.bias, n, k, 16),
    )


def _direct(op):
    from framework.core.ops import direct_call

    call = direct_call(f"piecewise::{op}")
    if call is None:
        pytest.skip("the op library was built without its Python module (no Python headers)")
    return call


def test_the_library_is_a_python_module_whose_functions_are_the_cpp_kernels():
    """Where this Python's headers are installed, every op's C++ CPU kernel is also a
    function of the library's Python module, registered as the op's direct call: same bits as
    the dispatcher's call, kernel rows and the rows it hands to the Python twin alike."""
    import sysconfig
    from pathlib import Path

    if (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        module = native_ops.LIBRARY.python_module()
        assert module is not None
        assert all(callable(getattr(module, op)) for op in native_ops.OPS)
        # registered by TorchOpLibrary.register(direct=...) as each op's direct kernel
        assert all(
            core_ops.direct_kernel(f"piecewise::{op}") is getattr(module, op)
            for op in native_ops.OPS
        )
    layer = _layer(96, 64, max_rows=16)
    call = _direct("packed_linear")
    for rows in (1, 5, 40):  # 40 > max_rows: the twin's path
        x = torch.randn(rows, 64).to(BF16)
        args = (x, layer.weight, layer.weight_md, layer.bias, 96, 64, 16)
        assert torch.equal(_bits(call(*args)), _bits(torch.ops.piecewise.packed_linear(*args)))
    head = _head(torch.randn(1000, 64).to(BF16), 16)
    x = torch.randn(3, 64).to(BF16)
    args = (x, head.weight, head.weight_md, None, 1000, 64, 16)
    got, want = (
        _direct("packed_linear_greedy")(*args),
        torch.ops.piecewise.packed_linear_greedy(*args),
    )
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(TypeError, match=r"x \(torch.float32\) and w \(torch.bfloat16\) differ"):
        call(x.float(), layer.weight, None, None, 96, 64, 16)


def test_a_build_failing_with_its_python_module_registers_the_kernels_without_it(
    monkeypatch, caplog
):
    """The Python module is optional: where the build with it fails, the library is built
    (here: found) without it, one warning, and the ops keep their C++ kernels."""
    from framework.core.native_build import KernelBuildError, TorchOpLibrary

    lib = TorchOpLibrary(
        "piecewise_ops",
        native_ops.LIBRARY.source,
        portable_env="PIECEWISE_NATIVE_OPS_PORTABLE",
        python_module="piecewise_ops",
    )
    if not lib._binds_python():
        pytest.skip("no Python headers here: the library never binds its module")
    built = native_ops.LIBRARY.library_path()

    def library_path(portable=None):
        if lib._binds_python():
            raise KernelBuildError("pybind11 does not build here (simulated)")
        return built

    monkeypatch.setattr(lib, "library_path", library_path)
    with caplog.at_level("WARNING"):
        assert lib.register("the Python bodies run")
    assert lib.python_module() is None
    assert any("without its Python module" in r.getMessage() for r in caplog.records)
