"""The one op-definition helper: every piecewise op is a torch.library op with one kernel per
dispatch key; kernel overrides re-register through the same library."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import backends.attention  # noqa: F401  (defines piecewise::attention)
import passes.ops  # noqa: F401  (defines the fused ops)
import passes.ops.packed_linear  # noqa: F401  (defines piecewise::packed_linear)
from framework.core import ops as core_ops

ops = torch.ops.piecewise
FUSED = {
    "rms_norm",
    "fused_add_rms_norm",
    "rms_norm_static_quant",
    "fused_add_rms_norm_static_quant",
    "rms_norm_dynamic_quant",
    "static_scaled_quant",
    "dynamic_per_token_quant",
    "silu_and_mul",
    "silu_and_mul_static_quant",
    "silu_and_mul_dynamic_quant",
    "qk_norm_rope",
    "int8_scaled_mm",
    "fp8_scaled_mm",
    "int8_weight_only_mm",
}


def test_every_op_is_defined_through_the_helper():
    table = core_ops.registered_kernels()
    assert {n.split("::")[1] for n in table} >= FUSED | {"attention", "packed_linear"}
    triton = importlib.util.find_spec("triton") is not None
    for name in FUSED:
        entry = table[f"piecewise::{name}"]
        assert entry["default"].startswith("passes.ops."), entry
        assert ("cuda" in entry) == triton
        if triton:
            assert entry["cuda"].startswith("passes.ops.triton.")
        assert hasattr(ops, name)
    # the Python body is the default kernel; passes/native_ops.py adds a C++ CPU kernel, which
    # hands the calls it does not take to the Python twin
    assert set(table["piecewise::packed_linear"]) == {"default"}
    assert set(table["piecewise::packed_linear_python"]) == {"cpu"}
    assert set(table["piecewise::attention"]) == {"default"}


def test_ops_are_library_ops_not_custom_op_wrappers():
    """One implementation per dispatch key, chosen by the torch dispatcher."""
    op = ops.silu_and_mul.default
    assert isinstance(op, torch._ops.OpOverload)
    assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeExplicitAutograd")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Autograd")


def test_opcheck_of_a_mutating_and_a_functional_op():
    x = torch.randn(3, 8)
    torch.library.opcheck(ops.silu_and_mul.default, (torch.empty(3, 4), x))
    torch.library.opcheck(
        ops.int8_weight_only_mm.default,
        (x, torch.randint(-5, 5, (6, 8), dtype=torch.int8), torch.rand(6), None),
    )


def test_override_rebinds_every_caller_in_its_block_and_restores():
    calls = []

    def fake_kernel(out, x):
        calls.append(x.shape)
        out.fill_(7)

    x, out = torch.randn(2, 8), torch.empty(2, 4)
    compiled = torch.compile(lambda o, t: ops.silu_and_mul(o, t), backend="eager")
    with core_ops.override_kernel("piecewise::silu_and_mul", "cpu", fake_kernel):
        ops.silu_and_mul(out, x)
        assert (out == 7).all()
        compiled(out, x)
        assert len(calls) == 2
    assert "cpu" not in core_ops.registered_kernels()["piecewise::silu_and_mul"]
    ops.silu_and_mul(out, x)
    assert not (out == 7).all() and len(calls) == 2


def test_override_is_not_seen_by_another_thread():
    """Scoped, not process-wide: a thread running while another overrides keeps the
    registered kernel."""
    import threading

    inside, outside = threading.Event(), threading.Event()
    seen = {}

    def other():
        inside.wait(10)
        o = torch.empty(2, 4)
        ops.silu_and_mul(o, torch.ones(2, 8))
        seen["other"] = bool((o == 7).all())
        outside.set()

    def sevens(o, x):
        o.fill_(7)

    t = threading.Thread(target=other)
    t.start()
    with core_ops.override_kernel("piecewise::silu_and_mul", "cpu", sevens):
        inside.set()
        assert outside.wait(10)
        o = torch.empty(2, 4)
        ops.silu_and_mul(o, torch.ones(2, 8))
        seen["self"] = bool((o == 7).all())
    t.join()
    assert seen == {"self": True, "other": False}


def test_lazy_kernel_path_resolves_on_first_call():
    @core_ops.define_op(
        "piecewise::_test_lazy", fake=lambda x: x.new_empty(x.shape), cpu="torch:neg"
    )
    def _test_lazy(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    x = torch.arange(3.0)
    torch.testing.assert_close(_test_lazy(x), -x)  # the CPU key wins over the default


def test_errors_name_the_op():
    with pytest.raises(KeyError, match="unknown op 'piecewise::nope'"):
        with core_ops.override_kernel("piecewise::nope", "cpu", print):
            pass
    with pytest.raises(ValueError, match="op name must look like"):
        core_ops.define_op("rms_norm", fake=print)
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        with core_ops.override_kernel("piecewise::silu_and_mul", "tpu", print):
            pass
    with pytest.raises(ValueError, match="give the kernel"):
        with core_ops.override_kernel("piecewise::silu_and_mul", "default", None):
            pass


def test_importing_ops_does_not_import_triton():
    code = "import sys, passes.ops; print('triton' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[3],
    )
    assert out.stdout.strip() == "False"


def test_threads_overriding_one_op_at_once_install_one_trampoline(monkeypatch):
    """The first override of an op installs its trampoline under the registry lock: threads
    racing to override the same op register it once, and each sees its own kernel."""
    import threading

    key = ("piecewise::silu_and_mul", "cpu")
    monkeypatch.setattr(core_ops, "_TRAMPOLINES", set(core_ops._TRAMPOLINES) - {key})
    installs = []
    real = core_ops._trampoline

    def counting(*args):
        installs.append(args[:2])
        return real(*args)

    monkeypatch.setattr(core_ops, "_trampoline", counting)
    start = threading.Barrier(4)
    seen = {}

    def run(i):
        def fill(o, x):
            o.fill_(i)

        start.wait(10)
        with core_ops.override_kernel(*key, fill):
            o = torch.empty(2, 4)
            ops.silu_and_mul(o, torch.ones(2, 8))
            seen[i] = o.unique().tolist()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert installs == [key]
    assert seen == {i: [float(i)] for i in range(4)}


def test_direct_call_runs_the_registered_kernel_and_yields_to_an_override(monkeypatch):
    """An op's direct call runs the function registered for it, without the dispatcher; inside
    an override_kernel block (of any op) it goes through the dispatcher, so the override
    still applies; an op without one has none."""
    assert core_ops.direct_call("piecewise::silu_and_mul") is None
    seen = []

    def direct(out, x):
        seen.append("direct")
        out.fill_(3)

    monkeypatch.setitem(core_ops._DIRECT, "piecewise::silu_and_mul", direct)
    call = core_ops.direct_call("piecewise::silu_and_mul")
    x, out = torch.randn(2, 8), torch.empty(2, 4)
    call(out, x)
    assert seen == ["direct"] and (out == 3).all()

    def sevens(o, t):
        o.fill_(7)

    with core_ops.override_kernel("piecewise::silu_and_mul", "cpu", sevens):
        call(out, x)
    assert seen == ["direct"] and (out == 7).all()
    call(out=out, x=x)  # keyword arguments: the dispatcher's call (the registered kernel)
    assert seen == ["direct"] and not (out == 3).all()
    with pytest.raises(ValueError, match="op name must look like"):
        core_ops.set_direct_call("silu_and_mul", direct)


def test_direct_call_yields_to_dispatch_modes_and_the_profiler(monkeypatch):
    """A dispatch mode or the profiler watching the thread sees every call: the direct call
    goes through the dispatcher then (the registered kernel runs, the mode sees the op)."""
    from framework.compat.ops import TorchDispatchMode, dispatch_observed

    seen = []
    monkeypatch.setitem(
        core_ops._DIRECT, "piecewise::silu_and_mul", lambda out, x: seen.append("direct")
    )
    call = core_ops.direct_call("piecewise::silu_and_mul")
    x, out = torch.randn(2, 8), torch.empty(2, 4)

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    assert not dispatch_observed()
    with Ops():
        assert dispatch_observed()
        call(out, x)
    assert seen == ["piecewise.silu_and_mul.default"]
    with torch.profiler.profile() as prof:
        assert dispatch_observed()
        call(out, x)
    assert "direct" not in seen
    assert any(e.name == "piecewise::silu_and_mul" for e in prof.events())
    call(out, x)
    assert seen[-1] == "direct"
