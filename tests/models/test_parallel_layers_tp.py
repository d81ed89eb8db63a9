"""Sharded loading without a process group: build rank r's shard (world size 2) and check that
the shards put together are exactly the full model's weights (q heads split, KV heads
replicated when fewer than ranks, gate/up split block by block, row-parallel columns split,
vocabulary padded with zero rows)."""

from __future__ import annotations

import pytest
import torch

from framework.core.parallel_state import TPState, kv_head_layout, tp_state
from models.loader import load_model
from models.tiny import write_tiny_checkpoint


@pytest.fixture(scope="module", params=[2, 1], ids=["gqa-2kv", "mqa-1kv"])
def checkpoint(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"ckpt-kv{request.param}")
    return request.param, write_tiny_checkpoint(
        root / "m", "test-qwen2", seed=2, num_key_value_heads=request.param, vocab_size=251
    )


def _shards(path):
    full, mc = load_model(path)
    shards = []
    for r in range(2):
        with tp_state(TPState(r, 2, "unused")):
            shards.append(load_model(path)[0])
    return full, mc, shards


def test_shards_reassemble_the_full_weights(checkpoint):
    num_kv, path = checkpoint
    full, mc, shards = _shards(path)
    D, Hq = mc.head_dim, mc.num_heads
    per_rank_kv, replicas = kv_head_layout(num_kv, 2)
    f_attn = full.model.layers[1].self_attn
    q_full, k_full, v_full = f_attn.qkv_proj.weight.split([Hq * D, num_kv * D, num_kv * D])
    qb_full = f_attn.qkv_proj.bias.split([Hq * D, num_kv * D, num_kv * D])[0]
    for r, m in enumerate(shards):
        a = m.model.layers[1].self_attn
        assert (a.num_heads, a.num_kv_heads) == (Hq // 2, per_rank_kv)
        q, k, v = a.qkv_proj.weight.split([a.q_size, a.kv_size, a.kv_size])
        torch.testing.assert_close(q, q_full[r * a.q_size : (r + 1) * a.q_size], rtol=0, atol=0)
        kv0 = (r // replicas) * a.kv_size
        torch.testing.assert_close(k, k_full[kv0 : kv0 + a.kv_size], rtol=0, atol=0)
        torch.testing.assert_close(v, v_full[kv0 : kv0 + a.kv_size], rtol=0, atol=0)
        qb = a.qkv_proj.bias[: a.q_size]
        torch.testing.assert_close(qb, qb_full[r * a.q_size : (r + 1) * a.q_size], rtol=0, atol=0)
        cols = a.o_proj.weight.shape[1]
        torch.testing.assert_close(
            a.o_proj.weight, f_attn.o_proj.weight[:, r * cols : (r + 1) * cols], rtol=0, atol=0
        )
    # gate_up: rank r holds [gate_r; up_r]
    I = mc.intermediate_size  # noqa: E741
    f_gu = full.model.layers[0].mlp.gate_up_proj.weight
    for r, m in enumerate(shards):
        gu = m.model.layers[0].mlp.gate_up_proj.weight
        h = I // 2
        torch.testing.assert_close(gu[:h], f_gu[r * h : (r + 1) * h], rtol=0, atol=0)
        torch.testing.assert_close(gu[h:], f_gu[I + r * h : I + (r + 1) * h], rtol=0, atol=0)
    # vocabulary 251 -> 252 rows, 126 per rank; the last row of rank 1 is zero padding.
    emb = torch.cat([m.model.embed_tokens.weight for m in shards])
    assert emb.shape[0] == 252
    torch.testing.assert_close(emb[:251], full.model.embed_tokens.weight, rtol=0, atol=0)
    assert emb[251].abs().sum() == 0
    assert shards[1].lm_head.weight is shards[1].model.embed_tokens.weight  # still tied


def test_world_size_one_is_the_plain_model(checkpoint):
    _, path = checkpoint
    model, _ = load_model(path)
    head = model.lm_head
    assert head.weight.shape[0] == 251 and model.model.embed_tokens.weight.shape[0] == 251


def test_indivisible_heads_name_the_field(checkpoint):
    _, path = checkpoint
    with tp_state(TPState(0, 3, "unused")), pytest.raises(ValueError, match="num_attention_heads"):
        load_model(path)
