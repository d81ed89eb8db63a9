"""Every registered model family honours the contract the engine relies on: it traces once,
splits into layers + 1 pieces, restores warm from the artifact cache without Dynamo, and its
compiled greedy tokens equal its eager tokens (fp32)."""

import pytest
import torch.nn as nn

from framework import LLM
from models.family import MODELS, ModelFamily, family_traits, supported_architectures
from models.tiny import PRESETS

PROMPTS = [[3, 17, 42, 9, 100, 7], [8, 1, 250]]
NEW = 6
TESTED_MODEL_TYPES = {family for family, _, _ in PRESETS.values()}


def test_every_registered_family_has_a_test_checkpoint():
    """A new family must come with a ``test-<model_type>`` preset so it runs below."""
    for arch in supported_architectures():
        assert family_traits(arch).model_type in TESTED_MODEL_TYPES, arch


@pytest.mark.parametrize("architecture", supported_architectures())
def test_family_conformance(architecture, tiny_checkpoint, tmp_path):
    family = family_traits(architecture).model_type
    path = str(tiny_checkpoint(family))
    eager = LLM(path, optimization_level=0, max_model_len=64, max_num_seqs=2)
    assert isinstance(eager.model, ModelFamily) and isinstance(eager.model, nn.Module)
    assert type(eager.model) is MODELS.get(architecture)
    expected = eager.generate(PROMPTS, NEW, ignore_eos=True)

    cold = LLM(
        path, optimization_level=2, max_model_len=64, max_num_seqs=2, cache_dir=str(tmp_path)
    )
    layers = cold.model_config.num_layers
    assert cold.stats["dynamo_traces"] == 1
    assert cold.stats["compile_num_pieces"] == layers + 1
    assert cold.stats["compile_num_splitting_ops"] == layers
    assert cold.generate(PROMPTS, NEW, ignore_eos=True) == expected

    warm = LLM(
        path, optimization_level=2, max_model_len=64, max_num_seqs=2, cache_dir=str(tmp_path)
    )
    assert warm.stats.get("dynamo_skipped") is True
    assert warm.stats["dynamo_traces"] == 0
    assert warm.stats["compile_compiles"] == 0
    assert warm.generate(PROMPTS, NEW, ignore_eos=True) == expected
