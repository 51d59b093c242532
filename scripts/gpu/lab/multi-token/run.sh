#!/usr/bin/env bash
# Builds (unless MT_BIN_DIR holds prebuilt mt-<shape> binaries) and runs the
# multi-token phase lab at 0.5B, 7B, 14B and 32B shapes on an sm_90 GPU:
#   bash scripts/gpu/lab/multi-token/run.sh            (on the GPU machine, nvcc)
#   MT_BIN_DIR=DIR bash scripts/gpu/lab/multi-token/run.sh build   (here: nvcc, no GPU)
#   MT_BIN_DIR=DIR bash scripts/gpu/lab/multi-token/run.sh         (there, with DIR carried)
# MT_NVCC_FLAGS: -DLAB_MODES_FROM=3 builds only the modes that load a batch
# ahead, -DLAB_WARPS=8 runs 8 warps per CTA. ~2 minutes of nvcc per shape;
# ~10 s of GPU per shape.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BIN=${MT_BIN_DIR:-/tmp/mt-lab}
OUT=${OUT:-/tmp}
mkdir -p "$BIN"
shapes=(0.5b 7b 14b 32b)
if [[ ${1:-} == build || ! -x $BIN/mt-32b ]]; then
  for i in "${!shapes[@]}"; do
    nvcc -O3 -std=c++17 -arch=sm_90a -Xptxas -v ${MT_NVCC_FLAGS:-} -DLAB_SHAPE="$i" -o "$BIN/mt-${shapes[$i]}" \
      "$HERE/mt.cu" 2> "$BIN/ptxas-${shapes[$i]}.txt" || { cat "$BIN/ptxas-${shapes[$i]}.txt"; exit 1; }
  done
  [[ ${1:-} == build ]] && exit 0
fi
for s in "${shapes[@]}"; do
  timeout 120 "$BIN/mt-$s" | tee -a "$OUT/multi-token.txt"
done
