"""Any callable is a pass: plain functions and plain classes, wrapped by passes/callable_pass.py,
named by import path or registry name; matches counted when reported; uuid from live code."""

import sys
import textwrap

import pytest
import torch

from framework.core.config import PassConfig
from passes.manager import PassManager
from passes.registry import PASSES, register_pass, resolve_pass

aten = torch.ops.aten

SOURCE = """
import torch

aten = torch.ops.aten


def double_neg(graph):
    n = 0
    for node in list(graph.nodes):
        arg = node.args[0] if node.args else None
        if node.target is aten.neg.default and getattr(arg, "target", None) is aten.neg.default:
            node.replace_all_uses_with(arg.args[0])
            graph.erase_node(node)
            n += 1
    graph.eliminate_dead_code()
    return n


class CountNegs:
    def __call__(self, graph):
        self.match_count = sum(1 for n in graph.nodes if n.target is aten.neg.default)


class WithContext:
    def __init__(self, context):
        self.context = context

    def __call__(self, graph):
        return 0


def silent(graph):
    pass
"""


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    """An outside package (not under the repo) with plain-callable passes."""
    pkg = tmp_path / "outside_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "negs.py").write_text(textwrap.dedent(SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield pkg / "negs.py"
    for name in [m for m in sys.modules if m.startswith("outside_pkg")]:
        del sys.modules[name]


def _graph():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(aten.neg.default, (x,))
    b = g.call_function(aten.neg.default, (a,))
    g.output(g.call_function(aten.mul.Tensor, (b, b)))
    return g


def _run(names):
    pm = PassManager(PassConfig(passes=names, warn_on_no_match=False))
    g = _graph()
    pm(g)
    return pm, g


def test_function_and_classes_are_applied_and_counted(plugin_module):
    pm, g = _run(
        [
            "outside_pkg.negs:CountNegs",
            "outside_pkg.negs:double_neg",
            "outside_pkg.negs:WithContext",
            "outside_pkg.negs:silent",
        ]
    )
    assert not any(n.target is aten.neg.default for n in g.nodes)  # double_neg rewrote it
    stats = pm.stats()
    assert stats["outside_pkg.negs:double_neg"]["total_matches"] == 1
    assert stats["outside_pkg.negs:CountNegs"]["total_matches"] == 2  # ran first: 2 negs
    assert stats["outside_pkg.negs:WithContext"]["total_matches"] == 0
    silent = stats["outside_pkg.negs:silent"]
    assert silent["total_matches"] is None and silent["matches_reported"] is False
    assert silent["status"] == "ran"


def test_uuid_follows_the_callables_code(plugin_module):
    import importlib

    first = resolve_pass("outside_pkg.negs:double_neg")().uuid()
    assert resolve_pass("outside_pkg.negs:double_neg")().uuid() == first  # stable
    plugin_module.write_text(plugin_module.read_text().replace("n += 1", "n += 2"))
    importlib.reload(sys.modules["outside_pkg.negs"])
    assert resolve_pass("outside_pkg.negs:double_neg")().uuid() != first


def test_a_registered_plain_function_is_usable_by_name():
    @register_pass("test_plain_fn_pass")
    def plain(graph):
        return 7

    try:
        assert plain(None) == 7  # the decorated function itself is unchanged
        pm, _ = _run(["test_plain_fn_pass"])
        assert pm.stats()["test_plain_fn_pass"]["total_matches"] == 7
    finally:
        PASSES._entries.pop("test_plain_fn_pass", None)


def test_not_callable_is_refused_by_name(plugin_module):
    (plugin_module.parent / "bad.py").write_text("NOT_A_PASS = 3\n")
    with pytest.raises(ValueError, match="outside_pkg.bad:NOT_A_PASS.*neither"):
        resolve_pass("outside_pkg.bad:NOT_A_PASS")
