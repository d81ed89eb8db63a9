"""Packed linear weights are the model's own tensors: ``piecewise::packed_linear``, the
re-layout once after loading (``PackedLinearMethod.process``, ``process_weights``) and the
``prepack_linear`` pass that switches it on and counts the packed linears."""

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from onednn_panels import onednn_reads_panels

import passes.ops.packed_linear as P
from framework.compat import onednn as onednn_layout
from framework.core.config import CompilationConfig, KernelConfig, PassConfig
from framework.engine.model_prep import process_weights
from models.layers import Linear
from passes import small_m_linear as small_m

pytestmark = pytest.mark.skipif(not P.mkldnn_available(), reason="needs oneDNN (mkldnn)")


def _packed_layer(w, b=None, max_rows=small_m.DEFAULT_MAX_ROWS):
    n, k = w.shape
    layer = Linear(k, n, bias=b is not None, dtype=w.dtype)
    with torch.no_grad():
        layer.weight.copy_(w)
        if b is not None:
            layer.bias.copy_(b)
    method = P.PackedLinearMethod(max_rows)
    assert method.process(layer)
    layer.linear_method = method
    return layer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [3, small_m.DEFAULT_MAX_ROWS + 1, small_m.DEFAULT_MAX_ROWS + 24])
def test_opcheck_and_numerics(dtype, rows):
    x, w, b = (
        torch.randn(rows, 64, dtype=dtype),
        torch.randn(48, 64, dtype=dtype),
        torch.randn(48, dtype=dtype),
    )
    for bias in (None, b):
        layer = _packed_layer(w, bias)
        args = (x, layer.weight, layer.weight_md, layer.bias, 48, 64, layer.linear_method.max_rows)
        torch.library.opcheck(torch.ops.piecewise.packed_linear.default, args)
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(layer(x), F.linear(x, w, bias), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_weight_is_held_once_and_the_original_released(dtype):
    """After processing, the layer's only weight tensor is the packed one (nothing else
    keeps the original alive), and no module-level cache of packed copies exists."""
    n, k = 128, 64
    layer = Linear(k, n, dtype=dtype)
    torch.nn.init.normal_(layer.weight)
    plain = layer.weight.detach().clone()
    original = weakref.ref(layer.weight)
    method = P.PackedLinearMethod(small_m.DEFAULT_MAX_ROWS)
    assert method.process(layer)
    layer.linear_method = method
    gc.collect()
    assert original() is None
    tensors = [t for t in list(layer.parameters()) + list(layer.buffers())]
    big = [t for t in tensors if t.numel() >= n * k]
    assert len(big) == 1 and big[0] is layer.weight
    assert layer.weight.untyped_storage().nbytes() == n * k * plain.element_size()
    for module in (P, small_m, onednn_layout):
        caches = [v for v in vars(module).values() if isinstance(v, (dict, list)) and v]
        assert not any(isinstance(t, torch.Tensor) for c in caches for t in _values(c))
    x = torch.randn(2, k, dtype=dtype)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(layer(x), F.linear(x, plain), atol=tol, rtol=tol)


def _values(c):
    return c.values() if isinstance(c, dict) else c


def test_bf16_panel_layout_is_onednn_layout_and_large_m_matches_the_old_path_bitwise():
    """Where oneDNN lays the weight out as the small-M kernel's panels (AVX512-BF16 without
    AMX), large batches run oneDNN on the layer's own weight, bit for bit what a separately
    packed copy gave.  Where it does not (AMX), no descriptor is kept and large batches run the
    kernel ``max_rows`` rows at a time: every row has the bits it has alone."""
    if small_m.isa() not in ("avx512_bf16", "amx_bf16") or not small_m.kernel_available():
        pytest.skip("oneDNN lays out no bf16 weight here (the AVX2 build)")
    w = torch.randn(2816, 512, dtype=torch.bfloat16) * 0.05
    b = torch.randn(2816, dtype=torch.bfloat16)
    layer = _packed_layer(w, b)
    shared = onednn_reads_panels(w)
    assert layer.linear_method.layout == "panel" and (layer.weight_md is not None) == shared
    assert torch.equal(layer.weight, small_m.pack(w))
    old = torch.ops.mkldnn._reorder_linear_weight(w)
    for rows in (small_m.DEFAULT_MAX_ROWS + 1, small_m.DEFAULT_MAX_ROWS + 48, 200):
        x = torch.randn(rows, 512, dtype=torch.bfloat16)
        if shared:
            ref = torch.ops.mkldnn._linear_pointwise(x, old, b, "none", [], "")
        else:
            ref = torch.cat([layer(x[i : i + 1]) for i in range(rows)])
            torch.testing.assert_close(ref, F.linear(x, w, b), atol=5e-2, rtol=5e-2)
        assert torch.equal(layer(x), ref)


def test_without_a_onednn_descriptor_large_batches_unpack_per_call():
    """The public fallback (no oneDNN view): F.linear on the weight unpacked for the call."""
    w = torch.randn(100, 70, dtype=torch.bfloat16)
    layer = _packed_layer(w)
    layer.weight_md = None
    x = torch.randn(small_m.DEFAULT_MAX_ROWS + 5, 70, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), F.linear(x, w), atol=5e-2, rtol=5e-2)


def _tiny_model(tie: bool):
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(50, 32, dtype=torch.bfloat16)
            self.up = Linear(32, 64, dtype=torch.bfloat16)
            self.down = Linear(64, 32, bias=True, dtype=torch.bfloat16)
            self.lm_head = Linear(32, 50, dtype=torch.bfloat16)
            for p in self.parameters():
                torch.nn.init.normal_(p, std=0.2)
            if tie:
                self.lm_head.weight = self.embed.weight

        def forward(self, ids):
            h = self.embed(ids)
            return self.lm_head(self.down(torch.relu(self.up(h))) + h)

    return Tiny()


def _config(passes, **kernels):
    return CompilationConfig(
        pass_config=PassConfig(passes=passes), kernel_config=KernelConfig(**kernels)
    )


@pytest.mark.parametrize("tie", [False, True])
def test_process_weights_packs_every_linear_but_a_tied_one(tie):
    model = _tiny_model(tie)
    ids = torch.randint(50, (5,))
    with torch.no_grad():
        ref = model(ids)
        packed = process_weights(model, _config(["prepack_linear"]))
        out = model(ids)
    assert packed == (["up", "down"] if tie else ["up", "down", "lm_head"])
    if tie:
        assert model.lm_head.weight is model.embed.weight and model.lm_head.linear_method is None
    torch.testing.assert_close(out, ref, atol=5e-2, rtol=5e-2)


def test_process_weights_follows_the_pass_list_and_the_kernel_config():
    model = _tiny_model(False)
    assert process_weights(model, _config(["noop_elimination"])) == []
    assert model.up.weight.shape == (64, 32) and model.up.linear_method is None
    process_weights(model, _config(["prepack_linear"], small_m_linear=False))
    if onednn_layout.packs(torch.bfloat16):
        assert model.up.linear_method.max_rows == 0  # oneDNN's layout, no kernel
    else:  # an AVX2-only CPU: no layout reads the packed weight, the layer stays dense
        assert model.up.linear_method is None and model.up.weight.shape == (64, 32)
    other = _tiny_model(False)
    process_weights(other, _config(["prepack_linear"], small_m_max_rows=4))
    assert other.up.linear_method.max_rows == (4 if small_m.kernel_available() else 0)


def test_kernel_config_is_part_of_the_cache_key(monkeypatch):
    base = CompilationConfig().compute_hash()
    assert CompilationConfig(kernel_config=KernelConfig(small_m_max_rows=8)).compute_hash() != base
    assert CompilationConfig(kernel_config={"small_m_linear": False}).compute_hash() != base
    monkeypatch.setenv("PIECEWISE_SMALL_M_LINEAR", "0")  # the documented default of the field
    assert KernelConfig().small_m_linear is False
    with pytest.raises(ValueError, match="KernelConfig.small_m_max_rows"):
        KernelConfig(small_m_max_rows=-1)


def test_the_pass_counts_the_packed_linears_in_a_compiled_graph():
    from graph_test_backend import TestBackend, compile_with, count_op

    from passes.manager import PassManager

    dtype = torch.bfloat16
    pm = PassManager(PassConfig(passes=["prepack_linear"]), dtype=dtype)
    backend = TestBackend(pm)
    layer = _packed_layer(torch.randn(48, 32, dtype=dtype))

    def f(x, w, md):
        y = torch.ops.piecewise.packed_linear(x, w, md, None, 48, 32, 16)
        return torch.relu(y), F.linear(x, w.new_ones(8, 32))  # a plain matmul: not counted

    args = [torch.randn(2, 32, dtype=dtype), layer.weight, layer.weight_md]
    compile_with(f, backend, *args)
    assert count_op(backend.graph_after, torch.ops.piecewise.packed_linear) == 1
    assert pm.stats()["prepack_linear"]["total_matches"] == 1


def test_onednn_layout_is_checked_once_per_shape(monkeypatch):
    """Over one model's layers, oneDNN re-lays only the first weight of each shape; the
    others are packed directly and share its verdict and descriptor (and stay exact)."""
    if not small_m.kernel_available():
        pytest.skip("no small-M kernel: every bf16 weight goes through oneDNN")
    calls = []
    real = onednn_layout.reorder
    monkeypatch.setattr(onednn_layout, "reorder", lambda w: calls.append(w.shape) or real(w))
    layouts: dict = {}
    ws = [torch.randn(128, 64, dtype=torch.bfloat16) for _ in range(3)]
    layers = []
    for w in ws + [torch.randn(64, 64, dtype=torch.bfloat16)]:
        layer = Linear(w.shape[1], w.shape[0], dtype=w.dtype)
        with torch.no_grad():
            layer.weight.copy_(w)
        method = P.PackedLinearMethod(small_m.DEFAULT_MAX_ROWS)
        assert method.process(layer, layouts)
        layer.linear_method = method
        layers.append(layer)
    assert calls == [(128, 64), (64, 64)]
    x = torch.randn(small_m.DEFAULT_MAX_ROWS + 4, 64, dtype=torch.bfloat16)
    for layer, w in zip(layers, ws):
        assert torch.equal(layer.weight, small_m.pack(w))
        torch.testing.assert_close(layer(x), F.linear(x, w), atol=5e-2, rtol=5e-2)
    mds = [layer.weight_md for layer in layers[:3]]
    assert all((md is None) == (mds[0] is None) for md in mds)
