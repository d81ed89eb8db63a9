"""Architecture name (config.json ``architectures[0]``) -> model class, and ``load_model``.

Model files register themselves with ``@register_model("LlamaForCausalLM", ...)``.  The
registry imports the family modules lazily (see ``_FAMILY_MODULES``) so importing it is cheap
and free of cycles.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Union

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from models.config import ModelConfig

_MODELS: dict[str, type[nn.Module]] = {}

# Modules whose import fills the registry; a new family file is added here once.
_FAMILY_MODULES = ("models.decoder",)


def register_model(*architectures: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    def deco(cls: type[nn.Module]) -> type[nn.Module]:
        for arch in architectures:
            if arch in _MODELS and _MODELS[arch] is not cls:
                raise ValueError(f"architecture {arch!r} is already registered by "
                                 f"{_MODELS[arch].__qualname__}")
            _MODELS[arch] = cls
        return cls
    return deco


def _ensure_families_imported() -> None:
    for mod in _FAMILY_MODULES:
        importlib.import_module(mod)


def supported_architectures() -> list[str]:
    _ensure_families_imported()
    return sorted(_MODELS)


def get_model_class(architecture: str, source: str = "config.json") -> type[nn.Module]:
    _ensure_families_imported()
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(f"{source}: architecture {architecture!r} is not supported; "
                         f"supported architectures are {sorted(_MODELS)}") from None


def load_model(model_dir: Union[str, Path], dtype: Union[torch.dtype, str] = torch.float32,
               device: Union[str, torch.device] = "cpu") -> tuple[nn.Module, "ModelConfig"]:
    """Build the model of a Hugging Face folder on the meta device, materialize it on
    ``device`` and load its safetensors weights cast to ``dtype``.

    Returns ``(model, config)``; the model is in eval mode with gradients off.
    """
    from models.config import ModelConfig, dtype_name, hf_architecture, read_hf_config
    from models.loader import load_weights

    model_dir = Path(model_dir)
    raw = read_hf_config(model_dir)
    source = str(model_dir / "config.json")
    cls = get_model_class(hf_architecture(raw, source), source)
    config = ModelConfig.from_hf_dict(raw, source=source, dtype=dtype_name(dtype))
    with torch.device("meta"):
        model = cls(config)
    model.to_empty(device=device)
    model.init_non_persistent_state()
    load_weights(model, model_dir)
    model.requires_grad_(False)
    model.eval()
    return model, config
