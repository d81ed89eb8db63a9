"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE and Mixtral.

The attention, norms and dense MLPs are the decoder family's (:mod:`models.decoder`); only the
feed-forward block of a MoE layer differs:

    logits       = gate(x)                                   [T, E]   (the router, a Linear)
    weights, ids = topk_softmax(logits, K, renormalize)      [T, K]   (plain torch; a pass may
                                                                      fuse it)
    out          = piecewise::fused_moe(x, weights, ids, w13, w2)     [T, H]
    out         += sigmoid(shared_expert_gate(x)) * shared_expert(x)  (Qwen2-MoE only)

The experts' weights are the model's own stacked tensors, in the layout the kernel reads
(``w13 [E, 2I, H]``: each expert's gate rows then its up rows; ``w2 [E, H, I]``); the loader
copies every per-expert checkpoint tensor into its slot, so there is one copy.  After loading,
a ``moe_method`` may replace both stacks by another layout, still one copy: quantization
(int8 experts, ``passes.quant_schemes``), or, in bf16 on CPU, the engine's re-layout for the
small-M kernel (``passes.ops.packed_moe.PackedExpertsMethod``, ``piecewise::fused_moe_packed``).

``fused_moe`` is an ordinary op inside the layer's piece (not a splitting op), so the graph
still splits only at attention.

Tensor parallelism: every expert's intermediate dimension is sharded (each rank holds a slice
of every expert), and the routed experts and the shared expert add their partial sums before
one all-reduce.  The router is replicated.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

import passes.ops.moe  # noqa: F401  (registers piecewise::fused_moe)
from framework.core.parallel_state import all_reduce, divide, get_tp_state
from models.config import ModelConfig
from models.decoder import DecoderForCausalLM, DecoderLayer, DecoderMLP
from models.family import FamilyTraits, family_traits, register_model
from models.layers import Linear
from models.parallel_layers import LoadSlice
from passes.ops.moe import topk_softmax_torch


class FusedMoE(nn.Module):
    """The routed experts of one layer as two stacked tensors.

    ``names`` are the checkpoint's per-expert tensor names (gate, up, down):
    ``("gate_proj", "up_proj", "down_proj")`` for Qwen, ``("w1", "w3", "w2")`` for Mixtral.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: Optional[torch.dtype] = None,
        names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    ):
        super().__init__()
        tp = get_tp_state()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.full_intermediate_size = intermediate_size
        self.intermediate_size = I = divide(  # noqa: E741
            intermediate_size, tp.world_size, "moe_intermediate_size"
        )
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.names = names
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * I, hidden_size, dtype=dtype), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden_size, I, dtype=dtype), requires_grad=False
        )
        self.moe_method = None
        """Installed after loading by quantization or the engine's re-layout (``apply(module,
        x, weights, ids)``); None: the plain float stacks and ``piecewise::fused_moe``."""

    # -- loading ---------------------------------------------------------------------------
    def checkpoint_tensors(self, attr: str) -> list[tuple[str, int, Optional[int]]]:
        """(checkpoint name relative to this module, expert, row block) filling ``attr``."""
        gate, up, down = self.names
        if attr == "w13":
            return [
                (f"{e}.{name}.weight", e, block)
                for e in range(self.num_experts)
                for block, name in enumerate((gate, up))
            ]
        if attr == "w2":
            return [(f"{e}.{down}.weight", e, None) for e in range(self.num_experts)]
        raise KeyError(f"FusedMoE has no stacked tensor {attr!r}")

    def shard_bounds(self, block: int) -> tuple[int, int]:
        """(start, size) of the gate (0) or up (1) rows inside one expert's ``w13`` slot."""
        return block * self.intermediate_size, self.intermediate_size

    def load_slice(self, attr: str, block: Optional[int]) -> Optional[LoadSlice]:
        if self.tp_size == 1:
            return None
        local, full = self.intermediate_size, self.full_intermediate_size
        dim = 0 if attr == "w13" else 1  # gate/up rows, or down's input columns
        return LoadSlice(dim, self.tp_rank * local, local, full)

    # -- compute ---------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor):
        """``x [T, H]`` -> ``[T, H]`` (this rank's partial sum under tensor parallelism)."""
        if self.moe_method is not None:
            return self.moe_method.apply(self, x, topk_weights, topk_ids)
        return torch.ops.piecewise.fused_moe(x, topk_weights, topk_ids, self.w13, self.w2)

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size}/{self.full_intermediate_size}"
        )


class _PartialMLP(DecoderMLP):
    """The shared expert: a dense gated MLP whose down projection leaves its partial sum
    unreduced (the MoE block all-reduces once for routed and shared experts together)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        gate = gate_up[..., : self.intermediate_size]  # [T, I]
        up = gate_up[..., self.intermediate_size :]  # [T, I]
        h = torch.nn.functional.silu(gate) * up
        down = self.down_proj
        if down.tp_size == 1:
            return down(h)
        if down.linear_method is not None:  # quantized: the method on this rank's columns
            return down.linear_method.apply(down, h)  # [T, H] partial sum
        return torch.nn.functional.linear(h, down.weight)  # [T, H] partial sum


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, expert_names: tuple[str, str, str], cast: bool):
        super().__init__()
        dt = config.torch_dtype
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.cast_weights = cast
        """Round the routing weights to the model dtype before the experts (Qwen), or keep
        them fp32 (Mixtral)."""
        self.tp = get_tp_state()  # the state this block was built with: its all-reduce's group
        self.tp_size = self.tp.world_size
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False, dtype=dt)
        self.experts = FusedMoE(
            config.num_experts,
            config.hidden_size,
            config.moe_intermediate_size,
            dtype=dt,
            names=expert_names,
        )
        if config.shared_expert_intermediate_size:
            self.shared_expert = _PartialMLP(config, config.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False, dtype=dt)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)  # [T, E]
        weights, ids = topk_softmax_torch(logits, self.top_k, self.renormalize)  # [T, K]
        if self.cast_weights:
            weights = weights.to(x.dtype)
        out = self.experts(x, weights, ids)  # [T, H]
        if self.shared_expert is not None:
            shared = self.shared_expert(x)  # [T, H]
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        if self.tp_size > 1:
            out = all_reduce(out, self.tp)
        return out


class MoEDecoderLayer(DecoderLayer):
    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        if not config.is_moe_layer(layer_idx):
            return DecoderMLP(config)
        mixtral = family_traits(config.architecture).moe == "mixtral"
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        return SparseMoeBlock(config, names, cast=not mixtral)


@register_model(
    "Qwen3MoeForCausalLM",
    FamilyTraits("qwen3_moe", qkv_bias=None, o_bias=None, qk_norm=True, sliding="flag",
                 moe="qwen3_moe"),
)  # fmt: skip
@register_model(
    "Qwen2MoeForCausalLM",
    FamilyTraits("qwen2_moe", qkv_bias=True, o_bias=False, sliding="qwen2_moe", moe="qwen2_moe"),
)
class MoEForCausalLM(DecoderForCausalLM):
    """A decoder whose MoE layers route each token to its top-k experts."""

    layer_cls = MoEDecoderLayer


@register_model(
    "MixtralForCausalLM",
    FamilyTraits("mixtral", qkv_bias=False, o_bias=False, sliding="all", moe="mixtral"),
)
class MixtralForCausalLM(MoEForCausalLM):
    """Mixtral names its MoE block ``block_sparse_moe`` and its experts ``w1``/``w3``/``w2``."""

    hf_module_renames = {"mlp": "block_sparse_moe"}
