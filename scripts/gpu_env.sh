# Sourced (never run) by scripts/gpu_check.sh, and by hand on the lent GPU machine:
#     source scripts/gpu_env.sh
# Makes this source tree and the bundle of `make gpu-bundle` (.gpu_bundle/site: hydra-core,
# omegaconf, antlr4, ... for Python 3.12) importable with the image's python3, and keeps
# everything offline: no package index, no Hugging Face hub.  Installs nothing.
#
# Environment: PIECEWISE_GPU_BUNDLE (default <tree>/.gpu_bundle/site).
_pw_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PIECEWISE_GPU_BUNDLE=${PIECEWISE_GPU_BUNDLE:-$_pw_root/.gpu_bundle/site}
export PIECEWISE_GPU_BUNDLE
if [ -d "$PIECEWISE_GPU_BUNDLE" ]; then
    export PYTHONPATH="$_pw_root:$PIECEWISE_GPU_BUNDLE${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "gpu_env: no bundle at $PIECEWISE_GPU_BUNDLE (run \`make gpu-bundle\` where there is a network)" >&2
    export PYTHONPATH="$_pw_root${PYTHONPATH:+:$PYTHONPATH}"
fi
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
unset _pw_root
