"""The compile backend talks to the cache and the passes only through its own Protocols
(backends/piecewise/protocols.py): the real ArtifactStore and PassManager must conform, by
attribute and by call signature, or the backend's calls would fail only at run time."""

from __future__ import annotations

import inspect

import pytest
import torch

from backends.piecewise.protocols import PieceGraphPass, PieceStore
from framework.cache.store import ArtifactStore
from framework.core.config import CompilationConfig
from passes.manager import PassManager
from passes.registry import level_passes


def _protocol_methods(proto: type) -> list[str]:
    return [
        name
        for name, value in vars(proto).items()
        if not name.startswith("_") or name == "__call__"
        if callable(value) or isinstance(value, property)
    ]


def _assert_conforms(obj: object, proto: type) -> None:
    assert isinstance(obj, proto), f"{type(obj).__name__} is not a {proto.__name__}"
    for name in _protocol_methods(proto):
        want = vars(proto)[name]
        if isinstance(want, property):  # a data attribute or a property: present is enough
            assert hasattr(obj, name), f"{type(obj).__name__} has no {name!r}"
            continue
        have = getattr(type(obj), name)
        want_params = list(inspect.signature(want).parameters)
        have_params = list(inspect.signature(have).parameters)
        assert have_params[: len(want_params)] == want_params, (
            f"{type(obj).__name__}.{name}{inspect.signature(have)} does not match "
            f"{proto.__name__}.{name}{inspect.signature(want)}"
        )


def test_artifact_store_is_a_piece_store(tmp_path):
    store = ArtifactStore.open(tmp_path, {"torch": torch.__version__, "what": "protocol test"})
    _assert_conforms(store, PieceStore)
    assert store.dir.is_dir()


def test_pass_manager_is_a_piece_graph_pass():
    config = CompilationConfig(level=2).resolve(
        max_num_tokens=64, level_passes=level_passes, has_cuda=False
    )
    manager = PassManager(config.pass_config, dtype=torch.float32)
    _assert_conforms(manager, PieceGraphPass)
    assert manager.must_run is False


@pytest.mark.parametrize("proto", [PieceStore, PieceGraphPass])
def test_a_plain_object_is_refused(proto):
    assert not isinstance(object(), proto)
