#!/usr/bin/env bash
# One command for a fresh CUDA machine (`make gpu-check`): set up Python, run the GPU tests,
# run the decode benchmark (eager / PIECEWISE / FULL_AND_PIECEWISE / transformers with
# torch.compile(mode="reduce-overhead"), batch 1/8/32, bf16) and print its table.
# Budget: under 8 minutes (tests <= 2.5 min, benchmark <= 4.5 min, enforced with `timeout`;
# a torch download on a bare machine comes on top).
#
# torch: the Makefile's .venv pins the CPU wheel, so this script uses its own venv, created
# with --system-site-packages: a CUDA build of torch that the machine already has (the usual
# GPU image) is reused as is.  Only when no CUDA-capable torch is importable does it run
# `pip install "torch>=2.13,<2.15"`, whose default Linux x86_64 wheel on PyPI is the CUDA
# build (it bundles the CUDA runtime; only the driver must be present).  The other
# dependencies come from pyproject.toml; on an offline machine whose Python already has them,
# a failed install is reported and the run goes on from the source tree.
#
# Environment: PIECEWISE_GPU_VENV (default .cache/gpu-venv), PYTHON (default python3),
# GPU_CHECK_TEST_TIMEOUT / GPU_CHECK_BENCH_TIMEOUT (seconds), BENCH_ARGS (extra arguments).
set -uo pipefail
cd "$(dirname "$0")/.."

VENV=${PIECEWISE_GPU_VENV:-.cache/gpu-venv}
PYTHON=${PYTHON:-python3}
TEST_TIMEOUT=${GPU_CHECK_TEST_TIMEOUT:-150}
BENCH_TIMEOUT=${GPU_CHECK_BENCH_TIMEOUT:-270}
START=$(date +%s)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

step() { printf '\n=== %s (%ss) ===\n' "$1" "$(( $(date +%s) - START ))"; }

step "python environment"
if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "warning: nvidia-smi not found; is this a CUDA machine?"
else
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
fi
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv --system-site-packages "$VENV" || { echo "cannot create $VENV"; exit 2; }
fi
PY="$VENV/bin/python"

cuda_torch() {
    "$PY" - <<'EOF'
import sys
try:
    import torch
except ImportError:
    sys.exit(1)
ok = torch.cuda.is_available() and torch.version.cuda is not None
print(f"torch {torch.__version__} cuda={torch.version.cuda} available={torch.cuda.is_available()}")
sys.exit(0 if ok else 1)
EOF
}

if ! cuda_torch; then
    echo "no CUDA-capable torch importable: installing the PyPI CUDA build"
    "$PY" -m pip install -q "torch>=2.13,<2.15" || echo "warning: torch install failed"
    cuda_torch || { echo "error: torch cannot see a GPU; check the driver (nvidia-smi)"; exit 2; }
fi

# Keep the torch found above: install the project without letting pip swap torch for another
# build, then its remaining dependencies.
if ! "$PY" -m pip install -q --no-deps -e '.[dev]' 2>/tmp/gpu_check_pip.log; then
    echo "warning: pip install -e . failed (offline?); running from the source tree"
fi
"$PY" - <<'EOF'
import importlib.util, subprocess, sys
need = {"transformers": "transformers>=5.0,<6", "safetensors": "safetensors>=0.4",
        "triton": "triton>=3.0", "pytest": "pytest>=8", "numpy": "numpy",
        "filelock": "filelock>=3.12", "tqdm": "tqdm>=4.60", "hydra": "hydra-core>=1.3,<1.4",
        "omegaconf": "omegaconf>=2.3,<2.4", "depyf": "depyf>=0.18",
        "matplotlib": "matplotlib>=3.7"}
missing = [spec for mod, spec in need.items() if importlib.util.find_spec(mod) is None]
if missing:
    print("installing:", " ".join(missing))
    rc = subprocess.call([sys.executable, "-m", "pip", "install", "-q", *missing])
    if rc:
        print("warning: could not install", missing)
core = ["torch", "transformers", "safetensors", "triton", "pytest"]
absent = [m for m in core if importlib.util.find_spec(m) is None]
if absent:
    sys.exit(f"error: required packages missing: {absent}")
EOF
[ $? -eq 0 ] || exit 2

step "GPU tests (timeout ${TEST_TIMEOUT}s)"
# Everything marked gpu, then the Triton attention tests (unmarked: on CPU they run in the
# interpreter, here the compiled kernels run on the GPU).
timeout "$TEST_TIMEOUT" bash -c '"$0" -m pytest -q -m gpu -p no:cacheprovider tests &&
    "$0" -m pytest -q -p no:cacheprovider tests/backends/attention/test_triton_paged.py' "$PY"
TEST_RC=$?
[ $TEST_RC -eq 124 ] && echo "GPU tests timed out after ${TEST_TIMEOUT}s"

step "decode benchmark (timeout ${BENCH_TIMEOUT}s)"
mkdir -p outputs
# shellcheck disable=SC2086
timeout "$BENCH_TIMEOUT" "$PY" -m experiments.gpu_decode_bench --batch-sizes 1 8 32 \
    --dtype bfloat16 --out outputs/gpu_decode_bench.json ${BENCH_ARGS:-}
BENCH_RC=$?
[ $BENCH_RC -eq 124 ] && echo "benchmark timed out after ${BENCH_TIMEOUT}s"

step "done"
echo "tests rc=$TEST_RC  benchmark rc=$BENCH_RC  (results: outputs/gpu_decode_bench.json)"
[ $TEST_RC -eq 0 ] && [ $BENCH_RC -eq 0 ]
