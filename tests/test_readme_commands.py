"""A newcomer's path through the READMEs, checked: the top-level README's two commands, the
links to every area's README, and each README's commands as written.

* every ``python -m NAME`` of the project in any README names a module (or a package with a
  ``__main__``) that exists, and every ``make TARGET`` a target of the Makefile;
* ``make run`` and ``make test`` are what the README says (``make -n``), and ``make run`` runs
  as written (slow: one O2 compile of the tiny model);
* every relative link of every README points at a file that exists;
* each ```` ```bash check ```` block of a README runs as written in the project root, and its
  ``<!-- expect: REGEX -->`` comments match its output in order (the pattern of the passes
  tutorial's test, ``tests/passes/test_tutorial.py``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.report.readme_tables import readme_files

ROOT = Path(__file__).resolve().parents[1]
READMES = readme_files(ROOT)
PROJECT = ("framework", "backends", "passes", "models", "experiments")
FENCE = re.compile(
    r"^```(?P<info>[^\n]*)\n(?P<body>.*?)^```\n(?P<after>(?:<!-- expect: [^\n]* -->\n)*)",
    re.M | re.S,
)
PYTHON_M = re.compile(r"python -m ([A-Za-z_][\w.]*)")
MAKE = re.compile(r"(?:^|`)make ([a-z][\w-]*)", re.M)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _env() -> dict[str, str]:
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        OMP_NUM_THREADS="1",
    )


def check_blocks() -> list[tuple[str, str, list[str]]]:
    """(README relative path, the block's commands, its expect patterns) of every check block."""
    out = []
    for path in READMES:
        for m in FENCE.finditer(path.read_text(encoding="utf-8")):
            if m["info"].split() == ["bash", "check"]:
                expects = re.findall(r"<!-- expect: ([^\n]*) -->", m["after"])
                out.append((str(path.relative_to(ROOT)), m["body"], expects))
    return out


def test_the_path_starts_at_the_readme_and_links_every_area():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "make run" in text and "make test" in text
    linked = {(ROOT / link).resolve() for link in LINK.findall(text)}
    areas = [p.resolve() for p in READMES if p.parent != ROOT]
    assert len(areas) >= 7, areas
    assert not [p for p in areas if p not in linked], "area READMEs the README does not link"


def test_every_relative_link_of_every_readme_exists():
    broken = []
    for path in READMES:
        for link in LINK.findall(path.read_text(encoding="utf-8")):
            if "://" in link or link.startswith("mailto:"):
                continue
            if not (path.parent / link).exists():
                broken.append(f"{path.relative_to(ROOT)}: {link}")
    assert not broken, broken


def test_every_python_m_and_make_target_in_a_readme_exists():
    targets = set(
        re.search(r"^\.PHONY: (.*)$", (ROOT / "Makefile").read_text(), re.M).group(1).split()
    )
    missing = []
    for path in READMES:
        text = path.read_text(encoding="utf-8")
        for name in sorted(set(PYTHON_M.findall(text))):
            name = name.rstrip(".")
            if name.split(".")[0] not in PROJECT:
                continue
            spec = importlib.util.find_spec(name)
            runnable = spec is not None and (
                spec.submodule_search_locations is None
                or importlib.util.find_spec(name + ".__main__") is not None
            )
            if not runnable:
                missing.append(f"{path.relative_to(ROOT)}: python -m {name}")
        for target in sorted(set(MAKE.findall(text))):
            if target not in targets:
                missing.append(f"{path.relative_to(ROOT)}: make {target}")
    assert not missing, missing


def _make_dry_run(target: str) -> list[str]:
    stamp = ".venv/.installed"
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    proc = subprocess.run(
        ["make", "--no-print-directory", "-n", "-o", stamp, target],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_make_run_and_make_test_are_what_the_readme_says():
    assert _make_dry_run("run") == [".venv/bin/python -m experiments.run "]
    test = "\n".join(_make_dry_run("test"))
    for command in ("lint-imports", "ruff check .", "ruff format --check .", "-m pytest"):
        assert command in test, test
    assert '-m "not slow"' in test


def test_the_readmes_have_check_blocks():
    where = {path for path, _, _ in check_blocks()}
    assert {"experiments/README.md", "experiments/bench/README.md"} <= where, where
    assert all(expects for _, _, expects in check_blocks())


@pytest.mark.slow  # reason: each block starts a few Python processes that import torch
@pytest.mark.parametrize("readme,body,expects", check_blocks(), ids=lambda v: str(v)[:40])
def test_check_block_runs_as_written(readme, body, expects):
    proc = subprocess.run(
        ["bash", "-c", "set -e\n" + body],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{readme}:\n{out[-4000:]}"
    pos = 0
    for expect in expects:
        m = re.compile(expect).search(out, pos)
        assert m, f"{readme}: no {expect!r} after offset {pos} in\n{out[-4000:]}"
        pos = m.end()


@pytest.mark.slow  # reason: the README's `make run` compiles the tiny model at O2 (~20-60 s)
def test_make_run_runs_as_written(tmp_path):
    """``make run`` with this interpreter's environment as the Makefile's venv (so nothing is
    installed), in a copy-free way: Hydra's output folder goes to ``tmp_path``."""
    bin_dir = str(Path(sys.executable).parent)
    proc = subprocess.run(
        ["make", "-o", ".venv/.installed", "run", f"BIN={bin_dir}",
         f"ARGS=hydra.run.dir={tmp_path}/run cache_dir={tmp_path}/cache"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "generated tokens agree with eager (O0): yes" in out, out[-4000:]
    assert (tmp_path / "run" / "results.json").is_file()
    assert (tmp_path / "run" / "run.log").is_file()  # the job keeps its name (conf/config.yaml)


def test_the_ablation_table_counts_the_registered_passes():
    """experiments/README.md: ablate_passes runs one job per registered pass plus the baseline."""
    from passes.registry import BUILTIN_MODULES

    text = (ROOT / "experiments" / "README.md").read_text(encoding="utf-8")
    n = len(BUILTIN_MODULES)
    assert f"({n + 1} with the {n} built-ins)" in text
