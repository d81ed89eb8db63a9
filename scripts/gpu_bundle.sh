#!/usr/bin/env bash
# `make gpu-bundle`: with the network, unpack into .gpu_bundle/site (git-ignored) the
# pure-Python packages of scripts/gpu_bundle_requirements.txt for Python 3.12, the lent GPU
# image's python3, which has no package index.  scripts/gpu_env.sh makes them importable
# there; the device `run` call carries .gpu_bundle (scripts/README.md).  A few MiB.
#
# Environment: PY (default python3: any Python with pip; nothing is installed into it),
# GPU_BUNDLE_DIR (default .gpu_bundle).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
DIR=${GPU_BUNDLE_DIR:-.gpu_bundle}
REQS=scripts/gpu_bundle_requirements.txt
mapfile -t PKGS < <(grep -vE '^\s*(#|$)' "$REQS")

rm -rf "$DIR.tmp"
mkdir -p "$DIR.tmp/wheels"
# Wheels for Python 3.12 where PyPI has them; antlr4-python3-runtime 4.9.3 is a source
# distribution only, so pip builds its (pure-Python, py3-none-any) wheel here.
"$PY" -m pip download -q --no-deps --dest "$DIR.tmp/wheels" --python-version 3.12 \
    --implementation py --only-binary=:all: \
    $(printf '%s\n' "${PKGS[@]}" | grep -v '^antlr4-python3-runtime')
"$PY" -m pip wheel -q --no-deps --wheel-dir "$DIR.tmp/wheels" \
    "$(printf '%s\n' "${PKGS[@]}" | grep '^antlr4-python3-runtime')"
for whl in "$DIR.tmp"/wheels/*.whl; do
    case "$whl" in
        *-py3-none-any.whl | *-py2.py3-none-any.whl) ;;
        *) echo "error: $whl is not a pure-Python wheel" >&2; exit 2 ;;
    esac
done
"$PY" -m pip install -q --no-deps --no-compile --no-index --target "$DIR.tmp/site" \
    "$DIR.tmp"/wheels/*.whl
rm -rf "$DIR.tmp/wheels" "$DIR.tmp"/site/bin
printf '%s\n' "${PKGS[@]}" >"$DIR.tmp/site/BUNDLE.txt"
rm -rf "$DIR"
mv "$DIR.tmp" "$DIR"
echo "gpu bundle: $(du -sh "$DIR" | cut -f1) in $DIR/site ($(wc -l <"$DIR/site/BUNDLE.txt") packages)"
