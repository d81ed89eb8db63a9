"""Quantized linear schemes and the quantization pass that installs them.

A scheme is a class registered with :func:`register_scheme` on a (weight key, activation key)
*pattern*; :func:`scheme_for` picks the first scheme whose patterns match a layer's resolved
:class:`~framework.core.quantization.QuantSpec` (no if-chains: adding a scheme is one decorated
class).  :func:`quantize_model` walks the model's linear layers -- modules exposing
``linear_method`` and a 2-D ``weight`` (the :class:`models.layers.Linear` protocol; ``passes``
does not import ``models``) -- and for each layer the config quantizes:

* ``process(layer)`` quantizes the weight **once**: ``layer.weight`` becomes the int8/fp8
  ``[N, K]`` tensor and ``weight_scale`` (fp32 ``[1, N]`` or ``[1]``) is registered as a buffer;
* sets ``layer.linear_method = scheme``, whose ``apply(layer, x)`` emits the activation-quant op
  (``piecewise::dynamic_per_token_quant`` / ``static_scaled_quant``) followed by the scaled mm,
  so the fusion passes find ``rms_norm -> quant`` and ``silu_and_mul -> quant`` in the graph.

Static activation scales (``fp8_per_tensor`` and other ``scale: static`` activation keys) come
from :func:`calibrate_activation_scales`; running such a layer uncalibrated is an error naming
the layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Iterator

import torch
import torch.nn as nn

import passes.ops  # noqa: F401  (registers the piecewise ops)
from framework.core.quantization import QuantizationConfig, QuantKey, QuantSpec
from framework.core.registry import Registry
from passes.ops.quant_utils import MIN_DYNAMIC_SCALE, quant_max

ops = torch.ops.piecewise

TORCH_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


@dataclasses.dataclass(frozen=True)
class KeyPattern:
    """Matches a :class:`QuantKey`; ``None`` fields match anything, tuples any listed value."""

    dtype: Any = None
    scale: Any = None
    group: Any = None
    symmetric: Any = True

    def matches(self, key: QuantKey | None) -> bool:
        if key is None:
            return False
        for name in ("dtype", "scale", "group", "symmetric"):
            want = getattr(self, name)
            have = getattr(key, name)
            if want is not None and have not in (want if isinstance(want, tuple) else (want,)):
                return False
        return True

    def __str__(self) -> str:
        return "/".join(str(v) for v in dataclasses.astuple(self) if v is not None)


WEIGHT_ONLY = "weight_only"
"""Activation pattern of schemes that keep activations unquantized."""


def _matches(weight: KeyPattern, activation: KeyPattern | str, spec: QuantSpec) -> bool:
    if not weight.matches(spec.weight):
        return False
    if activation == WEIGHT_ONLY:
        return spec.weight_only
    return not spec.weight_only and activation.matches(spec.activation)

    def matches(self, spec: QuantSpec) -> bool:
        if not self.weight.matches(spec.weight):
            return False
        if self.activation == WEIGHT_ONLY:
            return spec.weight_only
        return not spec.weight_only and self.activation.matches(spec.activation)


SCHEMES: Registry[type["LinearScheme"]] = Registry("linear quantization scheme")
"""Tried in registration order; the first scheme whose patterns match a spec handles it."""


def register_scheme(name: str, *, weight: dict, activation: dict | str):
    """Class decorator: the scheme handles specs matching ``weight`` and ``activation``
    (KeyPattern fields, or :data:`WEIGHT_ONLY`)."""

    def deco(cls: type[LinearScheme]) -> type[LinearScheme]:
        act = activation if activation == WEIGHT_ONLY else KeyPattern(**activation)
        cls.name = name
        return SCHEMES.add(name, cls, weight=KeyPattern(**weight), activation=act)

    return deco


def registered_schemes() -> dict[str, str]:
    return {
        e.name: f"weight={e.meta['weight']}, activation={e.meta['activation']}"
        for e in SCHEMES.entries()
    }


def scheme_for(spec: QuantSpec, layer_name: str = "?") -> type["LinearScheme"]:
    spec = spec.resolved()
    for entry in SCHEMES.entries():
        if _matches(entry.meta["weight"], entry.meta["activation"], spec):
            return entry.obj
    raise ValueError(
        f"quantization of layer {layer_name!r}: no linear scheme implements "
        f"{spec}; registered schemes: {registered_schemes()}"
    )


# --- weight quantization (once, at load) --------------------------------------------------


def quantize_weight(weight: torch.Tensor, key: QuantKey) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric ``[N, K]`` weight -> (quantized ``[N, K]``, fp32 scale ``[1, N]`` or ``[1]``)."""
    qdtype = TORCH_DTYPES[key.dtype]
    w = weight.detach().float()
    if key.group == "per_channel":
        absmax = w.abs().amax(dim=1)
    elif key.group == "per_tensor":
        absmax = w.abs().amax().reshape(1)
    else:
        raise ValueError(
            f"quantize_weight: group {key.group!r} is not supported for weights "
            f"(per_channel or per_tensor)"
        )
    scale = (absmax / quant_max(qdtype)).clamp_(min=MIN_DYNAMIC_SCALE)
    y = w / (scale[:, None] if scale.numel() > 1 else scale)
    if qdtype == torch.int8:
        q = y.round_().clamp_(-128, 127).to(torch.int8)
    else:
        q = y.clamp_(-quant_max(qdtype), quant_max(qdtype)).to(qdtype)
    return q, (scale.reshape(1, -1) if key.group == "per_channel" else scale)


def _replace_weight(layer: nn.Module, q: torch.Tensor) -> None:
    # A fresh Parameter (not an in-place copy): a tied embedding keeps its float matrix.
    del layer.weight
    layer.weight = nn.Parameter(q, requires_grad=False)


# --- schemes --------------------------------------------------------------------------------


class LinearScheme:
    """A linear method: quantize the layer once (``process``), compute it (``apply``)."""

    name: ClassVar[str]

    def __init__(self, spec: QuantSpec, layer_name: str = "?"):
        self.spec = spec.resolved()
        self.layer_name = layer_name

    def process(self, layer: nn.Module) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec})"


class ActivationQuantScheme(LinearScheme):
    """W8A8-style: quantized weights, activations quantized per call by an op in the graph."""

    mm_op: ClassVar[Any]

    def process(self, layer: nn.Module) -> None:
        q, scale = quantize_weight(layer.weight, self.spec.weight)
        self.out_dtype = layer.weight.dtype
        _replace_weight(layer, q)
        layer.register_buffer("weight_scale", scale.to(q.device))
        if self.spec.activation.scale == "static":
            # Filled by calibrate_activation_scales; zero marks "not calibrated".
            layer.register_buffer("input_scale", torch.zeros(1, device=q.device))
            self.calibrated = False

    def quantize_input(self, layer: nn.Module, x: torch.Tensor):
        qdtype = TORCH_DTYPES[self.spec.activation.dtype]
        x_q = torch.empty(x.shape, dtype=qdtype, device=x.device)
        if self.spec.activation.scale == "dynamic":
            scales = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
            ops.dynamic_per_token_quant(x_q, x, scales)
            return x_q, scales
        if not self.calibrated:
            raise RuntimeError(
                f"layer {self.layer_name!r} quantizes activations with a static "
                f"scale that was never calibrated; call passes.quant_schemes."
                f"calibrate_activation_scales(model, run) first"
            )
        ops.static_scaled_quant(x_q, x, layer.input_scale)
        return x_q, layer.input_scale

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        x_q, x_scale = self.quantize_input(layer, x2)
        y = self.mm_op(x_q, x_scale, layer.weight.t(), layer.weight_scale, layer.bias, x.dtype)
        return y.view(*x.shape[:-1], y.shape[-1])


_WEIGHT = dict(scale="static", group=("per_channel", "per_tensor"))
_DYNAMIC = dict(scale="dynamic", group="per_token")
_STATIC = dict(scale="static", group="per_tensor")


@register_scheme(
    "int8_dynamic_per_token",
    weight=dict(dtype="int8", **_WEIGHT),
    activation=dict(dtype="int8", **_DYNAMIC),
)
class Int8DynamicPerToken(ActivationQuantScheme):
    """int8 weights (per channel/tensor) x int8 activations quantized per token at run time;
    ``torch._int_mm`` on CPU, Triton on CUDA."""

    mm_op = ops.int8_scaled_mm


@register_scheme(
    "int8_static_per_tensor",
    weight=dict(dtype="int8", **_WEIGHT),
    activation=dict(dtype="int8", **_STATIC),
)
class Int8StaticPerTensor(ActivationQuantScheme):
    """int8 weights x int8 activations with one calibrated scale per layer."""

    mm_op = ops.int8_scaled_mm


@register_scheme(
    "fp8_dynamic_per_token",
    weight=dict(dtype="fp8_e4m3", **_WEIGHT),
    activation=dict(dtype="fp8_e4m3", **_DYNAMIC),
)
class Fp8DynamicPerToken(ActivationQuantScheme):
    """fp8 e4m3 weights x fp8 activations quantized per token; a GPU path (the CPU reference
    upcasts to fp32 and is slow)."""

    mm_op = ops.fp8_scaled_mm


@register_scheme(
    "fp8_static_per_tensor",
    weight=dict(dtype="fp8_e4m3", **_WEIGHT),
    activation=dict(dtype="fp8_e4m3", **_STATIC),
)
class Fp8StaticPerTensor(ActivationQuantScheme):
    """fp8 e4m3 weights x fp8 activations with one calibrated scale per layer (GPU path)."""

    mm_op = ops.fp8_scaled_mm


@register_scheme(
    "int8_weight_only",
    weight=dict(dtype="int8", scale="static", group="per_channel"),
    activation=WEIGHT_ONLY,
)
class Int8WeightOnly(LinearScheme):
    """int8 per-channel weights, activations in the model dtype (``int8_weight_only_mm``)."""

    def process(self, layer: nn.Module) -> None:
        q, scale = quantize_weight(layer.weight, self.spec.weight)
        dtype = layer.weight.dtype
        _replace_weight(layer, q)
        # Scales in the activation dtype: the CPU kernel wants them so; no per-call cast.
        layer.register_buffer("weight_scale", scale.reshape(-1).to(dtype))

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return ops.int8_weight_only_mm(x, layer.weight, layer.weight_scale, layer.bias)


# --- the pass --------------------------------------------------------------------------------


def linear_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` of every module following the ``models.layers.Linear`` protocol."""
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if (
            hasattr(module, "linear_method")
            and isinstance(weight, torch.Tensor)
            and weight.dim() == 2
        ):
            yield name, module


# --- MoE experts ------------------------------------------------------------------------------


class ExpertScheme:
    """An expert method for stacked MoE experts (modules exposing ``w13 [E, 2I, H]``,
    ``w2 [E, H, I]`` and ``moe_method``): quantize once (``process``), compute (``apply``)."""

    name: ClassVar[str]
    quantize_activations: ClassVar[bool]

    def __init__(self, spec: QuantSpec, layer_name: str = "?"):
        self.spec = spec.resolved()
        self.layer_name = layer_name

    def process(self, experts: nn.Module) -> None:
        for attr in ("w13", "w2"):
            w = getattr(experts, attr)
            E, N, K = w.shape
            q, scale = quantize_weight(w.detach().reshape(E * N, K), self.spec.weight)
            delattr(experts, attr)  # one copy: the float tensor is dropped
            experts.register_parameter(attr, nn.Parameter(q.reshape(E, N, K), requires_grad=False))
            experts.register_buffer(f"{attr}_scale", scale.reshape(E, N).float())

    def apply(self, experts: nn.Module, x, topk_weights, topk_ids) -> torch.Tensor:
        return ops.fused_moe_int8(
            x,
            topk_weights,
            topk_ids,
            experts.w13,
            experts.w13_scale,
            experts.w2,
            experts.w2_scale,
            self.quantize_activations,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec})"


class Int8ExpertsWeightOnly(ExpertScheme):
    """int8 per-channel expert weights, GEMMs in the model dtype."""

    name = "int8_weight_only"
    quantize_activations = False


class Int8ExpertsPerToken(ExpertScheme):
    """int8 per-channel expert weights x int8 activations quantized per token (W8A8)."""

    name = "int8_dynamic_per_token"
    quantize_activations = True


def expert_scheme_for(spec: QuantSpec, layer_name: str = "?") -> type[ExpertScheme]:
    w, a = spec.weight, spec.activation
    if w is not None and w.dtype == "int8" and w.scale == "static" and w.group == "per_channel":
        if spec.weight_only:
            return Int8ExpertsWeightOnly
        if a is not None and (a.dtype, a.scale, a.group) == ("int8", "dynamic", "per_token"):
            return Int8ExpertsPerToken
    raise ValueError(
        f"quantization of MoE experts {layer_name!r}: no expert scheme implements {spec}; "
        f"supported: int8 per-channel weights, weight-only or with dynamic per-token int8 "
        f"activations (int8_per_channel_weight_only, int8_per_token)"
    )


def expert_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` of every stacked-experts module (``moe_method`` + 3-D ``w13``)."""
    for name, module in model.named_modules():
        w13 = getattr(module, "w13", None)
        if hasattr(module, "moe_method") and isinstance(w13, torch.Tensor) and w13.dim() == 3:
            yield name, module


def expert_plan(model: nn.Module, quant_config: Any) -> list[tuple[str, nn.Module, Any]]:
    """``[(name, experts, scheme)]`` for every stacked-experts module the config's ``moe``
    selects (checked before any is touched)."""
    qc = QuantizationConfig.parse(quant_config)
    if qc is None:
        return []
    plan = []
    for name, experts in expert_modules(model):
        spec = qc.spec_for_experts(name)
        if spec is None:
            continue
        if experts.moe_method is not None:
            raise ValueError(f"quantize_model: experts {name!r} are already quantized")
        plan.append((name, experts, expert_scheme_for(spec, name)(spec, name)))
    return plan


def apply_expert_scheme(experts: nn.Module, scheme: Any) -> None:
    """Quantize one planned experts module (its weights loaded) and install its scheme."""
    scheme.process(experts)
    experts.moe_method = scheme


def quantize_plan(model: nn.Module, quant_config: Any) -> list[tuple[str, nn.Module, Any]]:
    """``[(layer name, layer, scheme)]`` for every linear layer the config selects, checked
    before any layer is touched (a selected layer without a matching scheme raises); the
    model's weights need not be loaded yet.  ``scheme.process(layer)`` then quantizes one."""
    qc = QuantizationConfig.parse(quant_config)
    if qc is None:
        return []
    plan = []
    for name, layer in linear_layers(model):
        spec = qc.spec_for(name)
        if spec is None:
            continue
        if layer.linear_method is not None:
            raise ValueError(
                f"quantize_model: layer {name!r} already has linear method "
                f"{layer.linear_method!r}; quantize a model only once"
            )
        plan.append((name, layer, scheme_for(spec, name)(spec, name)))
    return plan


def apply_scheme(layer: nn.Module, scheme: Any) -> None:
    """Quantize one planned layer (its weight loaded) and install its scheme."""
    scheme.process(layer)
    layer.linear_method = scheme


def quantize_model(model: nn.Module, quant_config: Any) -> dict[str, str]:
    """Quantize every linear layer (and MoE experts) the config selects, once; returns
    ``{layer: scheme}``.

    ``quant_config``: anything :meth:`QuantizationConfig.parse` accepts.  Raises before
    touching any layer when some selected layer has no matching scheme."""
    plan = quantize_plan(model, quant_config)
    experts = expert_plan(model, quant_config)
    for _, layer, scheme in plan:
        apply_scheme(layer, scheme)
    for _, module, scheme in experts:
        apply_expert_scheme(module, scheme)
    return {name: type(scheme).name for name, _, scheme in plan + experts}


@torch.no_grad()
def calibrate_activation_scales(model: nn.Module, run: Callable[[], Any]) -> dict[str, float]:
    """Set every static activation scale to the absmax its layer sees during ``run()``.

    A pre-hook raises each layer's scale before the layer runs, so no calibration input is
    clipped and later layers see (nearly) unquantized activations.  Returns ``{layer: scale}``."""
    handles = []
    statics: dict[str, nn.Module] = {}
    for name, layer in linear_layers(model):
        scheme = layer.linear_method
        if isinstance(scheme, ActivationQuantScheme) and scheme.spec.activation.scale == "static":
            statics[name] = layer
            qmax = quant_max(TORCH_DTYPES[scheme.spec.activation.dtype])
            layer.input_scale.zero_()
            scheme.calibrated = True

            def hook(module, args, qmax=qmax):
                seen = args[0].detach().abs().amax().float() / qmax
                module.input_scale.copy_(torch.maximum(module.input_scale, seen.reshape(1)))

            handles.append(layer.register_forward_pre_hook(hook))
    if not statics:
        return {}  # dynamic or weight-only schemes: nothing to calibrate, no forward to run
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    for layer in statics.values():
        layer.input_scale.clamp_(min=MIN_DYNAMIC_SCALE)
    return {name: float(layer.input_scale) for name, layer in statics.items()}
