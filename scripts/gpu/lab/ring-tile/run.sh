#!/usr/bin/env bash
# One decode weight phase in steady state, fed through a shared-memory ring
# three ways (whole rows per warp, TMA tiles, per-row bulk copies of tiles)
# at 7B and 14B shapes (scripts/gpu/lab/ring-tile/tile.cu).
set -euo pipefail
cd "$(dirname "$0")"
/usr/local/cuda/bin/nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/ring-tile tile.cu -lcuda
timeout 300 /tmp/ring-tile
