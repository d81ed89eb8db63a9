"""Fixtures of the piecewise backend's tests."""

import pytest
import torch

from backends.piecewise.compiler import CompileRange, make_compiler


@pytest.fixture
def native_ops_loaded():
    """The C++ op library loaded (its kernels registered, their direct calls too); skips
    where it does not build.  Ask for it before ``count_direct_calls``."""
    from passes import native_ops
    from passes import small_m_linear as small_m

    if not (small_m.kernel_available() and native_ops.load()):
        pytest.skip("the C++ op library does not build here")


@pytest.fixture
def linear_piece(tmp_path, native_ops_loaded):
    """A piece of a packed linear and an activation (bf16, 4 rows) compiled by Inductor:
    ``(compiled, save, f, x, w)`` -- the compiled callable, its saver (``save(path)``), the
    function it computes and its inputs.  Counting the op's direct calls
    (``count_direct_calls``) must start before this fixture (and after ``native_ops_loaded``):
    a piece binds its kernels when it is built or loaded."""
    from passes import small_m_linear as small_m

    w = small_m.pack(torch.randn(96, 64).to(torch.bfloat16))

    def f(x, w):
        y = torch.ops.piecewise.packed_linear.default(x, w, None, None, 96, 64, 64)
        return (torch.relu(y) * 2,)

    x = torch.randn(4, 64).to(torch.bfloat16)
    compiled, save = make_compiler("inductor").compile(
        torch.fx.symbolic_trace(f), [x, w], CompileRange(4, 4)
    )
    return compiled, save, f, x, w
