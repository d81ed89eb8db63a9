#!/usr/bin/env bash
# CI stage "GPU image stack on CPU" (.ci/run, after `make test`): the lent GPU machine's
# Python stack -- Python 3.12, torch 2.11.0 (the default PyPI wheel, CUDA 13.0, runs on CPU),
# Triton 3.6.0, transformers 5.17.0 ... exactly scripts/gpu_image_requirements.txt, no Hydra
# or OmegaConf -- in a venv cached outside the clone (keyed by that file), then, with the
# package index switched off (PIP_NO_INDEX=1) after the one network step (`make gpu-bundle`):
#   1. scripts/gpu_check.sh --dry-run with that interpreter;
#   2. a tiny LLM at O2 (cold and warm) gives the O0 tokens (scripts/o2_equals_o0.py: llama;
#      the smoke subset checks the other three families at O2);
#   3. a CPU smoke subset: the compat package, the four dense families at O0 and O2 against
#      transformers, the warm start and the other cache tests, the add+RMSNorm fusion (the
#      pattern pass O2 runs on a GPU), the Triton-interpreter kernel tests (they rerun themselves in a child process with TRITON_INTERPRET=1; the GPU
#      selection never sees it).
#
# Environment: PIECEWISE_PY312 (a Python 3.12; default: python3.12 on PATH, else pyenv's),
# PIECEWISE_CI_CACHE (default ~/.cache/piecewise).
set -euo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
step() { printf '\n=== gpu-stack: %s (%ss) ===\n' "$1" "$(( $(date +%s) - START ))"; }

find_py312() {  # the first candidate that runs (a pyenv shim may exist and refuse)
    local root c
    root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
    for c in ${PIECEWISE_PY312:-} python3.12 "$root"/versions/3.12*/bin/python3.12; do
        if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
            command -v "$c"
            return
        fi
    done
    echo "error: no working Python 3.12 (set PIECEWISE_PY312)" >&2
    exit 2
}

PY312=$(find_py312)
REQS=scripts/gpu_image_requirements.txt
CACHE=${PIECEWISE_CI_CACHE:-$HOME/.cache/piecewise}
VENV="$CACHE/gpu-stack-$( (cat "$REQS"; "$PY312" -V) | sha256sum | cut -c1-12)"
V="$VENV/bin/python"

step "venv $VENV"
if [ ! -f "$VENV/.complete" ]; then
    rm -rf "$VENV"
    "$PY312" -m venv "$VENV"
    "$V" -m pip install -q --disable-pip-version-check -r "$REQS"
    touch "$VENV/.complete"
fi
"$V" - <<'EOF_PY'
import importlib.util, sys
import torch, triton, transformers
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__},"
      f" transformers {transformers.__version__}")
assert torch.__version__.startswith("2.11.0") and triton.__version__ == "3.6.0", "wrong stack"
extra = [m for m in ("hydra", "omegaconf") if importlib.util.find_spec(m)]
assert not extra, f"the GPU image has no {extra}: the venv must not either"
EOF_PY

step "make gpu-bundle (the one step with the network)"
make gpu-bundle PY="$V"

export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

step "gpu_check.sh --dry-run with $V"
PYTHON="$V" GPU_CHECK_OUT="$TMP/gpu_check" bash scripts/gpu_check.sh --dry-run >"$TMP/dry.log" 2>&1 \
    || { tail -60 "$TMP/dry.log"; echo "error: dry run failed" >&2; exit 1; }
grep -E "^gpu-check env:|^imported |gpu-check collection:" "$TMP/dry.log"

step "tiny LLM: O2 (cold, warm) tokens == O0"
"$V" scripts/o2_equals_o0.py "$TMP/o2"

step "CPU smoke subset (two pytest processes side by side: CI has 2 cores)"
T=tests/framework/engine/test_llm.py
smoke() {  # smoke NAME TESTS...: one pytest process, its output in $TMP/NAME.log
    local name=$1
    shift
    OMP_NUM_THREADS=1 "$V" -m pytest -q -p no:cacheprovider -m "not slow" "$@" >"$TMP/$name.log" 2>&1
}
C=tests/framework/cache
# Two halves of about equal time (the end-to-end cache tests are the long ones); every cache
# test file is in one of them.
CACHE_A=(test_artifact_cache_e2e test_cache_cli test_cache_key test_store test_cache_explain_passes)
CACHE_B=(test_cache_pass_edit test_cache_pass_records test_disk_faults test_lean_artifacts
    test_warm_start_lean test_weight_cache)
MISSING=$(comm -23 <(cd "$C" && ls test_*.py | sed 's/\.py$//' | sort) \
    <(printf '%s\n' "${CACHE_A[@]}" "${CACHE_B[@]}" | sort))
[ -z "$MISSING" ] || { echo "error: add to CACHE_A or CACHE_B: $MISSING" >&2; exit 1; }
in_cache() { local f; for f; do printf '%s\n' "$C/$f.py"; done; }
mapfile -t CACHE_A < <(in_cache "${CACHE_A[@]}")
mapfile -t CACHE_B < <(in_cache "${CACHE_B[@]}")
smoke cache "${CACHE_A[@]}" &
CACHE_PID=$!
smoke rest \
    "${CACHE_B[@]}" \
    tests/framework/compat \
    "$T::test_eager_matches_transformers_batched_and_alone" \
    "$T::test_compiled_levels_match_eager[mistral-2]" \
    "$T::test_compiled_levels_match_eager[qwen2-2]" \
    "$T::test_compiled_levels_match_eager[qwen3-2]" \
    tests/passes/test_fuse_add_rmsnorm.py \
    tests/passes/ops/test_triton_kernels.py \
    tests/backends/attention/test_triton_paged.py &
REST_PID=$!
FAILED=0
for part in cache:$CACHE_PID rest:$REST_PID; do
    if ! wait "${part#*:}"; then FAILED=1; fi
    echo "--- smoke (${part%%:*}):"
    grep -vE "^(SKIPPED|\.+|s+|[.s]+ +\[)" "$TMP/${part%%:*}.log" | tail -25
done
[ "$FAILED" = 0 ] || { echo "error: the CPU smoke subset failed (above)" >&2; exit 1; }

step "done"
