"""What travels to the lent GPU machine: every third-party package the project and its tests
import is on the GPU image or in the bundle (`make gpu-bundle`), the bundle is pure Python,
and scripts/gpu_env.sh puts the tree and the bundle on the path, offline."""

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("framework", "backends", "passes", "models", "experiments", "tests", "scripts")
OPTIONAL = {
    "mlflow",
    "submitit",
    "hydra_plugins.hydra_submitit_launcher",
    "importlinter",
    "llama_cpp",
    "ctranslate2",
    "gguf",
}
"""Imported only where present (``pytest.importorskip`` or a guarded import): CPU-side extras
(experiment tracking, the Slurm launcher, the ``peers`` extra of the llama.cpp / CTranslate2
benchmarks) that the GPU check never reaches."""
SERVING = {"fastapi", "starlette", "uvicorn", "openai"}
"""The OpenAI-compatible server's stack (the ``serve`` extra): framework/serve,
experiments/bench/serve.py and tests/framework/serve only; the GPU check skips them (its dry
run does not import ``framework.serve``)."""

GPU_PYTHON = {"python_version": "3.12", "python_full_version": "3.12.3", "extra": ""}


def _names(path: Path) -> set[str]:
    lines = [line.split("#")[0] for line in path.read_text().splitlines()]
    return {n for line in lines for n in line.split()}


def _normalize(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _imported_modules() -> set[str]:
    found = set()
    for src in SOURCES:
        for path in (ROOT / src).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    found |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    found.add(node.module)
    return found


def test_every_imported_package_is_on_the_image_or_in_the_bundle():
    image = {_normalize(n) for n in _names(ROOT / "scripts" / "gpu_image_packages.txt")}
    bundle_lines = (ROOT / "scripts" / "gpu_bundle_requirements.txt").read_text().splitlines()
    bundle = {
        _normalize(re.split(r"[=<>!~ ]", line)[0])
        for line in bundle_lines
        if line.strip() and not line.startswith("#")
    }
    assert {"hydra-core", "omegaconf", "antlr4-python3-runtime"} <= bundle
    dists = importlib.metadata.packages_distributions()
    missing = {}
    for module in sorted(_imported_modules()):
        if any(module == o or module.startswith(o + ".") for o in OPTIONAL | SERVING):
            continue
        parts = module.split(".")
        if parts[0] == "hydra_plugins" and len(parts) > 1:  # a namespace: the plugin's own
            candidates = [_normalize(parts[1])]
        else:
            candidates = [_normalize(d) for d in dists.get(parts[0], []) if d != "piecewise"]
        for name in candidates:
            if name not in image and name not in bundle:
                missing.setdefault(name, module)
    assert not missing, f"imported but neither on the GPU image nor in the bundle: {missing}"


def test_bundle_needs_are_declared_by_its_packages():
    """The bundle installs with --no-deps: each bundled package's own requirements must be on
    the image or in the bundle too."""
    image = {_normalize(n) for n in _names(ROOT / "scripts" / "gpu_image_packages.txt")}
    lines = (ROOT / "scripts" / "gpu_bundle_requirements.txt").read_text().splitlines()
    bundle = [line.split("==")[0] for line in lines if line.strip() and not line.startswith("#")]
    have = image | {_normalize(b) for b in bundle}
    for dist in bundle:
        for text in importlib.metadata.requires(dist) or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate(GPU_PYTHON):
                continue  # an extra, or for another Python
            name = _normalize(req.name)
            assert name in have, f"{dist} needs {name}, which is neither on the image nor bundled"


def test_gpu_env_puts_tree_and_bundle_on_the_path_offline(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "bundled_probe.py").write_text("VALUE = 42\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_NO_INDEX")}
    env["PIECEWISE_GPU_BUNDLE"] = str(site)
    script = (
        f"source {ROOT}/scripts/gpu_env.sh && cd {tmp_path} && "
        f'{sys.executable} -c "import bundled_probe, framework.compat, os; '
        f"print(bundled_probe.VALUE, os.environ['PIP_NO_INDEX'], os.environ['HF_HUB_OFFLINE'])\""
    )
    proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["42", "1", "1"]


def test_gpu_env_says_when_the_bundle_is_missing(tmp_path):
    env = dict(os.environ, PIECEWISE_GPU_BUNDLE=str(tmp_path / "absent"))
    proc = subprocess.run(
        ["bash", "-c", f"source {ROOT}/scripts/gpu_env.sh && echo $PYTHONPATH"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0
    assert "make gpu-bundle" in proc.stderr
    assert proc.stdout.split(":")[0].strip() == str(ROOT)


def test_gpu_check_installs_nothing():
    text = (ROOT / "scripts" / "gpu_check.sh").read_text()
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in code if re.search(r"pip\S* install|-m venv", line)]
