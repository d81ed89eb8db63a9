"""The model-family contract: what the engine needs from a model, the traits an architecture
declares, and the registry that maps config.json's ``architectures[0]`` to both.

A family file registers its class once per architecture it serves, with that
architecture's traits::

    @register_model("Qwen2ForCausalLM", FamilyTraits("qwen2", qkv_bias=True, o_bias=False,
                                                     sliding="qwen"))
    class DecoderForCausalLM(nn.Module): ...

Installed packages add families through the ``piecewise.models`` entry-point group (the
entry point loads the module that registers them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional, Protocol, runtime_checkable

import torch
import torch.nn as nn

from framework.core.registry import Registry


@dataclass(frozen=True)
class FamilyTraits:
    """How an architecture reads the fields its config.json leaves implicit."""

    model_type: str
    """Hugging Face ``model_type`` (``AutoConfig.for_model`` name), e.g. ``"llama"``."""
    qkv_bias: Optional[bool] = None
    """Bias on q/k/v; None: from ``attention_bias``."""
    o_bias: Optional[bool] = None
    """Bias on the output projection; None: from ``attention_bias``."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before RoPE."""
    sliding: Optional[Literal["all", "flag", "qwen", "qwen2_moe"]] = None
    """How sliding windows are declared: "all" (one window for every layer when
    ``sliding_window`` is set), "flag" (the same, only with ``use_sliding_window``), "qwen"
    (only with ``use_sliding_window``, per layer via ``layer_types`` / ``max_window_layers``),
    "qwen2_moe" (as "qwen", but without ``layer_types`` every other layer below
    ``max_window_layers`` slides) or None (no sliding window)."""
    moe: Optional[Literal["qwen3_moe", "qwen2_moe", "mixtral"]] = None
    """How the config declares its experts: "qwen3_moe" (``moe_intermediate_size``,
    ``norm_topk_prob``, ``mlp_only_layers`` / ``decoder_sparse_step``), "qwen2_moe" (the same
    plus a gated shared expert), "mixtral" (every layer, experts of ``intermediate_size``,
    top-k renormalised) or None (a dense model)."""


@runtime_checkable
class ModelFamily(Protocol):
    """What the engine and the compile spine use of a model.

    Inputs are flat token batches (``[T]``); request boundaries live only in the attention
    metadata of the forward context, so the forward traces once with a symbolic ``T``.
    """

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``input_ids [T], positions [T] -> hidden [T, H]``."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, H] -> logits [N, V]`` (the runner gathers the rows it samples)."""

    def attention_layer_names(self) -> list[str]:
        """One name per attention layer: the KV cache and the metadata are keyed by it."""

    def init_non_persistent_state(self) -> None:
        """Rebuild what the checkpoint does not hold (tied weights, RoPE caches) after the
        model was built on the meta device and materialized with ``to_empty``."""


@runtime_checkable
class GreedyLogits(Protocol):
    """Optional: a model whose LM head can pick greedy tokens as it computes the logits."""

    def compute_logits_greedy(
        self, hidden: torch.Tensor
    ) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``hidden [N, H]`` -> (logits [N, V], index [N] int64, maximum [N] float32): per
        row the first maximum of the logits (a row holding a NaN: its first NaN) -- what the
        sampler's greedy pass would find in these logits -- or None for this call (the runner
        then calls ``compute_logits`` and samples)."""


@runtime_checkable
class RecordedGreedyLogits(GreedyLogits, Protocol):
    """Optional: a :class:`GreedyLogits` model that can say which native call its greedy
    LM head made, for a caller that replays it among other native calls (a draft model's
    step loop: ``framework/engine/spec/draft_loop.py``)."""

    def record_logits_greedy(
        self, hidden: torch.Tensor
    ) -> Optional[tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], list[int]]]:
        """``(compute_logits_greedy's three tensors, [address, kind, word...])`` -- the C
        function and its arguments as 64-bit words, empty where the call cannot be replayed
        from its words alone -- or None where the head has no greedy kernel for this call."""


MODELS: Registry[type[nn.Module]] = Registry(
    "model architecture",
    builtin_modules=("models.decoder", "models.moe"),
    entry_point_group="piecewise.models",
)


def register_model(
    architecture: str, traits: FamilyTraits
) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Register a model class for one Hugging Face architecture name, with its traits."""
    if not isinstance(traits, FamilyTraits):
        raise TypeError(
            f"register_model({architecture!r}): traits must be a FamilyTraits, "
            f"got {type(traits).__name__}"
        )

    def deco(cls: type[nn.Module]) -> type[nn.Module]:
        missing = [
            m
            for m in (
                "forward",
                "compute_logits",
                "attention_layer_names",
                "init_non_persistent_state",
            )
            if not callable(getattr(cls, m, None))
        ]
        if missing:
            raise TypeError(
                f"register_model({architecture!r}): {cls.__qualname__} lacks "
                f"{missing} of the ModelFamily contract (models/family.py)"
            )
        return MODELS.add(architecture, cls, traits=traits)

    return deco


def supported_architectures() -> list[str]:
    return MODELS.names()


def _lookup(architecture: str, source: str):
    if architecture not in MODELS:
        raise ValueError(
            f"{source}: architecture {architecture!r} is not supported; "
            f"supported architectures are {supported_architectures()}"
        )
    return MODELS.entry(architecture)


def get_model_class(architecture: str, source: str = "config.json") -> type[nn.Module]:
    return _lookup(architecture, source).obj


def family_traits(architecture: str, source: str = "config.json") -> FamilyTraits:
    return _lookup(architecture, source).meta["traits"]


def architecture_for(model_type: str) -> str:
    """The registered architecture whose traits name this HF ``model_type``."""
    for entry in MODELS.entries():
        if entry.meta["traits"].model_type == model_type:
            return entry.name
    raise ValueError(
        f"no registered architecture has model_type {model_type!r}; known: "
        f"{sorted(e.meta['traits'].model_type for e in MODELS.entries())}"
    )
