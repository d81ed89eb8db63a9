"""``python -m passes.scaffold NAME`` writes a working pass and a passing test from its template."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from passes.scaffold import main, module_name_for, scaffold

ROOT = Path(__file__).resolve().parents[2]


def test_scaffold_writes_a_pass_whose_own_test_passes(tmp_path):
    pkg = tmp_path / "mylab"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    assert main(["drop_mul_one", "--out", str(pkg)]) == 0
    assert module_name_for(pkg, "drop_mul_one") == "mylab.drop_mul_one"
    text = (pkg / "drop_mul_one.py").read_text()
    assert "def drop_mul_one(graph" in text and "passes=[+mylab.drop_mul_one:drop_mul_one]" in text
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(pkg)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 passed" in proc.stdout


def test_scaffold_makes_the_out_folder_a_package_as_in_the_tutorial(tmp_path, capsys):
    """``python -m passes.scaffold swap_add --out mylab`` (the tutorial's layout): mylab becomes a
    package and the printed import path is mylab.swap_add, importable from mylab's parent."""
    out = tmp_path / "mylab"
    assert main(["swap_add", "--out", str(out)]) == 0
    assert (out / "__init__.py").is_file()
    printed = capsys.readouterr().out
    assert "passes=[+mylab.swap_add:swap_add]" in printed
    assert f"PYTHONPATH={tmp_path}:" in printed
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from passes.registry import resolve_pass; "
            "print(resolve_pass('mylab.swap_add:swap_add').name)",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "mylab.swap_add:swap_add" in proc.stdout


def test_scaffold_refuses_to_overwrite_and_bad_names(tmp_path, capsys):
    scaffold("p", tmp_path)
    with pytest.raises(FileExistsError, match="not overwriting"):
        scaffold("p", tmp_path)
    assert main(["not-an-identifier", "--out", str(tmp_path)]) == 2
    assert "not a valid Python identifier" in capsys.readouterr().err
