"""RoPE: inverse frequencies and logits equal transformers for plain, linear and llama3 RoPE."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import build_family_checkpoint
from paged_harness import PagedHarness
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from models.loader import load_model
from models.rotary import RotaryEmbedding, rope_inv_freq, rotate_half, supported_rope_types

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
LINEAR = {"rope_type": "linear", "factor": 4.0}


@pytest.mark.parametrize("scaling", [LLAMA3, LINEAR], ids=["llama3", "linear"])
def test_inv_freq_equals_transformers(scaling):
    hf_config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        rope_parameters={**scaling, "rope_theta": 500000.0},
    )
    expected, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config, "cpu")
    assert attention_factor == 1.0
    torch.testing.assert_close(rope_inv_freq(16, 500000.0, scaling), expected, atol=0, rtol=0)


def test_llama3_scaling_touches_all_three_bands():
    """With original_max_position_embeddings=64 the test head_dim has frequencies kept,
    interpolated and divided -- so the parity tests below exercise every branch."""
    plain, scaled = rope_inv_freq(16, 10000.0, None), rope_inv_freq(16, 10000.0, LLAMA3)
    ratio = plain / scaled
    assert (ratio == 1).any() and torch.isclose(ratio, torch.tensor(8.0)).any()
    assert ((ratio > 1.01) & (ratio < 7.99)).any()


def test_cos_sin_cache_matches_rotate_half_definition():
    rope = RotaryEmbedding(8, 32, 10000.0, None, torch.float32)
    q, k = torch.randn(5, 2, 8), torch.randn(5, 1, 8)
    positions = torch.tensor([0, 3, 31, 7, 7])
    q2, k2 = rope(positions, q, k)
    ang = positions[:, None].float() * rope_inv_freq(8, 10000.0, None)[None]  # [T, D/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    torch.testing.assert_close(q2, q * cos + rotate_half(q) * sin)
    torch.testing.assert_close(k2, k * cos + rotate_half(k) * sin)
    torch.testing.assert_close(q2[0], q[0])  # position 0 is the identity


@pytest.mark.parametrize("scaling", [LLAMA3, LINEAR], ids=["llama3", "linear"])
def test_scaled_rope_logits_match_transformers(tmp_path, scaling):
    path = build_family_checkpoint(
        tmp_path / "ckpt", "llama", rope_parameters={**scaling, "rope_theta": 10000.0}
    )
    model, config = load_model(path, torch.float32)
    assert config.rope_scaling["rope_type"] == scaling["rope_type"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = torch.randint(
        0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    (ours,) = PagedHarness(model).prefill_logits([prompt])
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    # The scaling must matter for this test to mean anything.
    plain, _ = load_model(build_family_checkpoint(tmp_path / "plain", "llama"), torch.float32)
    (unscaled,) = PagedHarness(plain).prefill_logits([prompt])
    assert (unscaled - ours).abs().max() > 1e-3


def test_old_config_spelling_rope_theta_and_rope_scaling_type(tmp_path):
    """transformers < 5 wrote rope_theta at top level and rope_scaling with "type"."""
    path = build_family_checkpoint(
        tmp_path / "ckpt", "llama", rope_parameters={**LINEAR, "rope_theta": 20000.0}
    )
    cfg_file = path / "config.json"
    d = json.loads(cfg_file.read_text())
    d.pop("rope_parameters")
    d["rope_theta"] = 20000.0
    d["rope_scaling"] = {"type": "linear", "factor": 4.0}
    cfg_file.write_text(json.dumps(d))
    model, config = load_model(path, torch.float32)
    assert config.rope_theta == 20000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = list(range(7, 37))
    (ours,) = PagedHarness(model).prefill_logits([prompt])
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope"])
def test_unsupported_rope_type_is_a_clear_error(rope_type):
    with pytest.raises(ValueError, match=rf"rope_scaling.*{rope_type}.*supported"):
        rope_inv_freq(16, 10000.0, {"rope_type": rope_type, "factor": 2.0})
    assert rope_type not in supported_rope_types()


def test_llama3_missing_key_is_named():
    bad = {k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}
    with pytest.raises(ValueError, match="low_freq_factor"):
        rope_inv_freq(16, 10000.0, bad)
