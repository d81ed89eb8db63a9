#!/usr/bin/env bash
# The GPU check, for the lent GPU machine (`make gpu-check`; scripts/README.md gives the
# device `run` call).  That machine's python3 is Python 3.12 with torch 2.11 (CUDA 13.0) and
# Triton 3.6, has no package index and no Hydra: this script installs NOTHING.  It uses
# ${PYTHON:-python3} as it is, sources scripts/gpu_env.sh (this tree + the bundle of `make
# gpu-bundle` on PYTHONPATH, offline), then
#   1. says in one line what it found: python, torch, CUDA, GPU, Triton;
#   2. runs the GPU tests in their own pytest process with compiled Triton: everything marked
#      `gpu` or `triton_kernel` (the Triton kernel tests, which run in the interpreter on CPU);
#   3. the tensor-parallel check, TP=2 (NCCL) against TP=1 at O2 (skips below 2 GPUs);
#   4. the decode benchmark (eager / PIECEWISE / FULL_AND_PIECEWISE / transformers with
#      torch.compile(mode="reduce-overhead"), batch 1/8/32, bf16);
#   5. prints ONE markdown table (between the "README table" markers) for scripts/README.md.
# Budget: under 8 minutes in all (tests <= 170 s, TP <= 60 s, benchmark <= 210 s, each
# enforced with `timeout`).  Results and logs go to $GPU_CHECK_OUT, else $OUT (the device
# tool's folder that comes back), else outputs/gpu_check: tests.xml, tests.log, tp.log,
# tp_check.json, bench.log, decode_bench.json, table.md, env.txt.
#
#   scripts/gpu_check.sh            the check
#   scripts/gpu_check.sh --dry-run  no GPU needed: the same interpreter and environment,
#                                   imports every module the real run imports, collects the
#                                   same test selection (the collection guard in
#                                   tests/conftest.py fails if any test module switched
#                                   Triton to the interpreter), prints the plan and the
#                                   table skeleton.  tests/scripts runs it on CPU; CI runs it
#                                   with the GPU image's stack (scripts/ci_gpu_stack.sh).
#
# Environment: PYTHON (default python3), GPU_CHECK_TEST_TIMEOUT / GPU_CHECK_TP_TIMEOUT /
# GPU_CHECK_BENCH_TIMEOUT (seconds), BENCH_ARGS (extra benchmark arguments), GPU_CHECK_OUT.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
case "${1:-}" in
    --dry-run) DRY_RUN=1 ;;
    "") ;;
    *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac

die() { echo "error: $*" >&2; exit 2; }
if [ -n "${TRITON_INTERPRET+x}" ]; then
    die "TRITON_INTERPRET is set (=$TRITON_INTERPRET): the GPU tests must run compiled Triton kernels; unset it"
fi

# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || die "no $PY; set PYTHON=/path/to/python3"
TEST_TIMEOUT=${GPU_CHECK_TEST_TIMEOUT:-170}
TP_TIMEOUT=${GPU_CHECK_TP_TIMEOUT:-60}
BENCH_TIMEOUT=${GPU_CHECK_BENCH_TIMEOUT:-210}
RES=${GPU_CHECK_OUT:-${OUT:-outputs/gpu_check}}
START=$(date +%s)
export PIECEWISE_GPU_CHECK=1          # tests/conftest.py: report the collection guard
export PYTHONUNBUFFERED=1
TEST_MARKS="gpu or triton_kernel"
TEST_SEL=(-m pytest -q -p no:cacheprovider -m "$TEST_MARKS")
TEST_CMD=("${TEST_SEL[@]}" --junitxml "$RES/tests.xml" tests)
TP_CMD=(-m experiments.bench.tp --device cuda --tp 2 --level 2 --check --json "$RES/tp_check.json")
BENCH_CMD=(-m experiments.bench.gpu_decode --batch-sizes 1 8 32 --dtype bfloat16
           --out "$RES/decode_bench.json")

step() { printf '\n=== %s (%ss) ===\n' "$1" "$(( $(date +%s) - START ))"; }
mkdir -p "$RES" || die "cannot create $RES"
rm -f "$RES"/{tests.xml,tests.log,tp.log,tp_check.json,bench.log,decode_bench.json,table.md,env.txt}

# One line: what this machine has.  Exit 0 usable, 1 unusable for the real run (said why).
environment() {
    "$PY" - "$1" <<'EOF_PY'
import platform, sys
dry = sys.argv[1] == "1"
parts = [f"python {platform.python_version()} ({sys.executable})"]
status = 0
try:
    import torch
    parts.append(f"torch {torch.__version__}")
    parts.append(f"CUDA {torch.version.cuda or 'none (CPU build)'}")
    if torch.cuda.is_available():
        parts.append(f"GPU {torch.cuda.get_device_name()} x{torch.cuda.device_count()}")
    else:
        parts.append("GPU none" + (" (dry run)" if dry else ""))
except Exception as e:
    parts.append(f"torch not importable ({type(e).__name__}: {e})")
    status = 1
try:
    import triton
    parts.append(f"triton {triton.__version__}")
except Exception as e:
    parts.append(f"triton not importable ({type(e).__name__})")
print("gpu-check env: " + ", ".join(parts))
if status == 0:
    from framework.compat import torch_version
    if not (2, 11) <= torch_version() < (2, 15):
        print(f"torch {torch.__version__} is outside the supported range >=2.11,<2.15"); status = 1
    elif not dry and torch.version.cuda is None:
        print("this torch is a CPU-only build"); status = 1
    elif not dry and not torch.cuda.is_available():
        print("torch is a CUDA build but sees no GPU: check the driver (nvidia-smi) and "
              "CUDA_VISIBLE_DEVICES"); status = 1
missing = []
for mod in ("transformers", "safetensors", "triton", "pytest", "numpy", "hydra", "omegaconf"):
    try:
        __import__(mod)
    except ImportError:
        missing.append(mod)
if missing:
    print(f"missing: {missing} (hydra/omegaconf travel in the bundle: run `make gpu-bundle` "
          f"where there is a network and carry .gpu_bundle)"); status = 1
sys.exit(status)
EOF_PY
}

# Every module of the project (what the tests, the TP check and the benchmark import, and
# more), plus the compile path the real run reaches only when it compiles; then, in the same
# process (one torch start-up less), the pytest collection of the GPU selection.
import_all_and_collect() {
    "$PY" - "${TEST_SEL[@]:2}" --collect-only tests <<'EOF_PY'
import importlib, pkgutil, sys
names = ["torch._inductor.compile_fx", "triton.language", "experiments.bench.gpu_decode",
         "experiments.bench.tp"]
# The OpenAI-compatible server (the `serve` extra: fastapi, uvicorn) is not on the GPU image
# and not part of this check.
SERVING = ("framework.serve", "experiments.bench.serve")
for pkg in ("framework", "backends", "passes", "models", "experiments"):
    mod = importlib.import_module(pkg)
    names += [m.name for m in pkgutil.walk_packages(mod.__path__, pkg + ".")
              if not m.name.endswith(".__main__")  # command-line entry points run on import
              and not m.name.startswith(SERVING)]
failed = []
for name in names:
    try:
        importlib.import_module(name)
    except Exception as e:
        failed.append(f"{name}: {type(e).__name__}: {e}")
print(f"imported {len(names) - len(failed)} of {len(names)} modules")
for f in failed:
    print("  import failed:", f)
if failed:
    sys.exit(3)
print("\n=== dry run: collect the GPU test selection ===", flush=True)
import pytest
sys.exit(pytest.main(sys.argv[1:]))
EOF_PY
}

# The one table, from whatever results exist (a missing file reads "not run"):
# experiments/bench/gpu_check_summary.py, which also renders the committed copy into the READMEs.
summary() {
    "$PY" -m experiments.bench.gpu_check_summary "$RES" "$TEST_MARKS" "$1" | tee "$RES/table.md"
}

step "environment"
environment "$DRY_RUN" | tee "$RES/env.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || die "this environment cannot run the check (see above); nothing is installed here"

if [ $DRY_RUN -eq 1 ]; then
    step "dry run: plan"
    echo "python: $PY"
    echo "PYTHONPATH: $PYTHONPATH"
    echo "TRITON_INTERPRET: unset"
    echo "tests: timeout $TEST_TIMEOUT python ${TEST_CMD[*]}"
    echo "tensor parallel: timeout $TP_TIMEOUT python ${TP_CMD[*]} (skips below 2 GPUs)"
    echo "benchmark: timeout $BENCH_TIMEOUT python ${BENCH_CMD[*]} ${BENCH_ARGS:-}"
    step "dry run: import every module the real run imports"
    import_all_and_collect
    rc=$?
    [ $rc -eq 3 ] && die "imports failed"
    [ $rc -eq 0 ] || die "collection failed (rc=$rc)"
    summary "not run (dry run)"
    exit 0
fi

command -v nvidia-smi >/dev/null 2>&1 \
    && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

step "GPU tests: pytest -m \"$TEST_MARKS\" (timeout ${TEST_TIMEOUT}s)"
timeout --kill-after=15 "$TEST_TIMEOUT" "$PY" "${TEST_CMD[@]}" 2>&1 | tee "$RES/tests.log"
TEST_RC=${PIPESTATUS[0]}
[ "$TEST_RC" -eq 124 ] && echo "GPU tests timed out after ${TEST_TIMEOUT}s"

step "tensor parallel TP=2 vs TP=1 (timeout ${TP_TIMEOUT}s)"
timeout --kill-after=15 "$TP_TIMEOUT" "$PY" "${TP_CMD[@]}" 2>&1 | tee "$RES/tp.log"
TP_RC=${PIPESTATUS[0]}
[ "$TP_RC" -eq 124 ] && echo "TP check timed out after ${TP_TIMEOUT}s"

step "decode benchmark (timeout ${BENCH_TIMEOUT}s)"
# shellcheck disable=SC2086
timeout --kill-after=15 "$BENCH_TIMEOUT" "$PY" "${BENCH_CMD[@]}" ${BENCH_ARGS:-} 2>&1 \
    | tee "$RES/bench.log"
BENCH_RC=${PIPESTATUS[0]}
[ "$BENCH_RC" -eq 124 ] && echo "benchmark timed out after ${BENCH_TIMEOUT}s"

step "done: tests rc=$TEST_RC, TP rc=$TP_RC, benchmark rc=$BENCH_RC (results in $RES/)"
summary ""
[ "$TEST_RC" -eq 0 ] && [ "$TP_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]
