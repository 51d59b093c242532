#!/usr/bin/env bash
# The ring labs (scripts/gpu/lab/ring-tile/): tile.cu, one decode weight
# phase in steady state fed three ways at 7B and 14B shapes (~5 s); step.cu,
# a whole step's weight stream with a grid barrier after every phase, direct
# loads against a producer warp outside the ops, fixed shares or rows
# claimed from a grid counter, at 0.5B, 7B and 14B shapes (~5 s, 28 GB of
# device memory at 14B); flow.cu, the same step with each phase reading the
# previous phase's output, ordered by grid barriers or by counters per
# block of columns (~10 s). `run.sh tile`, `run.sh step` or `run.sh flow`
# runs one.
set -euo pipefail
cd "$(dirname "$0")"
for lab in "${@:-tile step flow}"; do
  for l in $lab; do
    /usr/local/cuda/bin/nvcc -O3 -std=c++17 -arch=sm_90a -o "/tmp/ring-$l" "$l.cu" -lcuda
    timeout "${LAB_TIMEOUT:-300}" "/tmp/ring-$l"
  done
done
