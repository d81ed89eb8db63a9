"""The artifact-cache key follows the code that runs: a pass edited on disk inside a running
process (no reload) keeps its old key, so nothing built by the old code is stored under the
key a fresh process computes for the new code."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from framework import LLM, CompilationConfig, PassConfig
from framework.cache.cli import scan_cache

ROOT = Path(__file__).resolve().parents[3]
PASS = "edited_pass_mod:ScaleFirstMul"
SOURCE = """
import torch
from passes.base import GraphPass

class ScaleFirstMul(GraphPass):
    # v1 leaves the graph alone; v2 scales the first mul by FACTOR (changes the numerics).
    FACTOR = {factor}

    def __call__(self, graph):
        self.match_count = 0
        if self.FACTOR == 1.0:
            return
        for node in graph.find_nodes(op="call_function", target=torch.ops.aten.mul.Tensor):
            with graph.inserting_after(node):
                scaled = graph.call_function(torch.ops.aten.mul.Tensor, (node, self.FACTOR))
            scaled.meta["val"] = node.meta.get("val")
            node.replace_all_uses_with(scaled, delete_user_cb=lambda u: u is not scaled)
            self.match_count = 1
            return
"""
FRESH = """
import json, sys
from framework import LLM, CompilationConfig, PassConfig
llm = LLM(sys.argv[1], max_model_len=64, optimization_level=2,
          compilation_config=CompilationConfig(progress_bar=False, cache_dir=sys.argv[2],
                                               pass_config=PassConfig(passes=["+" + sys.argv[3]])))
s = llm.stats
print(json.dumps({"dir": s["cache_dir"], "loads": s["compile_loads"],
                  "compiles": s["compile_compiles"], "out": llm.generate([[1, 2, 3]], 4)[0]}))
"""


def _build(checkpoint, cache_dir):
    return LLM(
        str(checkpoint),
        max_model_len=64,
        optimization_level=2,
        compilation_config=CompilationConfig(
            progress_bar=False, cache_dir=cache_dir, pass_config=PassConfig(passes=[f"+{PASS}"])
        ),
    )


@pytest.mark.slow(
    reason="two Inductor builds and a fresh interpreter (~1-2 min); the uuid "
    "rule itself is tested fast in tests/passes/test_manager.py"
)
def test_pass_edited_in_process_never_stores_under_the_new_code_key(
    llama_checkpoint, tmp_path, monkeypatch
):
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    src = src_dir / "edited_pass_mod.py"
    src.write_text(textwrap.dedent(SOURCE.format(factor=1.0)))
    monkeypatch.syspath_prepend(str(src_dir))
    cache = str(tmp_path / "cache")
    try:
        first = _build(llama_checkpoint, cache)
        assert first.stats["compile_compiles"] > 0
        out_v1 = first.generate([[1, 2, 3]], 4)[0]
        src.write_text(textwrap.dedent(SOURCE.format(factor=3.0)))  # edit, no reload
        second = _build(llama_checkpoint, cache)
        # the v1 code still runs here: same key, its artifacts are reused, no new key appears
        assert second.stats["cache_dir"] == first.stats["cache_dir"]
        assert second.stats["compile_compiles"] == 0
        assert second.generate([[1, 2, 3]], 4)[0] == out_v1
    finally:
        sys.modules.pop("edited_pass_mod", None)
    # One compile-cache key (the processed-weights cache, <cache>/weights, is not one).
    keys = scan_cache(Path(cache))
    assert len(keys) == 1 and keys[0].path in Path(first.stats["cache_dir"]).parents

    # A fresh process imports v2: a different key, nothing to load, v2's own numerics.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(src_dir), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", FRESH, str(llama_checkpoint), cache, PASS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh = json.loads(proc.stdout.strip().splitlines()[-1])
    assert fresh["dir"] != first.stats["cache_dir"]
    assert fresh["loads"] == 0 and fresh["compiles"] > 0
    assert fresh["out"] != out_v1  # v2 really ran (v1's artifacts would give out_v1)
