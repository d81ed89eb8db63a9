"""Builders of tiny Hugging Face checkpoints for tests (fp32, seeded), and helpers that derive
broken checkpoints from a good one.  The generation recipe itself lives in ``models.tiny`` so
library code (the default model of ``make run``) never imports tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors.torch import load_file, save_file

from models.tiny import write_tiny_checkpoint

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
"""Dense families."""
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
"""Mixture-of-experts families."""


def build_family_checkpoint(out_dir: Path, family: str, seed: int = 0, **overrides: Any) -> Path:
    """The ``test-<family>`` preset (2 layers, hidden 64, vocab 256) written to ``out_dir``."""
    return write_tiny_checkpoint(out_dir, f"test-{family}", seed=seed, **overrides)


def build_sharded_checkpoint(out_dir: Path, family: str, max_shard_size: str = "100KB") -> Path:
    """Same weights as :func:`build_family_checkpoint`, saved as several shards + index."""
    from models.tiny import build_hf_model, resolve_preset

    fam, kwargs, dtype = resolve_preset(f"test-{family}")
    build_hf_model(fam, kwargs, 0, dtype).save_pretrained(out_dir, max_shard_size=max_shard_size)
    return Path(out_dir)


def derive_checkpoint(
    src: Path,
    dst: Path,
    edit_tensors: Optional[Callable[[dict[str, torch.Tensor]], None]] = None,
    edit_config: Optional[Callable[[dict], None]] = None,
) -> Path:
    """Copy a single-file checkpoint, editing its tensors dict and/or config dict in place."""
    dst = Path(dst)
    shutil.copytree(src, dst)
    if edit_tensors is not None:
        tensors = load_file(str(dst / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if edit_config is not None:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst
