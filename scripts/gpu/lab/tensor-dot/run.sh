#!/usr/bin/env bash
# Builds (unless TD_BIN_DIR holds prebuilt binaries) and runs the tensor-core
# dot-product lab at 0.5B, 7B, 14B and 32B shapes on an sm_90 GPU, and beside
# it the CUDA-core multi-token lab (../multi-token/mt.cu, its modes 3 and 4
# and the one-token reference) at the same shapes:
#   bash scripts/gpu/lab/tensor-dot/run.sh                        (on the GPU machine, nvcc)
#   TD_BIN_DIR=DIR bash scripts/gpu/lab/tensor-dot/run.sh build   (here: nvcc, no GPU)
#   TD_BIN_DIR=DIR bash scripts/gpu/lab/tensor-dot/run.sh         (there, with DIR carried)
# TD_NVCC_FLAGS adds nvcc flags to every tensor-core build.
# A binary's name lists its variant flags after the shape: split (each input
# as two bf16 planes, hi and lo), tiled (weights in tile order), defer
# (slice partials fenced and counted at the end of a warp's stream), early
# (a phase's first weight loads before the grid barrier and the input
# copy), balance (equal contiguous shares of k-steps instead of units),
# pfN (L2 bulk prefetch N k-steps ahead), nbN (N k-steps per register
# set), skipN (timing only: leave out the arrivals (1), the input copy (2),
# the grid barriers (4), or a sum of them), overlap (deferred arrivals
# after the next phase's first loads), overlap2 (the same, fenced before
# those loads), local (a tile's slices added in shared memory where its
# contributors share a CTA), local2 (the same, with the CTA's edge tiles
# split among all its warps as their first pieces), sumsN (the last
# arrival at a tile loads N slots' partials at once), copyN (the input
# copy over all tokens at once, N loads in flight), kblkN (at least N
# column blocks a phase, each CTA's inputs one block), bulk (the input
# copy as bulk copies of bf16 planes the previous phase wrote), relacq (arrivals
# through an acq_rel atomic instead of a full fence), late (the last arrival's
# sums after the warp's stream), tile8 (tile order in 8-row bands), clean
# (tc_phase.cuh, the chosen configuration written for the product: needs
# split-tiled-early-balance-local-kblk1-bulk), staged (with clean: the last
# arrival's slots through shared memory in one round trip); td.cu's header
# says
# more. TD_VARIANTS replaces the default list;
# TD_SHAPES (default "0.5b 7b 14b 32b"; also 1.5b, 3b) picks the shapes.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BIN=${TD_BIN_DIR:-/tmp/td-lab}
OUT=${OUT:-/tmp}
mkdir -p "$BIN"
shapes=(0.5b 7b 14b 32b 1.5b 3b)  # index = LAB_SHAPE
variants=${TD_VARIANTS:-"split split-tiled split-tiled-early-balance split-tiled-early-balance-local
  split-tiled-early-balance-local-kblk1 split-tiled-early-balance-local-kblk1-bulk"}
if [[ ${1:-} == build ]] || ! compgen -G "$BIN/td-*" > /dev/null; then
  for i in "${!shapes[@]}"; do
    [[ " ${TD_SHAPES:-0.5b 7b 14b 32b} " == *" ${shapes[$i]} "* ]] || continue
    nvcc -O3 -std=c++17 -arch=sm_90a -Xptxas -v ${TD_NVCC_FLAGS:-} -DLAB_SHAPE="$i" -o "$BIN/td-${shapes[$i]}" \
      "$HERE/td.cu" 2> "$BIN/ptxas-td-${shapes[$i]}.txt" || { cat "$BIN/ptxas-td-${shapes[$i]}.txt"; exit 1; }
  done
  for i in "${!shapes[@]}"; do
    [[ " ${TD_SHAPES:-0.5b 7b 14b 32b} " == *" ${shapes[$i]} "* ]] || continue
    for v in $variants; do
      # At 0.5B q/k/v and o_proj have fewer k-steps than the grid has warps:
      # no edge tiles first there.
      [[ ${shapes[$i]} == 0.5b && $v == *local2* ]] && continue
      f=""
      for x in ${v//-/ }; do
        case $x in
          split | tiled | defer | early | balance | overlap | local | bulk | relacq | late | tile8 | clean | staged) f+=" -DLAB_${x^^}=1" ;;
          pf*) f+=" -DLAB_PF=${x#pf}" ;;
          nb*) f+=" -DLAB_NB=${x#nb}" ;;
          sums*) f+=" -DLAB_SUMS=${x#sums}" ;;
          copy*) f+=" -DLAB_COPY=${x#copy}" ;;
          kblk*) f+=" -DLAB_KBLK=${x#kblk}" ;;
          skip*) f+=" -DLAB_SKIP=${x#skip}" ;;
          overlap2) f+=" -DLAB_OVERLAP=2" ;;
          local2) f+=" -DLAB_LOCAL=2" ;;
          *) echo "unknown variant flag $x"; exit 1 ;;
        esac
      done
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
for s in 7b 32b 14b 0.5b 1.5b 3b; do
  for b in "$BIN/td-$s" "$BIN"/td-"$s"-* "$BIN/mt-$s"; do
    if [[ -x $b ]]; then timeout 120 "$b" | tee -a "$OUT/tensor-dot.txt"; fi
  done
done
