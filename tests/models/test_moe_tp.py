"""Tensor parallelism for MoE: every expert's intermediate dimension (and the shared
expert's) is sharded; the shards reassemble the full weights, and TP=2 greedy tokens equal
TP=1 through the engine (two gloo processes)."""

from __future__ import annotations

import pytest
import torch

from framework.core.parallel_state import TPState, tp_state
from framework.engine.llm import LLM
from framework.engine.observers import FirstTokenLogits
from models.loader import load_model

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_expert_shards_reassemble_the_full_experts(tiny_checkpoint, family):
    path = tiny_checkpoint(family)
    full, mc = load_model(path)
    shards = []
    for r in range(2):
        with tp_state(TPState(r, 2, "unused")):
            shards.append(load_model(path)[0])
    I = mc.moe_intermediate_size  # noqa: E741
    h = I // 2
    f = full.model.layers[0].mlp
    for r, m in enumerate(shards):
        b = m.model.layers[0].mlp
        assert b.experts.w13.shape == (mc.num_experts, I, mc.hidden_size)
        gate, up = b.experts.w13.split([h, h], dim=1)
        torch.testing.assert_close(gate, f.experts.w13[:, r * h : (r + 1) * h], rtol=0, atol=0)
        torch.testing.assert_close(
            up, f.experts.w13[:, I + r * h : I + (r + 1) * h], rtol=0, atol=0
        )
        torch.testing.assert_close(
            b.experts.w2, f.experts.w2[:, :, r * h : (r + 1) * h], rtol=0, atol=0
        )
        torch.testing.assert_close(b.gate.weight, f.gate.weight, rtol=0, atol=0)  # replicated
        if mc.shared_expert_intermediate_size:
            s = mc.shared_expert_intermediate_size // 2
            cols = b.shared_expert.down_proj.weight
            ref = f.shared_expert.down_proj.weight[:, r * s : (r + 1) * s]
            torch.testing.assert_close(cols, ref, rtol=0, atol=0)


def _generate(path, tp: int):
    llm = LLM(str(path), tensor_parallel_size=tp, max_model_len=128, optimization_level=0)
    try:
        with FirstTokenLogits.attached(llm) as first:
            out = llm.generate(PROMPTS, max_new_tokens=6)
        return out, [t.clone() for t in first.take()]
    finally:
        llm.close()


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_tp2_tokens_equal_tp1_o0(tiny_checkpoint, family):
    torch.set_num_threads(1)
    path = tiny_checkpoint(family)
    ref, ref_logits = _generate(path, 1)
    out, logits = _generate(path, 2)
    assert out == ref
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
