#!/usr/bin/env bash
# One command for a fresh CUDA machine (`make gpu-check`):
#   1. find a CUDA build of torch (the machine's own, or the PyPI CUDA build if it is online),
#   2. run the GPU tests in their own pytest process with compiled Triton: everything marked
#      `gpu` or `triton_kernel` (the Triton kernel tests, which run in the interpreter on CPU),
#   3. run the decode benchmark (eager / PIECEWISE / FULL_AND_PIECEWISE / transformers with
#      torch.compile(mode="reduce-overhead"), batch 1/8/32, bf16),
#   4. print ONE markdown table (between the "README table" markers) for README "On a GPU".
# Budget: under 8 minutes once torch is present (tests <= 3 min, benchmark <= 4 min, enforced
# with `timeout`); a torch download on a bare online machine comes on top.
#
#   scripts/gpu_check.sh            the check
#   scripts/gpu_check.sh --dry-run  no GPU, no installs: check the environment, collect the
#                                   GPU test selection exactly as the real run would (the
#                                   collection guard in tests/conftest.py fails if any test
#                                   module switched Triton to the interpreter), print the plan
#                                   and the table skeleton.  tests/scripts runs it on CPU.
#
# torch: never replaced when a CUDA build >= 2.13 is importable (the usual GPU image).  Else,
# when PyPI is reachable, `pip install "torch>=2.13,<2.15"` into a venv (default Linux x86_64
# wheel = CUDA build; only the driver must be present).  Offline, the run stops with what was
# found.  The project itself runs from this source tree (PYTHONPATH), so no build step.
#
# Environment: PYTHON (default python3), PIECEWISE_GPU_VENV (default .cache/gpu-venv),
# GPU_CHECK_TEST_TIMEOUT / GPU_CHECK_BENCH_TIMEOUT (seconds), BENCH_ARGS (extra arguments),
# GPU_CHECK_OUT (default outputs/gpu_check).
set -uo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
case "${1:-}" in
    --dry-run) DRY_RUN=1 ;;
    "") ;;
    *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac

PYTHON=${PYTHON:-python3}
VENV=${PIECEWISE_GPU_VENV:-.cache/gpu-venv}
TEST_TIMEOUT=${GPU_CHECK_TEST_TIMEOUT:-180}
BENCH_TIMEOUT=${GPU_CHECK_BENCH_TIMEOUT:-240}
OUT=${GPU_CHECK_OUT:-outputs/gpu_check}
START=$(date +%s)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
export PIECEWISE_GPU_CHECK=1          # tests/conftest.py: report the collection guard
TEST_MARKS="gpu or triton_kernel"
TEST_CMD=(-m pytest -q -p no:cacheprovider -m "$TEST_MARKS" --junitxml "$OUT/tests.xml" tests)
TP_TIMEOUT=${GPU_CHECK_TP_TIMEOUT:-180}
# Tensor parallelism: TP=2 (NCCL) greedy tokens against TP=1 at O2; skips with a reason when
# fewer than 2 GPUs are visible (experiments/bench_tp.py prints it).
TP_CMD=(-m experiments.bench_tp --device cuda --tp 2 --level 2 --check --json "$OUT/tp_check.json")
BENCH_CMD=(-m experiments.gpu_decode_bench --batch-sizes 1 8 32 --dtype bfloat16
           --out "$OUT/decode_bench.json")

step() { printf '\n=== %s (%ss) ===\n' "$1" "$(( $(date +%s) - START ))"; }
die() { echo "error: $*" >&2; exit 2; }

if [ -n "${TRITON_INTERPRET+x}" ]; then
    die "TRITON_INTERPRET is set (=$TRITON_INTERPRET): the GPU tests must run compiled Triton kernels; unset it"
fi
command -v "$PYTHON" >/dev/null 2>&1 || die "no $PYTHON; set PYTHON=/path/to/python3"
mkdir -p "$OUT"
rm -f "$OUT/tests.xml" "$OUT/decode_bench.json"

# The one table, from whatever results exist (a missing file reads "not run").
summary() {
    "$PY" - "$OUT" "$TEST_MARKS" "$1" <<'EOF'
import json, os, sys, xml.etree.ElementTree as ET
out, marks, note = sys.argv[1:4]
rows = []
xml = os.path.join(out, "tests.xml")
if os.path.isfile(xml):
    s = ET.parse(xml).getroot()
    s = s if s.tag == "testsuite" else s.find("testsuite")
    n, f, e, sk = (int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    rows.append((f"pytest -m \"{marks}\"", f"{n - f - e - sk} passed, {f + e} failed, "
                 f"{sk} skipped", f"{float(s.get('time', 0)):.0f} s"))
else:
    rows.append((f"pytest -m \"{marks}\"", note or "not run", ""))
bench = os.path.join(out, "decode_bench.json")
if os.path.isfile(bench):
    results = json.load(open(bench))["results"]
    eager = results.get("eager", {}).get("ms", {})
    for mode, r in results.items():
        if "error" in r:
            rows.append((f"decode {mode}", "failed", r["error"][:100].replace("|", "/")))
            continue
        ms = ", ".join(f"bs={b}: {v:.3f}" for b, v in r["ms"].items())
        speed = ", ".join(f"{eager[b] / v:.2f}x" for b, v in r["ms"].items() if b in eager)
        rows.append((f"decode {mode} ({r.get('cudagraph_mode') or '-'})", f"ms/step {ms}",
                     f"vs eager {speed}; startup {r['startup_s']:.1f} s"))
else:
    rows.append(("decode benchmark (bf16, bs 1/8/32)", note or "not run", ""))
try:
    import torch
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    env = f"torch {torch.__version__}, CUDA {torch.version.cuda}, {dev}"
except Exception as e:  # the table must print whatever failed before
    env = f"torch not importable: {type(e).__name__}"
print("----- README table (scripts/gpu_check.sh) -----")
print(f"GPU check: {env}")
print()
print("| check | result | detail |")
print("|---|---|---|")
for row in rows:
    print("| " + " | ".join(row) + " |")
print("----- end README table -----")
EOF
}

if [ $DRY_RUN -eq 1 ]; then
    PY="$PYTHON"
    step "dry run: plan"
    echo "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
    echo "TRITON_INTERPRET: unset"
    echo "tests: timeout $TEST_TIMEOUT python ${TEST_CMD[*]}"
    echo "benchmark: timeout $BENCH_TIMEOUT python ${BENCH_CMD[*]} ${BENCH_ARGS:-}"
    echo "tensor parallel: timeout $TP_TIMEOUT python ${TP_CMD[*]} (skips below 2 GPUs)"
    step "dry run: collect the GPU test selection"
    "$PY" "${TEST_CMD[@]:0:7}" --collect-only tests
    rc=$?
    [ $rc -eq 0 ] || die "collection failed (rc=$rc)"
    summary "not run (dry run)"
    exit 0
fi

step "python environment"
# No GPU visible: stop before anything is installed (a CUDA torch is several GB).
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
        || die "nvidia-smi failed: no usable NVIDIA driver/GPU here"
elif [ ! -e /dev/nvidiactl ]; then
    die "no NVIDIA GPU visible (no nvidia-smi, no /dev/nvidiactl); use --dry-run on CPU"
fi

# torch status: 0 usable, 1 no torch / CPU-only / too old (installing helps), 3 CUDA build
# but no device (installing does not help: driver or container problem).
torch_status() {
    "$1" - <<'EOF'
import sys
try:
    import torch
except ImportError as e:
    print(f"torch: not importable ({e})"); sys.exit(1)
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
print(f"torch {torch.__version__} (CUDA build: {torch.version.cuda}, device available: "
      f"{torch.cuda.is_available()}) at {torch.__file__}")
if (major, minor) < (2, 13):
    print("torch is older than 2.13, which this project needs"); sys.exit(1)
if torch.version.cuda is None:
    print("this torch is a CPU-only build"); sys.exit(1)
if not torch.cuda.is_available():
    sys.exit(3)
EOF
}

online() {
    "$1" - <<'EOF'
import os, socket, sys, urllib.parse
url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")
host = urllib.parse.urlparse(url).hostname or "pypi.org"
try:
    socket.create_connection((host, 443), timeout=3).close()
except OSError as e:
    print(f"package index {host} unreachable ({e}): no installs"); sys.exit(1)
EOF
}

PY="$PYTHON"
torch_status "$PY"; TS=$?
if [ $TS -eq 1 ] && [ -x "$VENV/bin/python" ]; then   # a venv from an earlier run
    PY="$VENV/bin/python"; torch_status "$PY"; TS=$?
fi
[ $TS -eq 3 ] && die "torch is a CUDA build but sees no GPU: check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES"
if [ $TS -ne 0 ]; then
    online "$PYTHON" || die "no usable CUDA torch and no package index: install torch>=2.13 (CUDA) first"
    if [ ! -x "$VENV/bin/python" ]; then
        "$PYTHON" -m venv --system-site-packages "$VENV" \
            || die "cannot create $VENV (Debian/Ubuntu: apt install python3-venv)"
    fi
    PY="$VENV/bin/python"
    echo "installing the PyPI CUDA build of torch into $VENV (several GB)"
    "$PY" -m pip install -q --retries 2 --timeout 30 "torch>=2.13,<2.15" \
        || die "torch install failed"
    torch_status "$PY" || die "the installed torch cannot use the GPU"
fi

# The other dependencies (pyproject.toml + pytest); torch is never touched.
"$PY" - <<'EOF'
import importlib.util, socket, subprocess, sys
need = {"transformers": "transformers>=5.0,<6", "safetensors": "safetensors>=0.4",
        "triton": "triton>=3.0", "pytest": "pytest>=8", "numpy": "numpy",
        "filelock": "filelock>=3.12", "tqdm": "tqdm>=4.60", "hydra": "hydra-core>=1.3,<1.4",
        "omegaconf": "omegaconf>=2.3,<2.4", "depyf": "depyf>=0.18",
        "matplotlib": "matplotlib>=3.7", "hydra_plugins.hydra_joblib_launcher":
        "hydra-joblib-launcher>=1.2"}
def present(mod):
    try:
        return importlib.util.find_spec(mod) is not None
    except ModuleNotFoundError:
        return False
missing = [spec for mod, spec in need.items() if not present(mod)]
if missing:
    print("installing:", " ".join(missing))
    rc = subprocess.call([sys.executable, "-m", "pip", "install", "-q", "--retries", "1",
                          "--timeout", "15", *missing])
    if rc:
        print("warning: could not install", missing, "(offline?)")
absent = [m for m in ("torch", "transformers", "safetensors", "triton", "pytest", "hydra")
          if not present(m)]
if absent:
    sys.exit(f"error: required packages missing: {absent}")
import triton
print(f"triton {triton.__version__}")
EOF
[ $? -eq 0 ] || exit 2

step "GPU tests: pytest -m \"$TEST_MARKS\" (timeout ${TEST_TIMEOUT}s)"
timeout --kill-after=15 "$TEST_TIMEOUT" "$PY" "${TEST_CMD[@]}"
TEST_RC=$?
[ $TEST_RC -eq 124 ] && echo "GPU tests timed out after ${TEST_TIMEOUT}s"

step "tensor parallel TP=2 vs TP=1 (timeout ${TP_TIMEOUT}s)"
timeout --kill-after=15 "$TP_TIMEOUT" "$PY" "${TP_CMD[@]}"
TP_RC=$?
[ $TP_RC -eq 124 ] && echo "TP check timed out after ${TP_TIMEOUT}s"

step "decode benchmark (timeout ${BENCH_TIMEOUT}s)"
# shellcheck disable=SC2086
timeout --kill-after=15 "$BENCH_TIMEOUT" "$PY" "${BENCH_CMD[@]}" ${BENCH_ARGS:-}
BENCH_RC=$?
[ $BENCH_RC -eq 124 ] && echo "benchmark timed out after ${BENCH_TIMEOUT}s"

step "done: tests rc=$TEST_RC, TP rc=$TP_RC, benchmark rc=$BENCH_RC (results in $OUT/)"
summary ""
[ $TEST_RC -eq 0 ] && [ $TP_RC -eq 0 ] && [ $BENCH_RC -eq 0 ]
