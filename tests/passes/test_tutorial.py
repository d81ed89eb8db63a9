"""The tutorial of passes/README.md, run as written: its files are written and its commands
run in order in a fresh folder; each step's ``<!-- expect: REGEX -->`` comments must match its
output, in order; a ``bash tutorial-fails`` step must fail (the broken pass)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "passes" / "README.md"
FENCE = re.compile(
    r"^```(?P<info>[^\n]*)\n(?P<body>.*?)^```\n(?P<after>(?:<!-- expect: [^\n]* -->\n)*)",
    re.M | re.S,
)


def tutorial_steps() -> list[dict]:
    text = README.read_text()
    start = text.index("## Tutorial:")
    section = text[start : text.index("\n## ", start + 1)]
    steps = []
    for m in FENCE.finditer(section):
        info = m["info"].split()
        expects = re.findall(r"<!-- expect: ([^\n]*) -->", m["after"])
        if info[:1] == ["python"] and len(info) > 1 and info[1].startswith("file="):
            steps.append({"file": info[1][len("file=") :], "body": m["body"]})
        elif info[:2] in (["bash", "tutorial"], ["bash", "tutorial-fails"]):
            fails = info[1] == "tutorial-fails"
            steps.append({"run": m["body"], "fails": fails, "expects": expects})
    return steps


def test_the_tutorial_has_every_step():
    steps = tutorial_steps()
    runs = [s for s in steps if "run" in s]
    assert {s["file"] for s in steps if "file" in s} == {
        "mylab/__init__.py",
        "mylab/swap.py",
        "mylab/broken.py",
    }
    assert len(runs) == 5 and [s["fails"] for s in runs].count(True) == 1
    assert all(s["expects"] for s in runs)
    text = " ".join(s["run"] for s in runs)
    for needle in ("passes=[+mylab.swap:swap_add]", "experiment=ablate_passes",
                   "experiments.report", "verify_passes=true", "cache_dir=pw_cache"):  # fmt: skip
        assert needle in text


@pytest.mark.slow  # reason: about eight Inductor compiles of the test model in fresh processes
def test_the_tutorial_runs_as_written(tmp_path):
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]),
        OMP_NUM_THREADS="1",
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    )
    for step in tutorial_steps():
        if "file" in step:
            path = tmp_path / step["file"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(step["body"])
            continue
        proc = subprocess.run(
            ["bash", "-c", ("" if step["fails"] else "set -e\n") + step["run"]],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
        out = proc.stdout + proc.stderr
        if step["fails"]:
            assert proc.returncode != 0, out[-3000:]
        else:
            assert proc.returncode == 0, out[-5000:]
        pos = 0
        for expect in step["expects"]:
            m = re.compile(expect).search(out, pos)
            assert m, (
                f"step {step['run'][:60]!r}: no {expect!r} after offset {pos} in\n{out[-4000:]}"
            )
            pos = m.end()
