"""ModelConfig: mapping of Hugging Face config.json (both spellings), validation, hash."""

from __future__ import annotations

import json

import pytest
import torch

from models.config import ModelConfig, parse_dtype, read_hf_config

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    "bos_token_id": 1,
    "eos_token_id": [2, 7],
    "dtype": "bfloat16",
}


def test_llama_mapping():
    c = ModelConfig.from_hf_dict(LLAMA)
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "LlamaForCausalLM",
        2,
        4,
        2,
        16,
    )
    assert c.rope_theta == 500000.0 and c.rope_scaling is None
    assert c.eos_token_ids == [2, 7] and c.dtype == "bfloat16"
    assert c.torch_dtype is torch.bfloat16
    assert not (c.attention_bias or c.o_proj_bias or c.qk_norm or c.tie_word_embeddings)
    assert c.layer_sliding_window(0) == -1


def test_family_traits():
    qwen2 = ModelConfig.from_hf_dict({**LLAMA, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen2.attention_bias and not qwen2.o_proj_bias and not qwen2.qk_norm
    qwen3 = ModelConfig.from_hf_dict(
        {**LLAMA, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32}
    )
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.attention_bias
    llama_bias = ModelConfig.from_hf_dict({**LLAMA, "attention_bias": True})
    assert llama_bias.attention_bias and llama_bias.o_proj_bias


def test_sliding_windows():
    mistral = ModelConfig.from_hf_dict(
        {**LLAMA, "architectures": ["MistralForCausalLM"], "sliding_window": 16}
    )
    assert [mistral.layer_sliding_window(i) for i in range(2)] == [16, 16]
    # Qwen: the window is ignored unless use_sliding_window, then per layer.
    qwen_off = ModelConfig.from_hf_dict(
        {**LLAMA, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 16}
    )
    assert qwen_off.sliding_window is None
    qwen_on = ModelConfig.from_hf_dict(
        {
            **LLAMA,
            "architectures": ["Qwen2ForCausalLM"],
            "sliding_window": 16,
            "use_sliding_window": True,
            "max_window_layers": 1,
        }
    )
    assert [qwen_on.layer_sliding_window(i) for i in range(2)] == [-1, 16]
    # Llama has no sliding window even if the key is present.
    assert ModelConfig.from_hf_dict({**LLAMA, "sliding_window": 16}).sliding_window is None


def test_old_spelling_rope_theta_and_rope_scaling():
    old = {k: v for k, v in LLAMA.items() if k not in ("rope_parameters", "dtype")}
    old.update(
        rope_theta=10000.0,
        rope_scaling={
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        torch_dtype="float16",
    )
    c = ModelConfig.from_hf_dict(old)
    assert c.rope_theta == 10000.0 and c.rope_scaling["rope_type"] == "llama3"
    assert "type" not in c.rope_scaling and c.dtype == "float16"
    assert ModelConfig.from_hf_dict({**old, "rope_scaling": None}).rope_scaling is None


@pytest.mark.parametrize(
    "field,spelling", [("rope_parameters", "rope_parameters"), ("rope_scaling", "rope_scaling")]
)
def test_unsupported_rope_type_names_field_and_type(field, spelling):
    d = {k: v for k, v in LLAMA.items() if k != "rope_parameters"}
    d[spelling] = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ValueError, match=rf"config.json: {field}.*'yarn'.*not supported"):
        ModelConfig.from_hf_dict(d)


@pytest.mark.parametrize(
    "edit,match",
    [
        (
            {"architectures": ["GPT2LMHeadModel"]},
            r"GPT2LMHeadModel.*not supported.*LlamaForCausalLM",
        ),
        ({"architectures": []}, "architectures"),
        ({"hidden_size": None}, "missing field 'hidden_size'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"num_key_value_heads": 3}, "num_kv_heads"),
        ({"vocab_size": 0}, "vocab_size"),
    ],
)
def test_bad_hf_config_fields_are_named(edit, match):
    with pytest.raises(ValueError, match=match) as info:
        ModelConfig.from_hf_dict({**LLAMA, **edit}, source="/ckpt/config.json")
    assert str(info.value).startswith("/ckpt/config.json")


def test_strict_fields_and_overrides():
    with pytest.raises(ValueError, match="unknown field"):
        ModelConfig.from_dict({**ModelConfig.from_hf_dict(LLAMA).to_dict(), "bogus": 1})
    c = ModelConfig.from_hf_dict(LLAMA, dtype=torch.float32)
    assert c.dtype == "float32"
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig.from_hf_dict(LLAMA, dtype="int8")


def test_compute_hash_tracks_every_architecture_fact():
    base = ModelConfig.from_hf_dict(LLAMA)
    assert base.compute_hash() == ModelConfig.from_hf_dict(LLAMA).compute_hash()
    for change in (
        dict(dtype="float32"),
        dict(num_layers=3),
        dict(rope_theta=1.0),
        dict(sliding_window=8),
        dict(qk_norm=True),
    ):
        assert base.replace(**change).compute_hash() != base.compute_hash(), change


def test_read_hf_config_errors(tmp_path):
    with pytest.raises(ValueError, match=r"config.json: not found"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json: cannot read config.json"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="expected a JSON object"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert ModelConfig.from_hf_dir(tmp_path).vocab_size == 256


def test_parse_dtype():
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("torch.float16") is torch.half
    assert parse_dtype(torch.float32) is torch.float32
    with pytest.raises(ValueError, match="int32"):
        parse_dtype(torch.int32)
