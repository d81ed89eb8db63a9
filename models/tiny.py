"""Deterministic tiny Hugging Face checkpoints, generated on first use -- no network needed.

``ensure_tiny_model()`` returns a folder with config.json + model.safetensors written by
transformers' own classes (``save_pretrained``), so it is a genuine HF checkpoint.  Weights
come from a seeded generator in parameter-name order, so the same preset and seed give the
same bytes on every machine.  The folder lives in a cache (``$PIECEWISE_MODEL_CACHE`` or
``~/.cache/piecewise/models``) and is written to a temp dir and renamed into place, so
concurrent processes never see a half-written checkpoint.

Presets: ``default`` is the project's benchmark model (Llama-style, 8 layers, hidden 512);
``test-llama`` / ``test-mistral`` / ``test-qwen2`` / ``test-qwen3`` are 2-layer, hidden-64
models for tests, each exercising its family's traits (sliding window, qkv bias + tied
embeddings, q/k norm with head_dim != hidden / heads); ``test-qwen3_moe`` /
``test-qwen2_moe`` / ``test-mixtral`` are mixtures of experts (6 experts top-2, expert
intermediate 72, vocabulary 251; a dense layer among MoE ones, a gated shared expert and
sliding windows, a renormalised top-2 with a window).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

import torch

from framework.core import files
from models.family import architecture_for

RECIPE_VERSION = 1
"""Bump when the generation recipe changes so cached folders are regenerated."""

_TEST_SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    initializer_range=0.05,
)

# preset -> (family, HF config kwargs, dtype the weights are saved in)
PRESETS: dict[str, tuple[str, dict[str, Any], str]] = {
    "default": (
        "llama",
        dict(
            hidden_size=512,
            intermediate_size=1408,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=32000,
            max_position_embeddings=2048,
            initializer_range=0.02,
        ),
        "bfloat16",
    ),
    "test-llama": ("llama", dict(_TEST_SIZES), "float32"),
    "test-mistral": ("mistral", dict(_TEST_SIZES, sliding_window=16), "float32"),
    "test-qwen2": ("qwen2", dict(_TEST_SIZES, tie_word_embeddings=True), "float32"),
    "test-qwen3": ("qwen3", dict(_TEST_SIZES, head_dim=32), "float32"),
    # Mixtures of experts: 6 experts top-2, expert intermediate 72, an odd vocabulary.
    "test-qwen3_moe": (
        "qwen3_moe",
        dict(
            _TEST_SIZES,
            num_hidden_layers=3,
            vocab_size=251,
            head_dim=32,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=72,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
        "float32",
    ),
    "test-qwen2_moe": (
        "qwen2_moe",
        dict(
            _TEST_SIZES,
            vocab_size=251,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=72,
            shared_expert_intermediate_size=96,
            use_sliding_window=True,
            sliding_window=16,
            max_window_layers=2,
        ),
        "float32",
    ),
    # The MoE benchmark shape (experiments.bench.moe): Qwen3-MoE style, 16 experts top-2.
    "bench-qwen3_moe": (
        "qwen3_moe",
        dict(
            hidden_size=512,
            intermediate_size=1408,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            vocab_size=32000,
            max_position_embeddings=2048,
            initializer_range=0.02,
            num_experts=16,
            num_experts_per_tok=2,
            moe_intermediate_size=384,
            norm_topk_prob=True,
        ),
        "bfloat16",
    ),
    "test-mixtral": (
        "mixtral",
        dict(
            _TEST_SIZES,
            vocab_size=251,
            intermediate_size=72,
            num_local_experts=6,
            num_experts_per_tok=2,
            sliding_window=16,
        ),
        "float32",
    ),
}


def default_cache_root() -> Path:
    """``$PIECEWISE_MODEL_CACHE``, else ``models/`` under the one cache root."""
    env = os.environ.get("PIECEWISE_MODEL_CACHE")
    return Path(env) if env else files.default_cache_root() / "models"


def resolve_preset(
    preset: str = "default", arch: Optional[str] = None, **overrides: Any
) -> tuple[str, dict[str, Any], str]:
    """(family, HF config kwargs, save dtype) for a preset, family and overrides."""
    if preset not in PRESETS:
        raise ValueError(f"unknown tiny-model preset {preset!r}; presets are {sorted(PRESETS)}")
    family, kwargs, dtype = PRESETS[preset]
    family = arch or family
    try:
        architecture_for(family)
    except ValueError as e:
        raise ValueError(f"unknown tiny-model arch {family!r}: {e}") from None
    dtype = overrides.pop("dtype", dtype)
    return family, {**kwargs, **overrides}, dtype


def build_hf_model(
    family: str, config_kwargs: dict[str, Any], seed: int = 0, dtype: str = "float32"
):
    """A transformers ``*ForCausalLM`` with seeded weights (norm weights around 1, biases
    non-zero, so loading errors in any tensor show up in the logits)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **config_kwargs)
    config.architectures = [architecture_for(family)]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    std = float(config_kwargs.get("initializer_range", 0.02))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(std * noise)
    return model.to(getattr(torch, dtype)).eval()


def write_tiny_checkpoint(
    out_dir: Union[str, Path],
    preset: str = "test-llama",
    *,
    arch: Optional[str] = None,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Write a preset's HF checkpoint (config.json + model.safetensors) into ``out_dir``."""
    family, kwargs, dtype = resolve_preset(preset, arch, **overrides)
    out_dir = Path(out_dir)
    build_hf_model(family, kwargs, seed, dtype).save_pretrained(out_dir)
    return out_dir


def ensure_tiny_model(
    cache_root: Union[str, Path, None] = None,
    arch: Optional[str] = None,
    preset: str = "default",
    *,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Path of the cached checkpoint for (preset, arch, seed, overrides), generated on first use.

    ``arch`` picks the family ("llama", "mistral", "qwen2", "qwen3"; default: the preset's);
    ``overrides`` are HF config kwargs (e.g. ``num_hidden_layers=4``) or ``dtype``.
    """
    family, kwargs, dtype = resolve_preset(preset, arch, **overrides)
    recipe = json.dumps(
        dict(v=RECIPE_VERSION, family=family, config=kwargs, dtype=dtype, seed=seed), sort_keys=True
    )
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:10]
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    final = root / f"{preset}-{family}-{digest}"
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        build_hf_model(family, kwargs, seed, dtype).save_pretrained(tmp)
        (tmp / "piecewise_recipe.json").write_text(recipe)
        # one rename; False when another process got there first (its folder is kept)
        if not files.publish_dir(tmp, final) and not (final / "config.json").is_file():
            raise FileExistsError(f"{final} exists without a config.json; remove it")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
