"""Architecture registry and load_model (meta build, materialize, load)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from models.decoder import DecoderForCausalLM
from models.family import FamilyTraits, get_model_class, register_model, supported_architectures
from models.loader import load_model


def test_supported_architectures():
    assert supported_architectures() == [
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "MixtralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
    ]
    assert get_model_class("Qwen3ForCausalLM") is DecoderForCausalLM
    assert issubclass(get_model_class("Qwen3MoeForCausalLM"), DecoderForCausalLM)


def test_unknown_architecture_lists_supported():
    with pytest.raises(ValueError, match=r"'PhiForCausalLM' is not supported.*LlamaForCausalLM"):
        get_model_class("PhiForCausalLM")


def test_registering_a_name_twice_is_an_error():
    class Other(nn.Module):
        def forward(self, input_ids, positions): ...
        def compute_logits(self, hidden): ...
        def attention_layer_names(self): ...
        def init_non_persistent_state(self): ...

    with pytest.raises(ValueError, match="already registered"):
        register_model("LlamaForCausalLM", FamilyTraits("llama"))(Other)


def test_a_class_missing_part_of_the_contract_is_refused():
    class Half(nn.Module):
        def forward(self, input_ids, positions): ...

    with pytest.raises(TypeError, match="lacks .*compute_logits.*ModelFamily contract"):
        register_model("HalfForCausalLM", FamilyTraits("half"))(Half)


def test_meta_build_rebuilds_rope_cache(llama_checkpoint):
    """The cos/sin cache is not in the checkpoint: after the meta build it must be recomputed,
    equal to a model constructed directly on CPU."""
    model, config = load_model(llama_checkpoint, torch.float32)
    direct = DecoderForCausalLM(config)
    torch.testing.assert_close(
        model.model.rotary_emb.cos_cache, direct.model.rotary_emb.cos_cache, atol=0, rtol=0
    )
    torch.testing.assert_close(
        model.model.rotary_emb.sin_cache, direct.model.rotary_emb.sin_cache, atol=0, rtol=0
    )
    # One shared rotary module, not one per layer.
    assert all(l.self_attn.rotary_emb is model.model.rotary_emb for l in model.model.layers)
