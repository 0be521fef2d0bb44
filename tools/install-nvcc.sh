#!/usr/bin/env bash
# Install the CUDA 13.0 compiler (nvcc, ptxas, cicc, headers) from PyPI wheels into a cache venv,
# idempotently, and print the path of nvcc on the last line of stdout. No GPU and no system CUDA
# are needed: this is what build.rs and tools/check-kernels.sh use on development and CI machines.
#
#   tools/install-nvcc.sh            # installs (once) and prints .../nvidia/cu13/bin/nvcc
#
# The venv lives in ${INFOMEM_CACHE:-~/.cache/infomem-engine}/cuda-venv. Versions are pinned to
# 13.0.x on purpose: the GPU machine's driver is CUDA 13.0, and PTX from a newer nvcc would not load.
set -euo pipefail

CACHE="${INFOMEM_CACHE:-$HOME/.cache/infomem-engine}"
VENV="$CACHE/cuda-venv"
PKGS=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88
      nvidia-nvvm==13.0.88 nvidia-cuda-cccl==13.0.85)

find_nvcc() {
  local f
  for f in "$VENV"/lib/python3*/site-packages/nvidia/cu13/bin/nvcc; do
    [ -x "$f" ] && { echo "$f"; return 0; }
  done
  return 1
}

stamp="$VENV/.infomem-nvcc-$(printf '%s' "${PKGS[*]}" | cksum | cut -d' ' -f1)"
if [ -f "$stamp" ] && nvcc="$(find_nvcc)" && "$nvcc" --version >/dev/null 2>&1; then
  echo "$nvcc"
  exit 0
fi

mkdir -p "$CACHE"
if [ ! -x "$VENV/bin/pip" ]; then
  python3 -m venv "$VENV" >&2
fi
"$VENV/bin/pip" install --quiet --disable-pip-version-check "${PKGS[@]}" >&2
nvcc="$(find_nvcc)" || { echo "install-nvcc: nvcc not found under $VENV after install" >&2; exit 1; }
# The wheels ship the tools without their exec bits in some versions.
chmod +x "$(dirname "$nvcc")"/* "$(dirname "$nvcc")"/../nvvm/bin/* 2>/dev/null || true
"$nvcc" --version >&2
touch "$stamp"
echo "$nvcc"
