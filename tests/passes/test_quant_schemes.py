"""The quantization pass: scheme registry, weights quantized once, ops in the graph."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from framework.core.quantization import QuantizationConfig, QuantKey, QuantSpec
from models.layers import Linear, MergedLinear, RMSNorm
from passes import quant_schemes as qs

H, I, V = 64, 96, 128


class ToyBlock(nn.Module):
    """Names and op order of one decoder layer's linears (no attention)."""

    def __init__(self):
        super().__init__()
        self.input_layernorm = RMSNorm(H)
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = MergedLinear(H, [H, H // 2, H // 2])
        self.self_attn.o_proj = Linear(2 * H, H)
        self.post_attention_layernorm = RMSNorm(H)
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = MergedLinear(H, [I, I])
        self.mlp.down_proj = Linear(I, H, bias=True)

    def forward(self, x):
        qkv = self.self_attn.qkv_proj(self.input_layernorm(x))
        x = x + self.self_attn.o_proj(qkv)
        gate_up = self.mlp.gate_up_proj(self.post_attention_layernorm(x))
        return x + self.mlp.down_proj(F.silu(gate_up[:, :I]) * gate_up[:, I:])


class ToyModel(nn.Module):
    def __init__(self, dtype=torch.float32, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(V, H)
        self.model.layers = nn.ModuleList([ToyBlock(), ToyBlock()])
        self.lm_head = Linear(H, V)
        for m in self.modules():
            if isinstance(m, Linear):
                nn.init.normal_(m.weight, std=H**-0.5)
                if m.bias is not None:
                    nn.init.normal_(m.bias, std=0.1)
        self.to(dtype)

    def forward(self, ids):
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(x)


LINEARS = [
    f"model.layers.{i}.{n}"
    for i in range(2)
    for n in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
]
IDS = torch.tensor([1, 5, 9, 33, 64, 100, 127, 2])


def test_quantize_model_int8_per_token_installs_schemes_and_int8_weights():
    model = ToyModel()
    down_w = model.model.layers[0].mlp.down_proj.weight.clone()
    result = qs.quantize_model(model, "int8_per_token")
    assert result == {name: "int8_dynamic_per_token" for name in LINEARS}
    down = model.model.layers[0].mlp.down_proj
    assert down.weight.dtype == torch.int8 and down.weight.shape == (H, I)
    assert down.weight_scale.shape == (1, H) and down.weight_scale.dtype == torch.float32
    # dequantized weight within half a step of the original, per output channel
    err = (down.weight.float() * down.weight_scale.t() - down_w).abs()
    assert (err <= down.weight_scale.t() / 2 + 1e-7).all()
    assert model.lm_head.linear_method is None and model.lm_head.weight.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.float32


def test_quantize_model_twice_is_an_error():
    model = ToyModel()
    qs.quantize_model(model, "int8_per_token")
    with pytest.raises(ValueError, match="already has linear method"):
        qs.quantize_model(model, "int8_per_token")


@pytest.mark.parametrize(
    "shorthand,scheme,max_rel",
    [
        ("int8_per_token", "int8_dynamic_per_token", 0.03),
        ("int8_per_channel_weight_only", "int8_weight_only", 0.02),
        ("fp8_per_token", "fp8_dynamic_per_token", 0.08),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_model_tracks_float_model(shorthand, scheme, max_rel, dtype):
    ref_model = ToyModel(dtype)
    with torch.no_grad():
        want = ref_model(IDS).float()
    model = ToyModel(dtype)
    assert set(qs.quantize_model(model, shorthand).values()) == {scheme}
    with torch.no_grad():
        got = model(IDS).float()
    rel = (got - want).norm() / want.norm()
    assert rel < max_rel + (0.02 if dtype == torch.bfloat16 else 0), rel
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75


@pytest.mark.parametrize(
    "shorthand,scheme",
    [
        ("fp8_per_tensor", "fp8_static_per_tensor"),
        (
            {
                "linear": {
                    "shorthand": "int8_per_token",
                    "activation": {"scale": "static", "group": "per_tensor"},
                }
            },
            "int8_static_per_tensor",
        ),
    ],
)
def test_static_activation_scales_need_calibration(shorthand, scheme):
    ref_model = ToyModel()
    with torch.no_grad():
        want = ref_model(IDS)
    model = ToyModel()
    assert set(qs.quantize_model(model, shorthand).values()) == {scheme}
    with pytest.raises(RuntimeError, match="'model.layers.0.self_attn.qkv_proj'.*calibrat"):
        model(IDS)
    scales = qs.calibrate_activation_scales(model, lambda: model(IDS))
    assert set(scales) == set(LINEARS) and all(s > 0 for s in scales.values())
    with torch.no_grad():
        got = model(IDS)
    assert (got - want).norm() / want.norm() < 0.08


@pytest.mark.parametrize("shorthand", ["int8_per_token", "int8_per_channel_weight_only"])
def test_nothing_to_calibrate_runs_no_forward(shorthand):
    """Dynamic and weight-only schemes have no static scale: calibration returns at once
    instead of running a (start-up, eager) forward for nothing."""
    model = ToyModel()
    qs.quantize_model(model, shorthand)
    assert qs.calibrate_activation_scales(model, lambda: pytest.fail("ran a forward")) == {}


def test_graph_carries_quant_op_then_scaled_mm():
    """What the fusion passes rely on: RMSNorm -> dynamic_per_token_quant -> int8_scaled_mm,
    and silu*mul -> dynamic_per_token_quant -> int8_scaled_mm, and no float matmul left for
    the quantized layers."""
    model = ToyModel()
    qs.quantize_model(model, "int8_per_token")
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model.model.layers[0], backend=capture, fullgraph=True)(torch.randn(4, H))
    calls = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    targets = [
        getattr(t, "__name__", str(t)) if not isinstance(t, torch._ops.OpOverloadPacket) else str(t)
        for t in calls
    ]
    assert targets.count("piecewise.dynamic_per_token_quant") == 4
    assert targets.count("piecewise.int8_scaled_mm") == 4
    assert not any(t.endswith("linear") or t.endswith("matmul") for t in targets)
    first_quant = targets.index("piecewise.dynamic_per_token_quant")
    assert torch.rsqrt in calls[:first_quant]  # the RMSNorm precedes it


def test_ignore_and_targets_select_layers():
    model = ToyModel()
    result = qs.quantize_model(
        model, {"linear": "int8_per_token", "ignore": ["*.down_proj", "model.layers.1.*"]}
    )
    assert set(result) == {
        f"model.layers.0.{n}"
        for n in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj")
    }
    model = ToyModel()
    result = qs.quantize_model(
        model,
        {
            "targets": {
                "re:model\\.layers\\.\\d+\\.mlp\\..*": "int8_per_channel_weight_only",
                "model.layers.0.self_attn.o_proj": "int8_per_token",
                "lm_head": "int8_per_channel_weight_only",
            }
        },
    )
    assert result == {
        "model.layers.0.self_attn.o_proj": "int8_dynamic_per_token",
        "model.layers.0.mlp.gate_up_proj": "int8_weight_only",
        "model.layers.0.mlp.down_proj": "int8_weight_only",
        "model.layers.1.mlp.gate_up_proj": "int8_weight_only",
        "model.layers.1.mlp.down_proj": "int8_weight_only",
        "lm_head": "int8_weight_only",
    }


def test_tied_lm_head_keeps_embedding_float():
    model = ToyModel()
    model.lm_head.weight = model.model.embed_tokens.weight
    qs.quantize_model(model, {"targets": {"lm_head": "int8_per_channel_weight_only"}})
    assert model.lm_head.weight.dtype == torch.int8
    assert model.model.embed_tokens.weight.dtype == torch.float32


def test_unsupported_spec_names_layer_and_touches_nothing():
    model = ToyModel()
    spec = {"weight": {"dtype": "int8", "scale": "static", "group": "per_group", "group_size": 32}}
    with pytest.raises(
        ValueError,
        match=r"layer 'model\.layers\.0\.self_attn\.qkv_proj'.*"
        r"no linear scheme.*int8_dynamic_per_token",
    ):
        qs.quantize_model(model, {"linear": spec})
    assert all(m.linear_method is None for _, m in qs.linear_layers(model))


def test_scheme_registry_matches_by_pattern():
    i8w = QuantKey("int8", "static", "per_channel")
    assert qs.scheme_for(QuantSpec(i8w, None, weight_only=True)).name == "int8_weight_only"
    # activation None = the method default: int8 dynamic per-token
    assert qs.scheme_for(QuantSpec(i8w)).name == "int8_dynamic_per_token"
    f8a = QuantKey("fp8_e4m3", "static", "per_tensor")
    assert qs.scheme_for(QuantSpec(None, f8a)).name == "fp8_static_per_tensor"
    with pytest.raises(ValueError, match="no linear scheme"):
        qs.scheme_for(QuantSpec(i8w, QuantKey("int8", "dynamic", "per_token", symmetric=False)))
    with pytest.raises(ValueError, match="already registered"):
        qs.register_scheme("int8_weight_only", weight={}, activation=qs.WEIGHT_ONLY)(
            type("Dup", (qs.LinearScheme,), {})
        )


def test_quantize_weight_per_tensor_and_fp8():
    w = torch.randn(8, 16)
    q, s = qs.quantize_weight(w, QuantKey("int8", "static", "per_tensor"))
    assert s.shape == (1,) and q.dtype == torch.int8 and q.abs().max() == 127
    q, s = qs.quantize_weight(w, QuantKey("fp8_e4m3", "static", "per_channel"))
    assert s.shape == (1, 8) and q.dtype == torch.float8_e4m3fn
    assert torch.allclose(q.float().abs().amax(1), torch.full((8,), 448.0))
    torch.testing.assert_close(q.float() * s.t(), w, rtol=0.07, atol=1e-3)


def test_none_config_quantizes_nothing():
    model = ToyModel()
    assert qs.quantize_model(model, None) == {}
    assert QuantizationConfig.parse(None) is None
