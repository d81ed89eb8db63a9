"""Session-wide fixtures: one tiny random HF checkpoint per model family, built once."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Triton picks interpreter vs compiler when it is first imported (torch._inductor.config
# imports it), so CPU runs must choose the interpreter before anything else does.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Test helpers (checkpoints.py, paged_harness.py) import as top-level modules whatever the
# pytest import mode.
sys.path.insert(0, os.path.dirname(__file__))

from checkpoints import FAMILIES, build_family_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(family) -> Path``: the fp32 ``test-<family>`` checkpoint (seed 0),
    written once per session; family in ("llama", "mistral", "qwen2", "qwen3")."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in FAMILIES:
            raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")
        if family not in built:
            root = tmp_path_factory.mktemp(f"ckpt-{family}")
            built[family] = build_family_checkpoint(root / family, family)
        return built[family]

    return get


@pytest.fixture(scope="session")
def llama_checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def compile_cache_dir(tmp_path_factory) -> str:
    """One artifact-cache root shared by every test that is not about the cache itself, so
    identical configurations compile once per session."""
    return str(tmp_path_factory.mktemp("piecewise-cache"))
