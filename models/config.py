"""``ModelConfig``: the architecture facts a decoder needs, mapped from a Hugging Face config.json.

One strict dataclass for every supported family; family differences (qkv bias, q/k norm,
sliding windows) are plain fields, so the model file has no per-family branches.  Both config
spellings are read: transformers < 5 (``rope_theta`` + ``rope_scaling`` with ``type`` or
``rope_type``) and transformers >= 5 (``rope_parameters`` holding ``rope_theta`` too).
The config enters the compile-cache key through :meth:`compute_hash`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch

from framework.core.config_base import StrictConfig
from models.family import family_traits
from models.rotary import check_rope_scaling

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(value: Union[str, torch.dtype]) -> torch.dtype:
    """``"bfloat16"``/``"bf16"``/``torch.bfloat16`` -> ``torch.bfloat16`` (float types only)."""
    if isinstance(value, torch.dtype):
        if value not in _DTYPES.values():
            raise ValueError(f"dtype {value} is not supported; use float32, bfloat16 or float16")
        return value
    key = str(value).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype {value!r} is not supported; use one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def dtype_name(dtype: Union[str, torch.dtype]) -> str:
    return str(parse_dtype(dtype)).removeprefix("torch.")


@dataclass
class ModelConfig(StrictConfig):
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    """None for plain RoPE, else a dict with ``rope_type`` ("linear", "llama3") and its keys."""
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Bias on the q/k/v projections (always on for Qwen2)."""
    o_proj_bias: bool = False
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before RoPE (Qwen3)."""
    sliding_window: Optional[int] = None
    layer_types: Optional[list] = None
    """Per layer "full_attention" / "sliding_attention"; None: every layer uses sliding_window."""
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[Union[int, list]] = None
    dtype: str = "float32"
    # -- mixture of experts (num_experts == 0: a dense model) ------------------------------
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    """Intermediate size of one routed expert."""
    norm_topk_prob: bool = False
    """Renormalise the top-k router probabilities to sum to 1."""
    shared_expert_intermediate_size: int = 0
    """0: no shared expert; else a dense expert every token takes, scaled by a sigmoid gate."""
    decoder_sparse_step: int = 1
    """Layer ``i`` is MoE when ``(i + 1) % decoder_sparse_step == 0`` and it is not listed in
    ``mlp_only_layers``."""
    mlp_only_layers: Optional[list] = None

    def validate(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name}: must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_kv_heads: {self.num_kv_heads} must divide "
                f"num_heads={self.num_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim: must be even for RoPE, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(
                f"ModelConfig.sliding_window: must be positive or null, got {self.sliding_window}"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"ModelConfig.layer_types: has {len(self.layer_types)} entries "
                    f"for num_layers={self.num_layers}"
                )
            bad = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
            if bad:
                raise ValueError(f"ModelConfig.layer_types: unsupported layer type(s) {bad}")
        check_rope_scaling(self.rope_scaling, "ModelConfig.rope_scaling")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        self._validate_moe()

    def _validate_moe(self) -> None:
        for name in (
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"ModelConfig.{name}: must be a non-negative integer, got {value!r}"
                )
        if not self.num_experts:
            return
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"ModelConfig.num_experts_per_tok: must be in [1, num_experts={self.num_experts}], "
                f"got {self.num_experts_per_tok}"
            )
        if self.moe_intermediate_size <= 0:
            raise ValueError("ModelConfig.moe_intermediate_size: must be positive for a MoE model")
        if self.decoder_sparse_step <= 0:
            raise ValueError(
                f"ModelConfig.decoder_sparse_step: must be positive, got {self.decoder_sparse_step}"
            )
        bad = [i for i in self.mlp_only_layers or [] if not 0 <= int(i) < self.num_layers]
        if bad:
            raise ValueError(
                f"ModelConfig.mlp_only_layers: layer(s) {bad} outside [0, {self.num_layers})"
            )

    # -- derived facts ---------------------------------------------------------------------
    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return (
            list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]
        )

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx``'s MLP is a mixture of experts (else a dense MLP)."""
        return (
            self.num_experts > 0
            and layer_idx not in (self.mlp_only_layers or [])
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    def layer_sliding_window(self, layer_idx: int) -> int:
        """The attention window of one layer in tokens; -1 for full attention."""
        if self.sliding_window is None:
            return -1
        if self.layer_types is not None and self.layer_types[layer_idx] != "sliding_attention":
            return -1
        return self.sliding_window

    # -- Hugging Face mapping --------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: Union[str, Path], **overrides: Any) -> "ModelConfig":
        return cls.from_hf_dict(
            read_hf_config(path), source=str(Path(path) / "config.json"), **overrides
        )

    @classmethod
    def from_hf_dict(
        cls, d: Mapping[str, Any], source: str = "config.json", **overrides: Any
    ) -> "ModelConfig":
        """Map a Hugging Face config dict; ``overrides`` replace mapped fields (e.g. dtype)."""
        arch = hf_architecture(d, source)
        traits = family_traits(arch, source)

        def need(key: str) -> Any:
            if d.get(key) is None:
                raise ValueError(f"{source}: missing field {key!r} (needed for {arch})")
            return d[key]

        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        if d.get("mlp_bias"):
            raise ValueError(f"{source}: mlp_bias=true is not supported")

        num_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        num_layers = int(need("num_hidden_layers"))
        theta, scaling, rope_field = _hf_rope(d, source)
        attn_bias = bool(d.get("attention_bias", False))
        sliding_window, layer_types = _hf_sliding_window(d, traits.sliding, num_layers)
        fields = dict(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attn_bias if traits.qkv_bias is None else traits.qkv_bias,
            o_proj_bias=attn_bias if traits.o_bias is None else traits.o_bias,
            qk_norm=traits.qk_norm,
            sliding_window=sliding_window,
            layer_types=layer_types,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            dtype=_hf_dtype(d),
        )
        fields.update(_hf_moe(d, traits, source))
        fields.update(overrides)
        try:
            check_rope_scaling(scaling, rope_field)
            return cls.from_dict(fields)
        except ValueError as e:
            msg = str(e)
            raise ValueError(msg if msg.startswith(source) else f"{source}: {msg}") from None


def read_hf_config(path: Union[str, Path]) -> dict[str, Any]:
    """config.json of a checkpoint folder as a dict; one clear error if missing or unreadable."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(
            f"{file}: not found; a model folder needs a Hugging Face config.json "
            f"next to its safetensors weights"
        )
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{file}: cannot read config.json ({e}); re-download or re-export the checkpoint"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def hf_architecture(d: Mapping[str, Any], source: str = "config.json") -> str:
    archs = d.get("architectures")
    if not archs or not isinstance(archs, list):
        raise ValueError(
            f"{source}: field 'architectures' is missing or empty; expected e.g. "
            f'["LlamaForCausalLM"]'
        )
    return str(archs[0])


def _hf_rope(d: Mapping[str, Any], source: str) -> tuple[float, Optional[dict], str]:
    """(theta, scaling dict or None, name of the field it came from)."""
    if isinstance(d.get("rope_parameters"), Mapping):
        field, params = "rope_parameters", dict(d["rope_parameters"])
    elif isinstance(d.get("rope_scaling"), Mapping):
        field, params = "rope_scaling", dict(d["rope_scaling"])
    else:
        field, params = "rope_scaling", {}
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return theta, None, field
    params = {"rope_type": rope_type, **params}
    return theta, params, field


def _hf_sliding_window(
    d: Mapping[str, Any], kind: Optional[str], num_layers: int
) -> tuple[Optional[int], Optional[list]]:
    window = d.get("sliding_window")
    if kind is None or window is None:
        return None, None
    if kind == "all":
        return int(window), None
    if not d.get("use_sliding_window", False):
        return None, None
    if kind == "flag":  # one window for every layer, only with use_sliding_window
        return int(window), None
    layer_types = d.get("layer_types")
    if layer_types is None and kind == "qwen2_moe":  # transformers' Qwen2MoeConfig default
        last = int(d.get("max_window_layers", num_layers))
        layer_types = [
            "sliding_attention" if (i + 1) % 2 and i < last else "full_attention"
            for i in range(num_layers)
        ]
    if layer_types is None:
        first = int(d.get("max_window_layers", num_layers))
        layer_types = [
            "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
        ]
    return int(window), list(layer_types)


def _hf_moe(d: Mapping[str, Any], traits: Any, source: str) -> dict[str, Any]:
    """MoE fields of a config dict ({} for a dense family).  Expert counts are spelled
    ``num_experts`` (Qwen2-MoE) or ``num_local_experts`` (Mixtral, Qwen3-MoE as saved)."""
    if traits.moe is None:
        return {}
    experts = d.get("num_experts") or d.get("num_local_experts")
    if not experts:
        raise ValueError(f"{source}: missing field 'num_experts' / 'num_local_experts'")
    if d.get("num_experts_per_tok") is None:
        raise ValueError(f"{source}: missing field 'num_experts_per_tok'")
    if traits.moe == "mixtral":  # every layer MoE, experts of intermediate_size, renormalised
        return dict(
            num_experts=int(experts),
            num_experts_per_tok=int(d["num_experts_per_tok"]),
            moe_intermediate_size=int(d["intermediate_size"]),
            norm_topk_prob=True,
        )
    if d.get("moe_intermediate_size") is None:
        raise ValueError(f"{source}: missing field 'moe_intermediate_size'")
    shared = int(d.get("shared_expert_intermediate_size") or 0) if traits.moe == "qwen2_moe" else 0
    return dict(
        num_experts=int(experts),
        num_experts_per_tok=int(d["num_experts_per_tok"]),
        moe_intermediate_size=int(d["moe_intermediate_size"]),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=shared,
        decoder_sparse_step=int(d.get("decoder_sparse_step") or 1),
        mlp_only_layers=[int(i) for i in d.get("mlp_only_layers") or []] or None,
    )


def _hf_dtype(d: Mapping[str, Any]) -> str:
    value = d.get("dtype") or d.get("torch_dtype") or "float32"
    try:
        return dtype_name(value)
    except ValueError:
        return "float32"  # an exotic checkpoint dtype is reported per tensor by the loader
