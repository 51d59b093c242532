#!/usr/bin/env bash
# GPU machine: builds the GEMM lab, times the variants (LAB_VARIANTS,
# LAB_WHAT; arguments: token counts), optionally profiles one layer of
# each with Nsight Compute (NCU=1). Logs in $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit --format=csv
nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -Xptxas -v gemm_lab.cu -lcuda -lcublas -o /tmp/gemm_lab 2>&1 | grep -E 'error|spill' | sort | uniq -c
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,clocks_throttle_reasons.active --format=csv,noheader -lms 250 > "$OUT/power.csv" &
SMI=$!
timeout ${LAB_TIMEOUT:-300} /tmp/gemm_lab "$@" 2>&1 | tee "$OUT/gemm_lab.log"
kill $SMI
awk -F', ' '{split($2,p," "); split($3,c," "); if (p[1] > 300) {n++; ps+=p[1]; cs+=c[1]}} END {if (n) printf "power samples > 300 W: %d, mean %.0f W, mean SM clock %.0f MHz\n", n, ps/n, cs/n}' "$OUT/power.csv"
if [[ ${NCU:-0} == 1 ]]; then
  LAB_NCU=1 timeout 400 ncu --clock-control none --target-processes all -k 'regex:ws_kernel|ws2_kernel|nvjet|sm90|gemm' \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section LaunchStats \
    /tmp/gemm_lab 2048 > "$OUT/ncu.log" 2>&1
  grep -E '^  [a-zA-Z_].*\(|Duration|SM Frequency|Throughput|Hit Rate|Busy|Eligible|Registers|Warp Cycles|Stall' "$OUT/ncu.log" | head -150
fi
