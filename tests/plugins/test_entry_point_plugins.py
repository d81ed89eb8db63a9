"""Plugins from an installed package: a tiny package declaring the entry-point groups
``piecewise.passes``, ``piecewise.models``, ``piecewise.attention_backends`` and
``piecewise.compilers`` is built and pip-installed (offline, ``--no-build-isolation``, into a
temporary target folder put on ``PYTHONPATH``: the test venv stays untouched), then a fresh
process runs an LLM that uses each kind by its name, with no import path. A second entry point
of the package is broken: it is reported by name and the rest load."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PYPROJECT = """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "piecewise-demo-plugin"
version = "0.1.0"

[tool.setuptools]
packages = ["pwdemo"]

[project.entry-points."piecewise.passes"]
demo_count_adds = "pwdemo.passes:count_adds"
demo_broken = "pwdemo.broken:nothing"

[project.entry-points."piecewise.models"]
DemoForCausalLM = "pwdemo.models"

[project.entry-points."piecewise.attention_backends"]
demo_attention = "pwdemo.attention:DemoAttention"

[project.entry-points."piecewise.compilers"]
demo_compiler = "pwdemo.compiler:DemoCompiler"
"""

FILES = {
    "__init__.py": "CALLS = {'pass': 0, 'attention': 0, 'compile': 0, 'model': 0}\n",
    "passes.py": """
        import torch
        import pwdemo

        def count_adds(graph):  # a plain function: no base class
            pwdemo.CALLS["pass"] += 1
            return sum(n.target is torch.ops.aten.add.Tensor for n in graph.nodes)
    """,
    "broken.py": "raise RuntimeError('this plugin is broken on purpose')\n",
    "models.py": """
        import pwdemo
        from models.decoder import DecoderForCausalLM
        from models.family import FamilyTraits, register_model

        @register_model("DemoForCausalLM", FamilyTraits("llama"))
        class DemoForCausalLM(DecoderForCausalLM):
            def __init__(self, *args, **kwargs):
                pwdemo.CALLS["model"] += 1
                super().__init__(*args, **kwargs)
    """,
    "attention.py": """
        import pwdemo
        from backends.attention.torch_paged import TorchPagedAttention

        class DemoAttention(TorchPagedAttention):
            @staticmethod
            def forward(*args):
                pwdemo.CALLS["attention"] += 1
                return TorchPagedAttention.forward(*args)
    """,
    "compiler.py": """
        import pwdemo
        from backends.piecewise.compiler import Eager

        class DemoCompiler(Eager):
            def compile(self, graph, example_inputs, compile_range):
                pwdemo.CALLS["compile"] += 1
                return super().compile(graph, example_inputs, compile_range)
    """,
}

SCRIPT = """
import json, sys
import pwdemo
from framework.core.config import CompilationConfig, PassConfig
from framework.engine.llm import LLM
from passes.registry import PASSES

cc = CompilationConfig(
    level=2,
    compiler="demo_compiler",
    use_cache=False,
    pass_config=PassConfig(passes=["noop_elimination", "demo_count_adds"]),
)
llm = LLM(sys.argv[1], compilation_config=cc, attention_backend="demo_attention", max_num_seqs=2)
out = llm.generate([[1, 2, 3, 4]], max_new_tokens=3, ignore_eos=True)
try:
    PASSES.get("demo_broken")
    broken = "loaded?!"
except KeyError as e:
    broken = str(e)
print("RESULT", json.dumps({
    "calls": pwdemo.CALLS,
    "tokens": out[0],
    "pass_stats": llm.stats["passes"]["demo_count_adds"]["total_matches"],
    "plugin_errors": PASSES.plugin_errors,
    "broken": broken,
}))
"""


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory):
    base = tmp_path_factory.mktemp("plugin")
    src = base / "src"
    (src / "pwdemo").mkdir(parents=True)
    (src / "pyproject.toml").write_text(PYPROJECT)
    for name, text in FILES.items():
        (src / "pwdemo" / name).write_text(textwrap.dedent(text))
    target = base / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
         "--no-build-isolation", "--target", str(target), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    shutil.rmtree(src)  # the installed copy is what runs
    assert list(target.glob("piecewise_demo_plugin-0.1.0.dist-info/entry_points.txt"))
    return target


@pytest.fixture(scope="module")
def demo_checkpoint(tmp_path_factory):
    from models.tiny import ensure_tiny_model

    src = Path(ensure_tiny_model(preset="test-llama"))
    dst = tmp_path_factory.mktemp("demo_model") / "demo"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["architectures"] = ["DemoForCausalLM"]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_installed_plugin_kinds_are_used_by_name(installed_plugin, demo_checkpoint, tmp_path):
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(installed_plugin), str(ROOT)]),
        OMP_NUM_THREADS="1",
    )
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(demo_checkpoint)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    calls = result["calls"]
    assert calls["model"] == 1  # the model class came from the plugin, by architecture name
    assert calls["compile"] > 0  # the compiler adaptor, by name
    assert calls["pass"] > 0  # the plain-function pass, by name
    assert calls["attention"] > 0  # the attention backend, by name
    assert result["pass_stats"] > 0  # residual adds counted
    assert len(result["tokens"]) == 3
    # the broken entry point is reported by name; the others loaded
    assert set(result["plugin_errors"]) == {"demo_broken"}
    assert "broken on purpose" in result["plugin_errors"]["demo_broken"]
    assert "demo_broken" in result["broken"] and "failed to load" in result["broken"]
    assert "demo_broken" in proc.stderr and "failed to load and is skipped" in proc.stderr
