#!/usr/bin/env bash
# Builds (unless TD_BIN_DIR holds prebuilt binaries) and runs the tensor-core
# dot-product lab at 0.5B, 7B, 14B and 32B shapes on an sm_90 GPU, and beside
# it the CUDA-core multi-token lab (../multi-token/mt.cu, its modes 3 and 4
# and the one-token reference) at the same shapes:
#   bash scripts/gpu/lab/tensor-dot/run.sh                        (on the GPU machine, nvcc)
#   TD_BIN_DIR=DIR bash scripts/gpu/lab/tensor-dot/run.sh build   (here: nvcc, no GPU)
#   TD_BIN_DIR=DIR bash scripts/gpu/lab/tensor-dot/run.sh         (there, with DIR carried)
# TD_NVCC_FLAGS: -DLAB_NB=N sets the k-steps of loads per register set (4).
# td-*-split take each input as two bf16 planes (hi, lo: -DLAB_SPLIT=1);
# -tiled stores the weights in tile order (-DLAB_TILED=1), -defer fences
# and counts the slice partials at the end of a warp's stream
# (-DLAB_DEFER=1), -early issues a phase's first weight loads before the
# grid barrier and the input copy (-DLAB_EARLY=1). TD_SHAPES (default "0.5b 7b 14b 32b") picks the shapes.
# About 80 s of nvcc per shape (tensor cores, hi + lo, CUDA cores); about
# 10 s of GPU per binary. A carried DIR may hold any subset: it builds only
# when DIR holds no tensor-core binary at all, and runs what is there.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BIN=${TD_BIN_DIR:-/tmp/td-lab}
OUT=${OUT:-/tmp}
mkdir -p "$BIN"
shapes=(0.5b 7b 14b 32b)
if [[ ${1:-} == build ]] || ! compgen -G "$BIN/td-*" > /dev/null; then
  for i in "${!shapes[@]}"; do
    [[ " ${TD_SHAPES:-${shapes[*]}} " == *" ${shapes[$i]} "* ]] || continue
    nvcc -O3 -std=c++17 -arch=sm_90a -Xptxas -v ${TD_NVCC_FLAGS:-} -DLAB_SHAPE="$i" -o "$BIN/td-${shapes[$i]}" \
      "$HERE/td.cu" 2> "$BIN/ptxas-td-${shapes[$i]}.txt" || { cat "$BIN/ptxas-td-${shapes[$i]}.txt"; exit 1; }
  done
  for i in "${!shapes[@]}"; do
    [[ " ${TD_SHAPES:-${shapes[*]}} " == *" ${shapes[$i]} "* ]] || continue
    for v in split split-tiled split-defer split-tiled-defer split-tiled-defer-early tiled-defer-early; do
      f=""
      [[ $v == split* ]] && f+=" -DLAB_SPLIT=1"
      [[ $v == *tiled* ]] && f+=" -DLAB_TILED=1"
      [[ $v == *defer* ]] && f+=" -DLAB_DEFER=1"
      [[ $v == *early* ]] && f+=" -DLAB_EARLY=1"
      # shellcheck disable=SC2086
      nvcc -O3 -std=c++17 -arch=sm_90a ${TD_NVCC_FLAGS:-} $f -DLAB_SHAPE="$i" -o "$BIN/td-${shapes[$i]}-$v" "$HERE/td.cu"
    done
    nvcc -O3 -std=c++17 -arch=sm_90a -DLAB_MODES_FROM=3 -DLAB_SHAPE="$i" -o "$BIN/mt-${shapes[$i]}" \
      "$HERE/../multi-token/mt.cu"
  done
  rm -f "$BIN"/ptxas-td-*.txt
  [[ ${1:-} == build ]] && exit 0
fi
# 7B and 32B first: the goal's shapes.
for s in 7b 32b 14b 0.5b; do
  for b in td-$s td-$s-split td-$s-split-defer td-$s-split-tiled td-$s-split-tiled-defer td-$s-split-tiled-defer-early \
    td-$s-tiled-defer-early mt-$s; do
    if [[ -x $BIN/$b ]]; then timeout 120 "$BIN/$b" | tee -a "$OUT/tensor-dot.txt"; fi
  done
done
