"""framework.compat: every private-API wrapper works on the installed torch (CI runs this on
torch 2.13 and, in the GPU-image stage, 2.11), optional paths fail closed to the public path
with one warning, and no module outside the package touches ``torch._*``."""

from __future__ import annotations

import io
import logging
import sys
import tokenize
from pathlib import Path

import pytest
import torch

from framework import compat
from framework.compat import dynamo as compat_dynamo
from framework.compat import inductor as compat_inductor
from framework.compat import ops as compat_ops
from framework.compat import tensors as compat_tensors
from framework.compat import versions

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("framework", "backends", "passes", "models", "experiments")


def _compat_records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "framework.compat"]


@pytest.fixture
def fresh_warnings(monkeypatch):
    """A fresh once-registry, so each test sees its own first warning."""
    monkeypatch.setattr(versions, "_REGISTRY", versions._OnceRegistry())


def test_declared_range_covers_the_installed_torch():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"torch>=2.11,<2.15"' in text
    assert (2, 11) <= compat.torch_version() < (2, 15)
    assert {v.rsplit(".", 1)[0] for v in compat.CHECKED_ON} == {"2.11", "2.13"}


def test_op_types_and_helpers():
    add = torch.ops.aten.add.Tensor
    assert isinstance(add, compat_ops.OpOverload)
    assert isinstance(torch.ops.aten.add, compat_ops.OpOverloadPacket)
    assert isinstance(compat_ops.auto_functionalized, compat_ops.HigherOrderOperator)
    assert compat_ops.qualified_name(torch.sin) == "torch.sin"
    assert compat_ops.c10d_functional().all_reduce.default.name() == "_c10d_functional::all_reduce"
    leaves, spec = compat_ops.tree_flatten({"a": (1, torch.ones(1))})
    assert compat_ops.tree_unflatten(leaves, spec)["a"][0] == 1
    assert compat_ops.tree_map_only(int, lambda v: v + 1, [1, "x"]) == [2, "x"]
    with compat_ops.FakeTensorMode():
        fake = torch.empty(3)
    assert isinstance(fake, compat_ops.FakeTensor)
    with compat_ops.no_python_dispatcher(), compat_ops.unset_fake_temporarily():
        pass
    a = torch.randint(-100, 100, (32, 48), dtype=torch.int8)
    b = torch.randint(-100, 100, (48, 16), dtype=torch.int8)
    out = compat_ops.int_mm(a, b)
    assert out.dtype == torch.int32
    assert torch.equal(out, a.long().mm(b.long()).int())


def test_int_mm_without_the_private_op_uses_the_public_matmul(monkeypatch):
    monkeypatch.delattr(torch, "_int_mm")
    a = torch.randint(-100, 100, (4, 8), dtype=torch.int8)
    b = torch.randint(-100, 100, (8, 3), dtype=torch.int8)
    assert torch.equal(compat_ops.int_mm(a, b), a.long().mm(b.long()).int())


def test_storage_helpers_and_their_fallbacks(monkeypatch, fresh_warnings, caplog):
    x = torch.arange(6.0)
    assert compat_tensors.storage_use_count(x) == 1
    view = x[2:]
    assert compat_tensors.storage_use_count(x) == 2
    weak = compat_tensors.weak_ref_tensor(view)
    assert weak.data_ptr() == view.data_ptr() and torch.equal(weak, view)
    assert compat_tensors.storage_use_count(x) == 2  # the weak alias holds no reference
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    monkeypatch.delattr(torch._C, "_construct_storage_from_data_pointer")
    with caplog.at_level(logging.WARNING, logger="framework.compat"):
        assert compat_tensors.storage_use_count(x) is None
        assert compat_tensors.storage_use_count(x) is None
        assert compat_tensors.weak_ref_tensor(view) is view  # strong: correct, held longer
    assert len(_compat_records(caplog)) == 2  # one per feature, not per call


def test_dynamo_helpers():
    compat_dynamo.forget_code_cache(test_dynamo_helpers.__code__)
    t = torch.ones(4, 2)
    compat_dynamo.mark_dynamic(t, 0)
    local, prop = compat_dynamo.placeholder_source_types()
    assert local.__name__ == "LocalSource" and prop.__name__ == "TensorPropertySource"
    assert compat_dynamo.dynamo_imported()
    cfg = compat_dynamo.config()
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    old = getattr(cfg, name)
    try:
        compat_dynamo.set_recompile_limit(old + 1)
        assert getattr(cfg, name) == old + 1
    finally:
        setattr(cfg, name, old)


def test_inductor_helpers():
    assert callable(compat_inductor.pattern_matcher().register_replacement)
    assert compat_inductor.custom_graph_pass_base().__name__ == "CustomGraphPass"
    assert compat_inductor.inductor_config().max_autotune in (True, False)
    assert hasattr(compat_inductor.functorch_config(), "__name__")
    assert torch.ops.aten.gelu.default in compat_inductor.decomposition_table()
    with compat_inductor.config_patch(freezing=True):
        assert compat_inductor.inductor_config().freezing is True
    compat_inductor.clear_caches()
    facts = compat_inductor.lean_export_facts()
    assert facts is not None and facts.align_bytes == 64
    assert isinstance(compat_inductor.tensor_data_ptr_address(), int)
    assert compat_inductor.compiled_fx_graph_class().__name__ == "CompiledFxGraph"


def test_register_replacement_on_this_torch():
    """``pattern_name`` is passed where the installed torch takes it (2.13), dropped where it
    does not (2.11); the pattern matches either way."""
    pm = compat_inductor.pattern_matcher()
    matcher = pm.PatternMatcherPass(pass_name="compat-test")

    def pattern(x):
        return torch.ops.aten.mul.Tensor(x, 2.0)

    def replacement(x):
        return torch.ops.aten.add.Tensor(x, x)

    compat_inductor.register_replacement(
        pattern, replacement, [torch.randn(4)], pm.fwd_only, matcher, pattern_name="x2"
    )
    gm = pm.fwd_only(lambda x: torch.ops.aten.mul.Tensor(x, 2.0) + 1, [torch.randn(4)])
    assert matcher.apply(gm.graph) == 1


def _compile_piece():
    from backends.piecewise.compiler import CompileRange, make_compiler

    x, w = torch.randn(4, 8), torch.randn(8, 8)

    def f(x, w):
        return (torch.relu(x @ w) * 3 - 1,)

    compiler = make_compiler("inductor")
    compiled, save = compiler.compile(torch.fx.symbolic_trace(f), [x, w], CompileRange(4, 4))
    torch.testing.assert_close(compiled(x, w)[0], f(x, w)[0])
    return compiled


def test_lean_path_is_on_where_its_hook_exists(fresh_warnings, caplog):
    with caplog.at_level(logging.WARNING, logger="framework.compat"):
        assert getattr(_compile_piece(), "lean", False)
    assert not _compat_records(caplog)


def test_a_renamed_aot_hook_disables_only_the_lean_path(monkeypatch, fresh_warnings, caplog):
    """The hook the lean export spies on is gone: both cold compiles still work (the standard
    artifact runs) and the lean path is reported off exactly once."""
    module, _ = compat_inductor.AOT_METADATA_HOOK
    monkeypatch.setattr(compat_inductor, "AOT_METADATA_HOOK", (module, "_renamed_in_this_torch"))
    with caplog.at_level(logging.WARNING, logger="framework.compat"):
        first, second = _compile_piece(), _compile_piece()
    assert not getattr(first, "lean", False) and not getattr(second, "lean", False)
    records = _compat_records(caplog)
    assert len(records) == 1 and compat_inductor.LEAN_FEATURE in records[0], records


def test_changed_aot_metadata_disables_only_the_lean_path(monkeypatch, fresh_warnings, caplog):
    """The metadata object lost a field the export reads: the compile survives."""

    class Stripped:  # ViewAndMutationMeta without any of its fields
        pass

    real_spy = compat_inductor.aot_metadata_spy

    def stripped_spy():
        import contextlib

        @contextlib.contextmanager
        def cm():
            with real_spy() as seen:
                yield seen
                seen[:] = [Stripped() for _ in seen]

        return cm()

    monkeypatch.setattr(compat_inductor, "aot_metadata_spy", stripped_spy)
    with caplog.at_level(logging.WARNING, logger="framework.compat"):
        assert not getattr(_compile_piece(), "lean", False)
        assert not getattr(_compile_piece(), "lean", False)
    records = _compat_records(caplog)
    assert len(records) == 1 and "export failed" in records[0], records


def test_emulation_without_the_inductor_hook_replays_the_whole_callable(
    monkeypatch, fresh_warnings
):
    from framework.cudagraph.emulation import EmulatedGraphOps

    monkeypatch.setattr(compat_inductor, "compiled_fx_graph_class", lambda: None)
    ops = EmulatedGraphOps()
    x = torch.arange(4.0)
    graph, out = ops.capture(lambda: x * 2 + 1, ops.shared_pool(), collect_garbage=False)
    x.copy_(torch.tensor([10.0, 20.0, 30.0, 40.0]))
    ops.replay(graph)
    assert torch.equal(out, x * 2 + 1)


def _private_uses(path: Path) -> list[str]:
    """Private torch in code (not comments or strings): ``torch._<name>`` (NAME 'torch', OP '.',
    NAME '_x'), and an underscore op or op namespace, ``torch.ops.<ns>._<op>`` or
    ``torch.ops._<ns>`` (the project's own ``piecewise`` namespace is public)."""
    tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
    names = [t.string if t.type in (tokenize.NAME, tokenize.OP) else None for t in tokens]
    hits = []
    for i, a in enumerate(tokens):
        if a.type != tokenize.NAME or a.string != "torch" or names[i + 1 : i + 2] != ["."]:
            continue
        chain = []  # the dotted names after "torch"
        j = i + 1
        while (
            names[j : j + 1] == ["."]
            and j + 1 < len(tokens)
            and tokens[j + 1].type == tokenize.NAME
        ):
            chain.append(tokens[j + 1].string)
            j += 2
        private = (
            chain[:1] and chain[0].startswith("_") and chain[0] not in ("__version__", "__file__")
        )
        private_op = chain[:1] == ["ops"] and any(c.startswith("_") for c in chain[1:3])
        if private or private_op:
            hits.append(f"{path.relative_to(ROOT)}:{a.start[0]}: torch.{'.'.join(chain)}")
    return hits


def test_the_private_use_check_finds_attributes_and_underscore_ops(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    src = tmp_path / "m.py"
    src.write_text(
        "import torch\n"
        "a = torch.ops.aten._weight_int8pack_mm\n"
        "b = torch._C._foo\n"
        "c = torch.ops._c10d_functional.all_reduce\n"
        "d = torch.ops.piecewise.packed_linear.default + torch.ops.aten.mm.default\n"
        "e = torch.__version__  # torch._x in a comment\n"
        "f = 'torch._y'\n"
    )
    assert _private_uses(src) == [
        "m.py:2: torch.ops.aten._weight_int8pack_mm",
        "m.py:3: torch._C._foo",
        "m.py:4: torch.ops._c10d_functional.all_reduce",
    ]


def test_no_private_torch_api_outside_the_compat_package():
    hits = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.is_relative_to(ROOT / "framework" / "compat"):
                continue
            hits += _private_uses(path)
    assert not hits, "private torch API outside framework/compat:\n" + "\n".join(hits)


def test_weight_int8pack_mm_and_its_public_fallback(monkeypatch):
    from passes.ops import scaled_mm
    from passes.ops.scaled_mm import int8_weight_only_mm_torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, generator=g).bfloat16()
    w_q = torch.randint(-127, 127, (32, 64), generator=g, dtype=torch.int8)
    scale = torch.rand(32, generator=g) * 0.01
    ref = x.float() @ (w_q.float() * scale.bfloat16().float()[:, None]).t()
    got = compat_ops.weight_int8pack_mm(x, w_q, scale.bfloat16())
    assert got is not None and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)
    packed = int8_weight_only_mm_torch(x, w_q, scale, None)
    torch.testing.assert_close(packed.float(), ref, rtol=2e-2, atol=2e-2)
    # a torch without the private op: the wrapper says so ...
    with monkeypatch.context() as m:
        m.setattr(torch.ops, "aten", type("NoAten", (), {})())
        assert compat_ops.weight_int8pack_mm(x, w_q, scale.bfloat16()) is None
    # ... and the weight-only op dequantises and runs F.linear instead
    monkeypatch.setattr(scaled_mm, "weight_int8pack_mm", lambda *a: None)
    out = int8_weight_only_mm_torch(x, w_q, scale, None)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
