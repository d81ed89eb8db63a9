"""The decoder family: Llama, Mistral, Qwen2 and Qwen3 in one readable file.

Everything family-specific is a :class:`ModelConfig` field (qkv bias, q/k norm, sliding window,
RoPE scaling, tied embeddings), so the forward has no per-family branches.

Inputs are FLAT token batches: ``input_ids`` and ``positions`` are ``[T]`` where ``T`` is the
total number of tokens of every request in the step (prefill and decode mixed, maybe padded).
How tokens group into requests lives only in the attention metadata of the forward context.
The forward is traced once by Dynamo with a symbolic ``T``: no data-dependent Python control
flow, no ``.item()``.

Shape legend: T tokens, H hidden size, I intermediate size, Hq / Hkv query / key-value heads,
D head dim, V vocab size.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from framework.core.parallel_state import divide, get_tp_state, kv_head_layout
from models.attention import PagedAttention
from models.config import ModelConfig
from models.family import FamilyTraits, register_model
from models.layers import RMSNorm
from models.parallel_layers import (
    BlockShard,
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from models.rotary import RotaryEmbedding


class DecoderAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, prefix: str, layer_idx: int):
        super().__init__()
        dt = config.torch_dtype
        # Tensor parallelism: this rank's q heads, and its KV heads (replicated over ranks
        # when there are fewer KV heads than ranks).  World size 1: every head.
        tp = get_tp_state()
        self.num_heads = divide(config.num_heads, tp.world_size, "num_attention_heads")
        self.num_kv_heads, kv_replicas = kv_head_layout(config.num_kv_heads, tp.world_size)
        self.head_dim = D = config.head_dim
        self.q_size = self.num_heads * D
        self.kv_size = self.num_kv_heads * D
        kv_start = (tp.rank // kv_replicas) * self.kv_size
        kv = BlockShard(self.kv_size, kv_start, config.num_kv_heads * D)
        self.qkv_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [BlockShard(self.q_size, tp.rank * self.q_size, config.num_heads * D), kv, kv],
            bias=config.attention_bias,
            dtype=dt,
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * D, config.hidden_size, bias=config.o_proj_bias, dtype=dt
        )
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dt)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dt)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary  # one module shared by every layer (one cos/sin cache)
        self.attn = PagedAttention(
            f"{prefix}.attn",
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            scale=self.head_dim**-0.5,
            sliding_window=config.layer_sliding_window(layer_idx),
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [T, (Hq + 2*Hkv) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None:
            q = self.q_norm(q)  # [T, Hq, D]
            k = self.k_norm(k)  # [T, Hkv, D]
        q, k = self.rotary_emb(positions, q, k)  # [T, Hq, D], [T, Hkv, D]
        out = self.attn(q, k, v)  # [T, Hq, D]
        return self.o_proj(out.view(-1, self.q_size))  # [T, H]


class DecoderMLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: Optional[int] = None):
        super().__init__()
        dt = config.torch_dtype
        I = intermediate_size or config.intermediate_size  # noqa: E741
        self.intermediate_size = divide(I, get_tp_state().world_size, "intermediate_size")
        self.gate_up_proj = MergedColumnParallelLinear.even(
            config.hidden_size, [I, I], "intermediate_size", dtype=dt
        )
        self.down_proj = RowParallelLinear(I, config.hidden_size, dtype=dt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        gate = gate_up[..., : self.intermediate_size]  # [T, I]
        up = gate_up[..., self.intermediate_size :]  # [T, I]
        return self.down_proj(F.silu(gate) * up)  # [T, H]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, prefix: str, layer_idx: int):
        super().__init__()
        dt = config.torch_dtype
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dt)
        self.self_attn = DecoderAttention(config, rotary, f"{prefix}.self_attn", layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dt)
        self.mlp = self.make_mlp(config, layer_idx)

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        """The feed-forward block of layer ``layer_idx`` (a family with experts overrides it)."""
        return DecoderMLP(config)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # Same residual structure (and rounding) as transformers: add, then norm.
        residual = hidden  # [T, H]
        hidden = self.input_layernorm(hidden)  # [T, H]
        hidden = self.self_attn(positions, hidden)  # [T, H]
        hidden = residual + hidden  # [T, H]
        residual = hidden
        hidden = self.post_attention_layernorm(hidden)  # [T, H]
        hidden = self.mlp(hidden)  # [T, H]
        return residual + hidden  # [T, H]


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, prefix: str = "model", layer_cls: type = DecoderLayer):
        super().__init__()
        dt = config.torch_dtype
        # VocabParallelEmbedding allocates uninitialised (torch.empty): the checkpoint overwrites
        # it, and nn.Embedding's normal_ init would import Dynamo on every warm start.
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dt)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            dtype=dt,
        )
        self.layers = nn.ModuleList(
            layer_cls(config, self.rotary_emb, f"{prefix}.layers.{i}", i)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dt)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, H]
        for layer in self.layers:
            hidden = layer(positions, hidden)  # [T, H]
        return self.norm(hidden)  # [T, H]


@register_model("LlamaForCausalLM", FamilyTraits("llama"))
@register_model(
    "MistralForCausalLM", FamilyTraits("mistral", qkv_bias=False, o_bias=False, sliding="all")
)
@register_model(
    "Qwen2ForCausalLM", FamilyTraits("qwen2", qkv_bias=True, o_bias=False, sliding="qwen")
)
@register_model("Qwen3ForCausalLM", FamilyTraits("qwen3", qk_norm=True, sliding="qwen"))
class DecoderForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T]) -> hidden [T, H]``;
    ``compute_logits(hidden [N, H]) -> [N, V]`` (the runner gathers the rows it samples first).
    """

    # Checkpoint tensors that land in one merged projection, in row-block order.
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    layer_cls: type = DecoderLayer
    """The decoder layer class (a family with experts substitutes its own)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, prefix="model", layer_cls=self.layer_cls)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, config.torch_dtype)
        self.tie_weights()

    def tie_weights(self) -> None:
        """With tied embeddings ``lm_head`` uses the embedding matrix (one Parameter)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_non_persistent_state(self) -> None:
        """Re-tie weights and rebuild non-checkpoint buffers after ``to_empty`` (meta build)."""
        self.tie_weights()
        self.model.rotary_emb.init_cache()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)  # [T, H]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [N, V]

    def compute_logits_greedy(
        self, hidden: torch.Tensor
    ) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``compute_logits`` and each row's greedy choice in one LM-head call (see
        :class:`models.family.GreedyLogits`), or None where the head has no such kernel."""
        return self.lm_head.forward_greedy(hidden)

    def record_logits_greedy(
        self, hidden: torch.Tensor
    ) -> Optional[tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], list[int]]]:
        """:meth:`compute_logits_greedy` and the native call it made (see
        :class:`models.family.RecordedGreedyLogits`), or None."""
        return self.lm_head.record_greedy(hidden)

    def attention_layer_names(self) -> list[str]:
        return [m.layer_name for m in self.modules() if isinstance(m, PagedAttention)]
