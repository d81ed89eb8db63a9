"""The run configuration of ``conf/`` (a composed Hydra config) as ``LLM`` arguments.

One mapping serves every entry point that builds an ``LLM`` from ``conf/config.yaml`` and
key=value overrides -- the Hydra jobs (``experiments.run.job``) and the OpenAI-compatible server
(``python -m framework.serve``) -- so a configuration from an ablation is served unchanged:

    cc = compilation_config(cfg)          # compile.*, passes, toggle_passes, cache_dir
    llm = LLM(model_dir, **llm_kwargs(cfg, cc))   # dtype, quantization, engine.*, parallel.*

It also registers the strict config dataclasses with Hydra's ConfigStore
(:func:`register_compile_schema`): Hydra is the front end of the runs and the server, so its
registration lives here and not beside the dataclasses (``framework.core`` imports no Hydra,
and nothing in the engine imports this module: the engine runs where Hydra is absent).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from framework.core.config import CompilationConfig
from framework.engine.pass_cli import apply_short, toggle_passes
from framework.engine.spec.config import SpeculativeConfig, speculative_config_of

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


def register_compile_schema() -> None:
    """:class:`~framework.core.config.CompilationConfig` as the schema of the ``compile``
    group (conf/compile/*.yaml are validated against it), and
    :class:`~framework.engine.spec.config.SpeculativeConfig` as the ``speculative`` group's
    (conf/speculative/*.yaml).  (No ``passes`` group: ``passes`` is the top-level short pass
    list of conf/config.yaml, framework/engine/pass_cli.py.)"""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="compile", name="compile_schema", node=CompilationConfig)
    # conf/speculative/ngram.yaml, draft_model.yaml are validated against SpeculativeConfig.
    ConfigStore.instance().store(
        group="speculative", name="speculative_schema", node=SpeculativeConfig
    )


def register_quantization_schema() -> None:
    """:class:`~framework.core.quantization.QuantizationConfig` as a ``quantization`` group.
    The runs do not call it: a config *group* named ``quantization`` makes Hydra treat the
    top-level ``quantization`` value of conf/config.yaml as a group and reject
    ``quantization=int8_per_token`` ("Could not override 'quantization'. No match in the
    defaults list").  Values are checked by ``QuantizationConfig.parse`` when the LLM is
    built; the schema is there for a config that wants a typed node."""
    from hydra.core.config_store import ConfigStore

    from framework.core.quantization import QuantizationConfig

    ConfigStore.instance().store(
        group="quantization", name="quantization_schema", node=QuantizationConfig
    )


def int_setting(cfg: DictConfig, key: str, default: Any = None) -> Any:
    """The int at dotted ``key`` (``None`` stays ``None``), or a ``ValueError`` naming the key:
    ``max_num_seqs=abc`` says ``max_num_seqs: must be an int, got 'abc'``."""
    value = OmegaConf.select(cfg, key, default=default)
    if value is None:
        return None
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}: must be an int, got {value!r}")
    return value


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
        max_num_seqs=int_setting(cfg, "max_num_seqs"),
        max_model_len=int_setting(cfg, "max_model_len"),
        max_num_batched_tokens=int_setting(cfg, "max_num_batched_tokens"),
        seed=int_setting(cfg, "seed"),
        enable_prefix_caching=bool(engine.get("enable_prefix_caching", False)),
        block_size=int_setting(cfg, "engine.block_size", 16),
        kv_cache_memory_bytes=None if kv_bytes is None else int(kv_bytes),
        tensor_parallel_size=int_setting(cfg, "parallel.tensor_parallel_size", 1),
        speculative_config=speculative_config(cfg),
    )


def speculative_config(cfg: DictConfig) -> Optional[SpeculativeConfig]:
    """``cfg.speculative`` (the ``speculative`` group) as a config; None when off
    (``speculative=none``, or no such key)."""
    spec = cfg.get("speculative")
    if spec is None:
        return None
    data = OmegaConf.to_container(spec, resolve=True) if OmegaConf.is_config(spec) else spec
    return speculative_config_of(data)
