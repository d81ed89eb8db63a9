"""Embedded tiny checkpoints: deterministic, cached, atomic, loadable."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file

from models.loader import load_model
from models.tiny import PRESETS, ensure_tiny_model, resolve_preset


def test_cached_and_reused(tmp_path):
    path = ensure_tiny_model(tmp_path, preset="test-llama")
    weights = path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path, preset="test-llama") == path
    assert weights.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp dirs left
    model, config = load_model(path, torch.float32)
    assert config.architecture == "LlamaForCausalLM" and config.num_layers == 2


def test_env_var_sets_cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("PIECEWISE_MODEL_CACHE", str(tmp_path / "cache"))
    path = ensure_tiny_model(preset="test-qwen3")
    assert path.parent == tmp_path / "cache"
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]


def test_deterministic_across_cache_roots_and_seeded(tmp_path):
    a = load_file(str(ensure_tiny_model(tmp_path / "a", preset="test-qwen2") / "model.safetensors"))
    b = load_file(str(ensure_tiny_model(tmp_path / "b", preset="test-qwen2") / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = ensure_tiny_model(tmp_path / "a", preset="test-qwen2", seed=1)
    c = load_file(str(other / "model.safetensors"))
    assert not torch.equal(a["model.norm.weight"], c["model.norm.weight"])


def test_concurrent_callers_get_one_complete_folder(tmp_path):
    with ThreadPoolExecutor(3) as pool:
        paths = list(
            pool.map(lambda _: ensure_tiny_model(tmp_path, preset="test-mistral"), range(3))
        )
    assert len(set(paths)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].name]
    load_model(paths[0], torch.float32)


def test_arch_and_overrides_change_the_folder(tmp_path):
    base = ensure_tiny_model(tmp_path, preset="test-llama")
    qwen3 = ensure_tiny_model(tmp_path, arch="qwen3", preset="test-llama")
    deeper = ensure_tiny_model(tmp_path, preset="test-llama", num_hidden_layers=3)
    assert len({base, qwen3, deeper}) == 3
    assert load_model(qwen3)[1].qk_norm
    assert load_model(deeper)[1].num_layers == 3


def test_default_preset_is_the_benchmark_model():
    family, kwargs, dtype = resolve_preset("default")
    assert family == "llama" and dtype == "bfloat16"
    assert (
        kwargs["num_hidden_layers"],
        kwargs["hidden_size"],
        kwargs["intermediate_size"],
        kwargs["num_attention_heads"],
        kwargs["num_key_value_heads"],
        kwargs["vocab_size"],
        kwargs["max_position_embeddings"],
    ) == (8, 512, 1408, 8, 4, 32000, 2048)


def test_bad_preset_and_arch():
    with pytest.raises(ValueError, match=r"preset 'huge'.*default"):
        resolve_preset("huge")
    with pytest.raises(ValueError, match=r"arch 'gpt2'.*llama"):
        resolve_preset("default", arch="gpt2")
    assert set(PRESETS) >= {"default", "test-llama", "test-mistral", "test-qwen2", "test-qwen3"}


def test_default_model_builds_and_loads(tmp_path):
    path = ensure_tiny_model(tmp_path)
    model, config = load_model(path, torch.bfloat16)
    assert config.hidden_size == 512 and config.num_layers == 8 and not config.tie_word_embeddings
    n_params = sum(p.numel() for p in model.parameters())
    assert 50e6 < n_params < 60e6
