"""SpeculativeConfig: strict validation naming the field, the hash, the Hydra group."""

import pytest

from framework.engine.spec.config import SpeculativeConfig, speculative_config_of
from models.config import ModelConfig


def _mc(vocab=256, max_pos=2048):
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=max_pos,
    )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_speculative_tokens=0), "num_speculative_tokens: must be an int >= 1"),
        (dict(num_speculative_tokens=-2), "num_speculative_tokens"),
        (dict(num_speculative_tokens=True), "num_speculative_tokens"),
        (dict(num_speculative_tokens=2.0), "num_speculative_tokens"),
        (dict(method="eagle"), "SpeculativeConfig.method: unknown method 'eagle'"),
        (dict(method=""), "SpeculativeConfig.method"),
        (dict(prompt_lookup_min=0), "prompt_lookup_min"),
        (dict(prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_max"),
        (dict(prompt_lookup_periodic="yes"), "prompt_lookup_periodic: must be true or false"),
        (dict(method="draft_model"), "SpeculativeConfig.model: method 'draft_model' needs"),
        (dict(method="ngram", model="/some/draft"), "SpeculativeConfig.model: method 'ngram'"),
    ],
)
def test_bad_values_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig(**kwargs)


def test_unknown_field_is_named():
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['k'\]"):
        SpeculativeConfig.from_dict({"method": "ngram", "k": 3})


def test_checks_against_target_and_draft():
    cfg = SpeculativeConfig(num_speculative_tokens=7)
    with pytest.raises(ValueError, match="num_speculative_tokens: 7 draft tokens \\+ 1 exceed"):
        cfg.validate_for(_mc(), max_model_len=6)
    cfg.validate_for(_mc(), max_model_len=8)
    d = SpeculativeConfig(method="draft_model", model="/d", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="SpeculativeConfig.model: the draft's vocabulary"):
        d.validate_for(_mc(256), 128, draft_model_config=_mc(255))
    with pytest.raises(ValueError, match="SpeculativeConfig.model: the draft .* holds at most 64"):
        d.validate_for(_mc(256), 128, draft_model_config=_mc(256, max_pos=64))
    d.validate_for(_mc(256), 128, draft_model_config=_mc(256, max_pos=128))


def test_hash_covers_method_k_and_draft_only():
    base = SpeculativeConfig(num_speculative_tokens=2)
    assert base.compute_hash() == SpeculativeConfig(num_speculative_tokens=2).compute_hash()
    assert base.compute_hash() != SpeculativeConfig(num_speculative_tokens=3).compute_hash()
    # The lookup lengths change no compiled code.
    assert (
        base.compute_hash()
        == SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=5).compute_hash()
        == SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_periodic=False).compute_hash()
    )
    a = SpeculativeConfig(method="draft_model", model="/a", num_speculative_tokens=2)
    b = SpeculativeConfig(method="draft_model", model="/b", num_speculative_tokens=2)
    assert a.compute_hash() != b.compute_hash() != base.compute_hash()
    assert a.replace(draft_hash="x").compute_hash() != a.replace(draft_hash="y").compute_hash()


def test_speculative_config_of_accepts_dicts_and_off():
    assert speculative_config_of(None) is None
    assert speculative_config_of({}) is None  # the Hydra ``none`` option
    assert speculative_config_of({"method": None}) is None
    got = speculative_config_of({"method": "ngram", "num_speculative_tokens": 3})
    assert got == SpeculativeConfig(num_speculative_tokens=3)
    with pytest.raises(ValueError, match="method: not set, but \\['num_speculative_tokens'\\]"):
        speculative_config_of({"num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="LLM.speculative_config: expected"):
        speculative_config_of(3)


def test_hydra_group_composes_to_the_config():
    pytest.importorskip("hydra")
    from hydra import compose, initialize_config_dir

    from framework.engine.run_config import CONF_DIR, register_compile_schema, speculative_config

    register_compile_schema()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        off = compose("config")
        on = compose("config", ["speculative=ngram", "speculative.num_speculative_tokens=2"])
        with pytest.raises(Exception, match="num_speculative_tokens"):
            compose("config", ["speculative=ngram", "speculative.num_speculative_tokens=abc"])
    assert speculative_config(off) is None
    assert speculative_config(on) == SpeculativeConfig(num_speculative_tokens=2)
