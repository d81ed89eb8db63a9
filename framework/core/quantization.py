"""Quantization config: which linear layers are quantized, and how.

Leaf module (imports only :mod:`framework.core.config_base`); the quantization *pass* that applies
it lives in :mod:`passes.quant_schemes`.

Vocabulary::

    QuantKey(dtype, scale, group, group_size=None, symmetric=True)   one tensor's quantization
    QuantSpec(weight, activation, weight_only=False)                  one linear layer's
    QuantizationConfig(linear, moe, ignore, targets)                  the whole model

``None`` in a :class:`QuantSpec` means "the method's default", never "off": a spec with only an
int8 activation key gets the default int8 weight key (static per-channel), and vice versa
(see :data:`DEFAULT_WEIGHT_KEY`, :data:`DEFAULT_ACTIVATION_KEY`).  Unquantized activations are
said explicitly with ``weight_only=True``.

A spec is written as a shorthand name (:data:`SHORTHANDS`), a mapping of spec fields, or a
mapping with ``shorthand`` plus fields that override the shorthand *field by field*::

    linear: int8_per_token
    linear: {shorthand: int8_per_token, activation: {scale: static, group: per_tensor}}
    linear: {weight: {dtype: int8, scale: static, group: per_channel}}

Overriding a field the shorthand does not have (e.g. ``activation`` of a weight-only
shorthand) is a ``ValueError`` naming the field.  Layers: ``linear`` applies to every linear
layer except ``ignore`` (fnmatch patterns) and the output head / embeddings (``lm_head``,
``*embed*``), which stay unquantized unless ``targets`` names them exactly.  ``targets`` maps
layer names -- exact, ``re:<regex>`` (``re.fullmatch``) or fnmatch patterns -- to specs (or
``None``: unquantized); it is exclusive with ``linear``/``moe``.  Lookup order: ignore, exact
target, regex targets, fnmatch targets (each in insertion order).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from framework.core.config_base import StrictConfig

DTYPES = ("int8", "fp8_e4m3")
SCALES = ("static", "dynamic")
GROUPS = ("per_tensor", "per_token", "per_channel", "per_group")
DEFAULT_UNQUANTIZED = ("lm_head", "*.lm_head", "*embed*")
"""Layer names left unquantized unless a ``targets`` entry names them exactly."""


def _check_key_fields(values: Mapping[str, Any], where: str) -> None:
    """Validate QuantKey field values; messages name ``<where>.<field>``."""
    checks = (("dtype", DTYPES), ("scale", SCALES), ("group", GROUPS))
    for name, allowed in checks:
        if values.get(name) not in allowed:
            raise ValueError(
                f"{where}.{name}: must be one of {list(allowed)}, got {values.get(name)!r}"
            )
    size = values.get("group_size")
    if values["group"] == "per_group":
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(
                f"{where}.group_size: per_group needs a positive int group_size, got {size!r}"
            )
    elif size is not None:
        raise ValueError(
            f"{where}.group_size: only valid with group=per_group (group is {values['group']!r})"
        )
    if not isinstance(values.get("symmetric", True), bool):
        raise ValueError(
            f"{where}.symmetric: must be true or false, got {values.get('symmetric')!r}"
        )


@dataclass(frozen=True)
class QuantKey(StrictConfig):
    """How one tensor is quantized."""

    dtype: str
    """``int8`` or ``fp8_e4m3``."""
    scale: str
    """``static`` (fixed at load/calibration) or ``dynamic`` (computed per call)."""
    group: str
    """``per_tensor``, ``per_token`` (activations), ``per_channel`` (weights) or
    ``per_group``."""
    group_size: Optional[int] = None
    """Elements per group; only (and required) for ``per_group``."""
    symmetric: bool = True
    """Zero point fixed at 0."""

    def validate(self) -> None:
        _check_key_fields(dataclasses.asdict(self), "QuantKey")

    def __str__(self) -> str:
        group = f"per_group({self.group_size})" if self.group == "per_group" else self.group
        return f"{self.dtype}/{self.scale}/{group}" + ("" if self.symmetric else "/asym")


DEFAULT_WEIGHT_KEY = {d: QuantKey(d, "static", "per_channel") for d in DTYPES}
"""The weight key a spec gets when only its activation key is given (by activation dtype)."""
DEFAULT_ACTIVATION_KEY = {d: QuantKey(d, "dynamic", "per_token") for d in DTYPES}
"""The activation key a spec gets when only its weight key is given (by weight dtype)."""


@dataclass(frozen=True)
class QuantSpec(StrictConfig):
    """How one linear layer is quantized; ``None`` keys take the method's default."""

    weight: Optional[QuantKey] = None
    activation: Optional[QuantKey] = None
    weight_only: bool = False
    """Activations stay in the model dtype (``activation`` must then be ``None``)."""

    def validate(self) -> None:
        check_spec(self.weight, self.activation, self.weight_only, "QuantSpec")

    def resolved(self) -> "QuantSpec":
        """A copy with defaults filled: ``weight`` always set, ``activation`` unless
        weight-only."""
        weight = self.weight or DEFAULT_WEIGHT_KEY[self.activation.dtype]
        if self.weight_only:
            return QuantSpec(weight, None, True)
        return QuantSpec(weight, self.activation or DEFAULT_ACTIVATION_KEY[weight.dtype], False)

    def __str__(self) -> str:
        act = "none" if self.weight_only else (self.activation or "default")
        return f"weight={self.weight or 'default'}, activation={act}"


def check_spec(
    weight: QuantKey | None, activation: QuantKey | None, weight_only: bool, where: str
) -> None:
    """Cross-field rules of a spec; messages name ``<where>.<field>``."""
    if weight is None and activation is None:
        raise ValueError(
            f"{where}: a spec needs a weight or an activation key (write the "
            f"layer into `ignore`, or map it to null in `targets`, to leave it "
            f"unquantized)"
        )
    if weight_only and activation is not None:
        raise ValueError(f"{where}.activation: must be null when weight_only is true")
    if weight_only and weight is None:
        raise ValueError(f"{where}.weight: a weight-only spec needs a weight key")
    if weight is not None and weight.group == "per_token":
        raise ValueError(
            f"{where}.weight.group: weights have no tokens; use per_channel, "
            f"per_tensor or per_group"
        )
    if weight is not None and weight.scale == "dynamic":
        raise ValueError(
            f"{where}.weight.scale: weights are quantized once, so their scale is static"
        )
    if activation is not None and activation.group == "per_channel":
        raise ValueError(
            f"{where}.activation.group: activations are quantized per_tensor, "
            f"per_token or per_group, not per_channel"
        )


def _key(dtype: str, scale: str, group: str) -> QuantKey:
    return QuantKey(dtype, scale, group)


SHORTHANDS: dict[str, QuantSpec] = {
    "int8_per_token": QuantSpec(
        _key("int8", "static", "per_channel"), _key("int8", "dynamic", "per_token")
    ),
    "int8_per_channel_weight_only": QuantSpec(
        _key("int8", "static", "per_channel"), None, weight_only=True
    ),
    "fp8_per_tensor": QuantSpec(
        _key("fp8_e4m3", "static", "per_tensor"), _key("fp8_e4m3", "static", "per_tensor")
    ),
    "fp8_per_token": QuantSpec(
        _key("fp8_e4m3", "static", "per_channel"), _key("fp8_e4m3", "dynamic", "per_token")
    ),
}
"""Named specs.  ``fp8_per_tensor`` uses a static activation scale: calibrate it
(:func:`passes.quant_schemes.calibrate_activation_scales`) before running."""


def _parse_key(
    value: Any, where: str, base: QuantKey | None = None, shorthand: str | None = None
) -> QuantKey | None:
    if value is None or isinstance(value, QuantKey):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: expected a mapping of QuantKey fields, got {value!r}")
    names = QuantKey.field_names()
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; valid fields are {names}")
    if base is None and shorthand is not None:
        raise ValueError(
            f"{where}: shorthand {shorthand!r} has no {where.rsplit('.', 1)[-1]} "
            f"quantization to override; spell the whole spec without the "
            f"shorthand instead"
        )
    merged = (
        dataclasses.asdict(base) if base is not None else {"group_size": None, "symmetric": True}
    )
    merged.update(value)
    if (
        base is not None
        and "group" in value
        and value["group"] != "per_group"
        and "group_size" not in value
    ):
        merged["group_size"] = None  # a shorthand's group size belongs to its own grouping
    missing = [n for n in ("dtype", "scale", "group") if merged.get(n) is None]
    if missing:
        raise ValueError(f"{where}.{missing[0]}: required (missing field(s) {missing})")
    _check_key_fields(merged, where)
    return QuantKey(**merged)


def parse_spec(value: Any, where: str) -> QuantSpec | None:
    """A spec from a shorthand name, a mapping (optionally with ``shorthand``), or a spec."""
    if value is None or isinstance(value, QuantSpec):
        return value
    if isinstance(value, str):
        value = {"shorthand": value}
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: expected a shorthand name or a mapping, got {value!r}")
    allowed = ["shorthand", *QuantSpec.field_names()]
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; valid fields are {allowed}")
    shorthand = value.get("shorthand")
    if shorthand is not None:
        if shorthand not in SHORTHANDS:
            raise ValueError(
                f"{where}.shorthand: unknown shorthand {shorthand!r}; known: {sorted(SHORTHANDS)}"
            )
        base = SHORTHANDS[shorthand]
        base_weight, base_activation, base_weight_only = (
            base.weight,
            base.activation,
            base.weight_only,
        )
    else:
        base_weight, base_activation, base_weight_only = None, None, False
    weight_only = value.get("weight_only", base_weight_only)
    if not isinstance(weight_only, bool):
        raise ValueError(f"{where}.weight_only: must be true or false, got {weight_only!r}")
    weight = (
        _parse_key(value["weight"], f"{where}.weight", base_weight, shorthand)
        if "weight" in value
        else base_weight
    )
    if "activation" in value:
        activation = _parse_key(
            value["activation"], f"{where}.activation", base_activation, shorthand
        )
    else:
        activation = None if weight_only else base_activation
    check_spec(weight, activation, weight_only, where)
    return QuantSpec(weight, activation, weight_only)


@dataclass
class QuantizationConfig(StrictConfig):
    """Which layers are quantized and how; part of the compile cache key."""

    linear: Optional[Any] = None
    """Spec for every linear layer (shorthand name, mapping, or QuantSpec)."""
    moe: Optional[Any] = None
    """Spec for the routed experts of MoE layers (``linear`` does not reach them; the router
    and the shared expert are linear layers).  CPU schemes: ``int8_per_channel_weight_only``
    and ``int8_per_token``."""
    ignore: list[str] = field(default_factory=list)
    """Layer names or fnmatch patterns left unquantized."""
    targets: dict[str, Any] = field(default_factory=dict)
    """Per-layer specs by exact name, ``re:<regex>`` or fnmatch pattern; ``None`` value:
    unquantized.  Exclusive with ``linear``/``moe``."""

    def validate(self) -> None:
        if self.targets and (self.linear is not None or self.moe is not None):
            raise ValueError(
                "QuantizationConfig.targets: cannot be combined with `linear`/`moe`"
                "; put the default spec into targets (e.g. '*': int8_per_token) or "
                "drop targets"
            )
        if not isinstance(self.ignore, list) or not all(isinstance(p, str) for p in self.ignore):
            raise ValueError(
                f"QuantizationConfig.ignore: must be a list of layer names or "
                f"fnmatch patterns, got {self.ignore!r}"
            )
        # Normalise to specs in place so the hash and to_dict see one canonical form.
        object.__setattr__(self, "linear", parse_spec(self.linear, "QuantizationConfig.linear"))
        object.__setattr__(self, "moe", parse_spec(self.moe, "QuantizationConfig.moe"))
        if not isinstance(self.targets, Mapping):
            raise ValueError(
                f"QuantizationConfig.targets: must be a mapping of layer pattern to "
                f"spec, got {self.targets!r}"
            )
        targets, regexes = {}, []
        for pattern, spec in self.targets.items():
            where = f"QuantizationConfig.targets[{pattern!r}]"
            if not isinstance(pattern, str) or not pattern:
                raise ValueError(f"{where}: layer patterns must be non-empty strings")
            targets[pattern] = parse_spec(spec, where)
            if pattern.startswith("re:"):
                try:
                    regexes.append((re.compile(pattern[3:]), pattern))
                except re.error as e:
                    raise ValueError(f"{where}: regex does not compile: {e}") from None
        object.__setattr__(self, "targets", targets)
        self._regexes = regexes

    @property
    def enabled(self) -> bool:
        return self.linear is not None or self.moe is not None or bool(self.targets)

    def spec_for(self, layer_name: str) -> QuantSpec | None:
        """The resolved spec of one linear layer, or ``None`` when it stays unquantized."""
        if any(fnmatch.fnmatchcase(layer_name, p) for p in self.ignore):
            return None
        if self.targets:
            spec = self._match_target(layer_name)
        elif any(fnmatch.fnmatchcase(layer_name, p) for p in DEFAULT_UNQUANTIZED):
            spec = None
        else:
            spec = self.linear
        return spec.resolved() if spec is not None else None

    def spec_for_experts(self, module_name: str) -> QuantSpec | None:
        """The resolved spec of one MoE layer's stacked experts (``ignore`` applies; with
        ``targets``, the module's name is looked up like a layer's)."""
        if any(fnmatch.fnmatchcase(module_name, p) for p in self.ignore):
            return None
        spec = self._match_target(module_name) if self.targets else self.moe
        return spec.resolved() if spec is not None else None

    def _match_target(self, name: str) -> QuantSpec | None:
        if name in self.targets:
            return self.targets[name]
        if any(fnmatch.fnmatchcase(name, p) for p in DEFAULT_UNQUANTIZED):
            return None
        for regex, pattern in self._regexes:
            if regex.fullmatch(name):
                return self.targets[pattern]
        for pattern, spec in self.targets.items():
            if not pattern.startswith("re:") and fnmatch.fnmatchcase(name, pattern):
                return spec
        return None

    @classmethod
    def parse(cls, value: Any) -> "QuantizationConfig | None":
        """``None`` -> ``None`` (no quantization); a shorthand name -> ``linear=<name>``;
        a mapping (e.g. a Hydra node) -> fields; a QuantizationConfig -> itself."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(linear=value)
        if isinstance(value, Mapping):
            return cls.from_dict(_to_plain(value))
        raise ValueError(
            f"quantization: expected None, a shorthand name {sorted(SHORTHANDS)}, "
            f"a mapping or a QuantizationConfig, got {type(value).__name__}"
        )


def _to_plain(value: Any) -> Any:
    """OmegaConf containers -> dicts/lists (without importing omegaconf here)."""
    if hasattr(value, "items"):
        return {str(k): _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return [_to_plain(v) for v in value]
    return value
