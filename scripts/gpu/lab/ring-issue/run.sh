#!/usr/bin/env bash
# One warp per SM feeding a shared-memory ring with bulk copies: stage
# size and copies per stage (scripts/gpu/lab/ring-issue/issue.cu).
set -euo pipefail
cd "$(dirname "$0")"
/usr/local/cuda/bin/nvcc -O3 -arch=sm_90a -o /tmp/ring-issue issue.cu
/tmp/ring-issue
