#!/usr/bin/env bash
# Builds and runs the M0 lab on the GPU machine (nvcc, an sm_90 GPU):
#   bash scripts/gpu/lab/m0/run.sh
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT=${OUT:-/tmp}
nvcc -O3 -std=c++17 -arch=sm_90a -lineinfo -Xptxas -v -o /tmp/m0 "$HERE/m0.cu" 2> /tmp/m0-ptxas.txt || { cat /tmp/m0-ptxas.txt; exit 1; }
grep -E "Function properties|registers" /tmp/m0-ptxas.txt | head -20
timeout 240 /tmp/m0 | tee "$OUT/m0.txt"
