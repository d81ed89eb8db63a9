"""scripts/gpu_check.sh without a GPU: its dry run collects exactly what the real run would,
in a process where no test module may have switched Triton to the interpreter."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def clean_env(**extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TRITON_INTERPRET", "PIECEWISE_GPU_CHECK", "OUT", "GPU_CHECK_OUT")
    }
    env.update(PYTHON=sys.executable, PYTHONPATH=str(ROOT), **extra)
    return env


def run(*args, env, timeout=600):
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow(reason="~17 s; the CI gpu-stack stage runs the same dry run on the image's stack")
def test_dry_run_collects_the_gpu_selection_with_compiled_triton(tmp_path):
    # $OUT (the device tool's folder that comes back) receives the table and the logs
    proc = run("--dry-run", env=clean_env(OUT=str(tmp_path)))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # one line with what it found, from the interpreter PYTHON names
    env_line = re.search(
        r"^gpu-check env: python (\S+) \((\S+)\), torch (\S+), CUDA .*, "
        r"GPU none \(dry run\), triton (\S+)$",
        proc.stdout,
        re.M,
    )
    assert env_line and env_line.group(2) == sys.executable, out[-4000:]
    imported = re.search(r"^imported (\d+) of (\d+) modules$", proc.stdout, re.M)
    assert imported and imported.group(1) == imported.group(2) and int(imported.group(1)) > 100
    assert (tmp_path / "env.txt").read_text().startswith("gpu-check env: python")
    assert "| check | result | detail |" in (tmp_path / "table.md").read_text()
    guard = re.search(
        r"gpu-check collection: (\d+) tests selected, TRITON_INTERPRET unset, "
        r"triton compiled: ok",
        out,
    )
    assert guard, out[-4000:]
    ids = set(re.findall(r"^(tests/\S+::\S+)$", proc.stdout, re.M))
    assert len(ids) == int(guard.group(1)) > 0
    # the CUDA-graph tests, the GPU-only attention test and the in-place kernel tests ...
    for expected in (
        "tests/framework/cudagraph/test_cudagraph.py::test_cuda_capture_and_replay",
        "tests/framework/cudagraph/test_graph_capture.py::test_graph_modes_give_identical_tokens_on_gpu",
        "tests/backends/attention/test_triton_paged.py::"
        "test_full_cuda_graph_replays_a_different_mix",
        "tests/passes/ops/test_triton_kernels.py::test_rms_norm_kernel",
        "tests/backends/attention/test_triton_paged.py::test_half_precision",
    ):
        assert expected in ids, expected
    # ... and none of the CPU-only ones (the interpreter reruns, the AOT compiles).
    assert not any("test_in_interpreter" in i or "sm90" in i for i in ids)
    assert (
        "tests: timeout 170 python -m pytest -q -p no:cacheprovider -m gpu or triton_kernel" in out
    )
    table = out[out.index("----- README table") : out.index("----- end README table")]
    assert "| check | result | detail |" in table
    assert '| pytest -m "gpu or triton_kernel" | not run (dry run) |  |' in table
    assert "| tensor parallel TP=2 vs TP=1 (O2) | not run (dry run) |  |" in table
    assert "| decode benchmark (bf16, bs 1/8/32) | not run (dry run) |  |" in table


def test_refuses_to_run_with_triton_interpret_set(tmp_path):
    proc = run(
        "--dry-run", env=clean_env(TRITON_INTERPRET="1", GPU_CHECK_OUT=str(tmp_path)), timeout=60
    )
    assert proc.returncode == 2
    assert "TRITON_INTERPRET is set" in proc.stderr


def test_rejects_unknown_arguments():
    proc = run("--fast", env=clean_env(), timeout=60)
    assert proc.returncode == 2 and "usage:" in proc.stderr


def test_collection_guard_catches_a_module_that_sets_the_interpreter(tmp_path):
    """What the guard is for: a test module setting TRITON_INTERPRET at import (as this
    suite once did) fails the GPU run at collection instead of running interpreted kernels."""
    bad = tmp_path / "test_sets_env.py"
    bad.write_text(
        "import os\nos.environ['TRITON_INTERPRET'] = '1'\n\ndef test_nothing():\n    pass\n"
    )
    env = clean_env(PIECEWISE_GPU_CHECK="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT)])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "conftest",
            "--rootdir",
            str(tmp_path),
            str(bad),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "GPU tests must run compiled Triton" in proc.stdout + proc.stderr


@pytest.mark.skipif(
    shutil.which("nvidia-smi") is not None or os.path.exists("/dev/nvidiactl"),
    reason="checks the no-GPU refusal",
)
def test_real_run_without_a_gpu_stops_and_installs_nothing(tmp_path):
    before = sorted(p.name for p in Path(sys.prefix, "lib").rglob("*.dist-info"))
    proc = run(env=clean_env(GPU_CHECK_OUT=str(tmp_path / "out")), timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cannot run the check" in proc.stderr and "nothing is installed" in proc.stderr
    assert re.search(r"CPU-only build|sees no GPU", proc.stdout)
    assert not (tmp_path / "out" / "tests.xml").exists()
    assert sorted(p.name for p in Path(sys.prefix, "lib").rglob("*.dist-info")) == before
