#!/usr/bin/env bash
# The K/V read lab (kv_read.cu): a 7B step's K/V cache at 32,768 positions
# read in the split attention's access patterns (~5 s).
set -euo pipefail
cd "$(dirname "$0")"
/usr/local/cuda/bin/nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/kv-read kv_read.cu -lcuda
/tmp/kv-read
