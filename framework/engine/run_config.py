"""The run configuration of ``conf/`` (a composed Hydra config) as ``LLM`` arguments.

One mapping serves every entry point that builds an ``LLM`` from ``conf/config.yaml`` and
key=value overrides -- the Hydra jobs (``experiments.run``) and the OpenAI-compatible server
(``python -m framework.serve``) -- so a configuration from an ablation is served unchanged:

    cc = compilation_config(cfg)          # compile.*, passes, toggle_passes, cache_dir
    llm = LLM(model_dir, **llm_kwargs(cfg, cc))   # dtype, quantization, engine.*, parallel.*
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from framework.core.config import CompilationConfig
from framework.engine.pass_cli import apply_short
from passes.registry import level_passes

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
"""The Hydra config tree (``conf/config.yaml`` and its groups)."""


def compilation_config(cfg: DictConfig) -> CompilationConfig:
    """``cfg.compile`` with ``cache_dir``, the short pass list ``passes`` and the
    ``toggle_passes`` flips applied."""
    data = OmegaConf.to_container(cfg.compile, resolve=True, enum_to_str=True)
    if cfg.get("cache_dir") is not None:
        data["cache_dir"] = str(cfg.cache_dir)
    short = cfg.get("passes")
    if short is not None:
        short = OmegaConf.to_container(short) if OmegaConf.is_config(short) else short
        data["pass_config"] = apply_short(short, dict(data.get("pass_config") or {}))
    toggles = cfg.get("toggle_passes")
    if toggles:
        data["pass_config"] = toggle_passes(
            data.get("pass_config") or {},
            list(toggles),
            level=2 if data.get("level") is None else int(data["level"]),
            device_type=str(cfg.get("device") or "cpu"),
        )
    return CompilationConfig.from_dict(data)


def toggle_passes(pass_config: dict, names: list[str], level: int, device_type: str) -> dict:
    """``pass_config`` with each of ``names`` flipped against the level's default pass list on
    ``device_type`` (or the explicit ``passes`` list): a pass that would run goes to
    ``disable``, one that would not goes to ``enable``. ``toggle_passes=[x]`` is how
    conf/experiment/ablate_passes.yaml switches one pass on/off against O2 on any device,
    though O2's list differs between CPU and CUDA (``levels`` of ``@register_pass``)."""
    runs = pass_config.get("passes")
    runs = set(level_passes(level, device_type) if runs is None else runs)
    out = dict(pass_config)
    out["disable"] = list(out.get("disable") or []) + [n for n in names if n in runs]
    out["enable"] = list(out.get("enable") or []) + [n for n in names if n not in runs]
    return out


def llm_kwargs(cfg: DictConfig, cc: CompilationConfig) -> dict[str, Any]:
    """The keyword arguments of ``LLM(model_dir, **kwargs)`` for a composed run config."""
    quant = cfg.quantization
    if isinstance(quant, DictConfig):
        quant = OmegaConf.to_container(quant, resolve=True)
    engine = cfg.get("engine") or {}
    kv_bytes = engine.get("kv_cache_memory_bytes")
    return dict(
        dtype=cfg.dtype,
        compilation_config=cc,
        quantization=quant,
        max_num_seqs=int(cfg.max_num_seqs),
        max_model_len=int(cfg.max_model_len),
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        seed=int(cfg.seed),
        enable_prefix_caching=bool(engine.get("enable_prefix_caching", False)),
        block_size=int(engine.get("block_size", 16)),
        kv_cache_memory_bytes=None if kv_bytes is None else int(kv_bytes),
        tensor_parallel_size=int((cfg.get("parallel") or {}).get("tensor_parallel_size", 1)),
    )
