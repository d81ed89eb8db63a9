import importlib
import logging
import os
import sys
import textwrap

import pytest
import torch
from graph_test_backend import TestBackend, compile_with, count_op
from oot_pass_example import SubToAddNeg

from framework.core.config import PassConfig
from passes.manager import PassManager

aten = torch.ops.aten
OOT = "oot_pass_example:SubToAddNeg"


def manager(*names, **kwargs):
    return PassManager(PassConfig(passes=list(names)), **kwargs)


def test_uuid_is_stable_for_the_same_config():
    a = manager("noop_elimination", "fuse_add_rmsnorm", dtype=torch.bfloat16)
    b = manager("noop_elimination", "fuse_add_rmsnorm", dtype=torch.bfloat16)
    assert a.uuid() == b.uuid() == a.cache_uuid()
    # Flags that do not change the produced graph do not change the key.
    c = PassManager(
        PassConfig(passes=["noop_elimination", "fuse_add_rmsnorm"], warn_on_no_match=False),
        dtype=torch.bfloat16,
    )
    assert c.uuid() == a.uuid()


def test_uuid_changes_with_pass_list_and_config():
    base = manager("noop_elimination", "fuse_add_rmsnorm", dtype=torch.bfloat16)
    assert manager("noop_elimination", dtype=torch.bfloat16).uuid() != base.uuid()
    assert (
        manager("noop_elimination", "fuse_add_rmsnorm", dtype=torch.float32).uuid() != base.uuid()
    )
    assert (
        manager(
            "noop_elimination", "fuse_add_rmsnorm", dtype=torch.bfloat16, quant_config_hash="abc"
        ).uuid()
        != base.uuid()
    )


def test_uuid_follows_the_code_that_runs_not_the_file(tmp_path, monkeypatch):
    """An edit on disk without a reload leaves the running code, hence the uuid, unchanged
    (else artifacts built by the old code would be stored under the new code's key); the
    reloaded module gets a new uuid; a comment-only edit changes no code and no uuid."""
    src = tmp_path / "my_tmp_pass_mod.py"
    src.write_text(
        textwrap.dedent("""
        from passes.base import GraphPass

        class MyPass(GraphPass):
            def __call__(self, graph):
                self.match_count = 0
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        first = manager("my_tmp_pass_mod:MyPass").uuid()
        assert manager("my_tmp_pass_mod:MyPass").uuid() == first
        src.write_text(src.read_text().replace("= 0", "= 1"))
        assert manager("my_tmp_pass_mod:MyPass").uuid() == first  # old code still runs
        importlib.reload(sys.modules["my_tmp_pass_mod"])
        changed = manager("my_tmp_pass_mod:MyPass").uuid()
        assert changed != first
        src.write_text(src.read_text() + "\n# a comment\n")
        importlib.reload(sys.modules["my_tmp_pass_mod"])
        assert manager("my_tmp_pass_mod:MyPass").uuid() == changed
    finally:
        sys.modules.pop("my_tmp_pass_mod", None)


DOC_SOURCE = '''
"""Module docstring {v}."""
import torch
from passes.base import GraphPass


def helper(graph):
    """Helper docstring {v}."""
    def inner(n):
        """Nested docstring {v}."""
        return n.op == "call_function" and n.target is None
    return [n for n in graph.nodes if inner(n)]


class MyPass(GraphPass):
    """Class docstring {v}."""

    FACTOR = {factor}

    def __call__(self, graph):
        """Method docstring {v}."""
        self.match_count = len(helper(graph)) * self.FACTOR
'''


def test_docstring_edits_keep_the_uuid_code_edits_change_it(tmp_path, monkeypatch):
    """Docstrings are not code: editing any of them (module, class, method, function, nested
    function) keeps the cache key, so the artifacts still load; editing a constant changes it."""
    src = tmp_path / "my_doc_pass_mod.py"
    monkeypatch.syspath_prepend(str(tmp_path))

    def uuid_of(v: str, factor: int) -> str:
        src.write_text(DOC_SOURCE.format(v=v, factor=factor))
        if "my_doc_pass_mod" in sys.modules:
            importlib.reload(sys.modules["my_doc_pass_mod"])
        return manager("my_doc_pass_mod:MyPass").uuid()

    try:
        first = uuid_of("one", 1)
        assert uuid_of("two, now much longer and with 'quotes'", 1) == first
        assert uuid_of("two", 2) != first
    finally:
        sys.modules.pop("my_doc_pass_mod", None)


def test_oot_pass_by_import_path_is_applied_counted_and_keyed():
    pm = manager("noop_elimination", OOT, "fix_functionalization")
    assert manager("noop_elimination", "fix_functionalization").uuid() != pm.uuid()
    backend = TestBackend(pm)

    def f(a, b):
        return (a - b) * 3

    a, b = torch.randn(4, 8), torch.randn(4, 8)
    out = compile_with(f, backend, a, b)
    torch.testing.assert_close(out, f(a, b))
    assert count_op(backend.graph_before, aten.sub.Tensor) == 1
    assert count_op(backend.graph_after, aten.sub.Tensor) == 0
    assert count_op(backend.graph_after, aten.neg.default) == 1
    stats = pm.stats()
    assert list(stats) == ["noop_elimination", OOT, "fix_functionalization"]
    assert stats[OOT]["total_matches"] == 1
    assert stats[OOT]["pieces"][0]["time_s"] >= 0


class _Range:
    def __init__(self, start, end):
        self.start, self.end = start, end


def test_records_per_piece_dump_and_eager_path(tmp_path):
    pm = manager(OOT, debug_dump_path=str(tmp_path))
    assert pm.uuid() != pm.uuid()  # dumping: every compile misses Inductor's cache
    for piece in ("submod_0", "submod_2"):
        pm.set_current_piece(piece, _Range(1, 16))
        gm = torch.fx.experimental.proxy_tensor.make_fx(lambda a, b: (a - b) * 2)(
            torch.randn(3), torch.randn(3)
        )
        gm = pm.run_on_graph_module(gm)
        a, b = torch.randn(3), torch.randn(3)
        torch.testing.assert_close(gm(a, b), (a - b) * 2)
    pieces = pm.stats()[OOT]["pieces"]
    assert [(p["piece"], p["compile_range"], p["matches"]) for p in pieces] == [
        ("submod_0", (1, 16), 1),
        ("submod_2", (1, 16), 1),
    ]
    dump = tmp_path / "passes" / "submod_2" / "range_1-16"
    files = sorted(os.listdir(dump))
    assert files == ["00_before_passes.txt", "01_after_oot_pass_example_SubToAddNeg.txt"]
    assert "aten.sub.Tensor" in (dump / files[0]).read_text()
    assert "aten.sub.Tensor" not in (dump / files[1]).read_text()


class OnlyLarge(SubToAddNeg):
    def is_applicable(self, compile_range):
        return compile_range is None or compile_range.start > 8


def test_is_applicable_skips_a_pass_for_a_range():
    pm = manager(f"{__name__}:OnlyLarge")
    for rng in (_Range(1, 8), _Range(9, 64)):
        pm.set_current_piece("p", rng)
        pm.run_on_graph_module(
            torch.fx.experimental.proxy_tensor.make_fx(lambda a, b: a - b)(
                torch.randn(2), torch.randn(2)
            )
        )
    assert [p["compile_range"] for p in pm.stats()[f"{__name__}:OnlyLarge"]["pieces"]] == [(9, 64)]


def test_status_is_shown_per_range():
    """The backend reports each (piece, range); a pass its is_applicable refused on a range
    says "skipped" there, and a loaded range says so."""
    name = f"{__name__}:OnlyLarge"
    pm = manager(name)
    for rng in (_Range(1, 8), _Range(9, 64)):
        pm.set_current_piece("p", rng)
        pm.run_on_graph_module(
            torch.fx.experimental.proxy_tensor.make_fx(lambda a, b: a - b)(
                torch.randn(2), torch.randn(2)
            )
        )
        pm.piece_done("p", rng, "compiled")
    pm.piece_done("p", _Range(4, 4), "loaded")
    stats = pm.stats()[name]
    assert stats["status_by_range"] == {
        "range_1-8": "skipped",
        "range_4-4": "not run: artifact loaded",
        "range_9-64": "ran",
    }
    assert stats["status"] == (
        "skipped on range_1-8; not run: artifact loaded on range_4-4; ran on range_9-64"
    )
    every = manager(name)
    every.piece_done("p", _Range(1, 8), "loaded")
    assert every.stats()[name]["status"] == "not run: artifact loaded"


def test_warn_unmatched_names_the_fusion(caplog):
    pm = manager("noop_elimination", "fuse_add_rmsnorm", dtype=torch.float32)
    assert pm.warn_unmatched() == []  # nothing ran yet (e.g. every piece came from the cache)
    pm.run_on_graph_module(
        torch.fx.experimental.proxy_tensor.make_fx(lambda a: a * 2)(torch.randn(2))
    )
    with caplog.at_level(logging.WARNING, logger="passes.manager"):
        assert pm.warn_unmatched() == ["fuse_add_rmsnorm"]  # noop_elimination is no fusion
    assert "fuse_add_rmsnorm is enabled but matched nothing" in caplog.text


def test_unresolved_config_is_a_clear_error():
    with pytest.raises(ValueError, match="PassConfig.passes is None"):
        PassManager(PassConfig())
