#!/usr/bin/env bash
# Builds (here, nvcc without a GPU: AR_BIN_DIR=DIR bash run.sh build) and
# runs (there, with DIR carried: AR_BIN_DIR=DIR bash run.sh) the in-kernel
# all-reduce lab (ar.cu). On a machine with fewer GPUs than ranks the ranks
# run co-resident on GPU 0; with 2 or more GPUs they also run one per GPU,
# and NCCL's all-reduce (nccl_ref.py, PyTorch) is timed on the same sizes.
# Output: one RESULT line per run, to stdout and $OUT/tp-allreduce.txt.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BIN=${AR_BIN_DIR:-/tmp/ar-lab}
OUT=${OUT:-/tmp}
mkdir -p "$BIN"
if [[ ${1:-} == build || ! -x $BIN/ar ]]; then
  lib=$(dirname "$(command -v nvcc)")/../lib
  nvcc -O3 -std=c++17 -arch=sm_90 -L"$lib" -o "$BIN/ar" "$HERE/ar.cu" || exit 1
  [[ ${1:-} == build ]] && exit 0
fi
log="$OUT/tp-allreduce.txt"
fails=0
# One lab run; a nonzero exit (an error, a wrong sum, a hang) counts as a
# failure. With --stop, ar exits 0 only when the other ranks failed as they
# should.
run() {
  timeout 60 "$BIN/ar" "$@" > "$BIN/last.txt" 2>&1
  local rc=$?
  tee -a "$log" < "$BIN/last.txt" | grep -E "RESULT|error|need"
  echo "rc=$rc: $*" | tee -a "$log"
  (( rc == 0 )) || fails=$((fails + 1))
}
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
for r in 2 4; do
  for h in 896 3584 5120 8192; do
    for m in 0 1 2; do run --co-resident --ranks "$r" --hidden "$h" --mode "$m" --iters 2000; done
  done
done
# A rank that stops signalling: the others must end with an error, not hang.
for m in 1 2; do
  run --co-resident --ranks 2 --hidden 3584 --mode "$m" --iters 2000 --stop 1,500 --timeout-ms 100
done
if (( gpus >= 2 )); then
  for r in 2 4 8; do
    (( r <= gpus )) || continue
    for h in 3584 5120 8192; do
      for m in 0 1 2; do run --ranks "$r" --hidden "$h" --mode "$m" --iters 2000; done
      NCCL_NVLS_ENABLE=0 timeout 120 python3 "$HERE/nccl_ref.py" --ranks "$r" --hidden "$h" 2>&1 | tee -a "$log" | grep RESULT
    done
    run --ranks "$r" --hidden 8192 --mode 2 --iters 2000 --stop $((r - 1)),500 --timeout-ms 100
  done
fi
echo "$fails failed runs" | tee -a "$log"
(( fails == 0 ))
