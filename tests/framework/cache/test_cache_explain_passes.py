"""`python -m framework.cache explain` names the pass whose uuid differs between two keys."""

import importlib
import sys
import textwrap

from framework.cache.cli import main
from framework.cache.store import ArtifactStore
from framework.core.config import PassConfig
from passes.manager import PassManager

PASS_V1 = """
from passes.base import GraphPass

class Edited(GraphPass):
    def __call__(self, graph):
        self.match_count = {count}
"""


def _factors(names):
    return {"passes": PassManager(PassConfig(passes=names)).cache_factors(), "dtype": "float32"}


def test_explain_names_the_pass_whose_code_differs(tmp_path, monkeypatch, capsys):
    src = tmp_path / "explain_edited_pass.py"
    src.write_text(textwrap.dedent(PASS_V1.format(count=0)))
    monkeypatch.syspath_prepend(str(tmp_path))
    names = ["noop_elimination", "explain_edited_pass:Edited", "fix_functionalization"]
    try:
        old = ArtifactStore.open(tmp_path / "cache", _factors(names))
        src.write_text(textwrap.dedent(PASS_V1.format(count=1)))
        importlib.reload(sys.modules["explain_edited_pass"])
        new = ArtifactStore.open(tmp_path / "cache", _factors(names))
        added = ArtifactStore.open(tmp_path / "cache", _factors(names + ["prepack_linear"]))
    finally:
        sys.modules.pop("explain_edited_pass", None)
    assert old.key != new.key
    assert main(["explain", str(tmp_path / "cache"), old.key, new.key]) == 0
    out = capsys.readouterr().out
    assert "1 factor(s) differ" in out
    assert (
        "passes.uuid.explain_edited_pass:Edited (pass 'explain_edited_pass:Edited': its "
        "code or its config differs)"
    ) in out
    assert "noop_elimination" not in out  # the unchanged passes are not blamed

    assert main(["explain", str(tmp_path / "cache"), new.key, added.key]) == 0
    out = capsys.readouterr().out
    assert "passes.uuid.prepack_linear (pass 'prepack_linear' runs only in B)" in out
    assert "passes.order" in out
