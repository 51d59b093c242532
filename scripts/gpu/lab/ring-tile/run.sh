#!/usr/bin/env bash
# The ring labs (scripts/gpu/lab/ring-tile/): tile.cu, one decode weight
# phase in steady state fed three ways at 7B and 14B shapes (~5 s); step.cu,
# a whole step's weight stream with a grid barrier after every phase, direct
# loads against a producer warp outside the ops, fixed shares or rows
# claimed from a grid counter, at 0.5B, 7B and 14B shapes (~5 s, 28 GB of
# device memory at 14B). `run.sh tile` or `run.sh step` runs one.
set -euo pipefail
cd "$(dirname "$0")"
for lab in "${@:-tile step}"; do
  for l in $lab; do
    /usr/local/cuda/bin/nvcc -O3 -std=c++17 -arch=sm_90a -o "/tmp/ring-$l" "$l.cu" -lcuda
    timeout 300 "/tmp/ring-$l"
  done
done
