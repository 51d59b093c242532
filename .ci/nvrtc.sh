#!/usr/bin/env bash
# Installs NVRTC + the CUDA runtime/CCCL headers from pip (no GPU, no CUDA
# toolkit needed) into a venv, and prints the environment for the kernel
# build:  eval "$(bash .ci/nvrtc.sh)"
# Progress goes to stderr; stdout carries only `export` lines.
set -euo pipefail
VENV=${QMK_NVRTC_VENV:-$HOME/.cache/qwen-mk/nvrtc-venv}
PKGS="nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-runtime-cu12==12.9.79 nvidia-cuda-cccl-cu12==12.9.27"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV" >&2
fi
if ! "$VENV/bin/python" -m pip show nvidia-cuda-nvrtc-cu12 2>/dev/null | grep -q '^Version: 12.9.86$'; then
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check $PKGS >&2
fi
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
LIB="$SITE/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"
if [ ! -f "$LIB" ]; then
  echo "nvrtc.sh: $LIB missing after install" >&2
  exit 1
fi
INC="$SITE/nvidia/cuda_runtime/include"
[ -d "$SITE/nvidia/cuda_cccl/include" ] && INC="$INC:$SITE/nvidia/cuda_cccl/include"
echo "export QMK_NVRTC_LIB='$LIB'"
echo "export QMK_CUDA_INCLUDE='$INC'"
