#!/usr/bin/env bash
# The whole GPU check-and-measure pass, run on the GPU machine (no Rust
# there): prebuilt binaries come in .carry/ (see scripts/gpu/build-carry.sh).
#
#   bash scripts/gpu/check.sh [smoke|tests|bench|all]   (default: all)
#
# Logs go to $OUT (or ./gpu-out). Prints a short summary last.
set -uo pipefail
MODE=${1:-all}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
CARRY=${CARRY:-$PWD/.carry}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export QMK_CACHE_DIR=${QMK_CACHE_DIR:-/tmp/qmk-cubins}
export RUST_BACKTRACE=1
summary=()

echo "== $(date -u +%FT%TZ) mode=$MODE"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
ls /usr/local/cuda/lib64/libnvrtc.so* 2>&1 | head -3

if [[ $MODE == smoke || $MODE == all || $MODE == tests ]]; then
  "$CARRY/qwen-mk" --version
  "$CARRY/gpu-tests" --list 2>&1 | tail -6
fi

if [[ $MODE == smoke ]]; then
  timeout 300 "$CARRY/gpu-tests" --test-threads=1 --nocapture megakernel_matches_reference_0_5b 2>&1 | tee "$OUT/smoke.log"
  summary+=("smoke rc=${PIPESTATUS[0]}")
fi

if [[ $MODE == tests || $MODE == all ]]; then
  # One process per test: a sticky CUDA error in one cannot hide the others.
  : > "$OUT/gpu-tests.log"
  for t in megakernel_matches_reference_0_5b logits_are_bit_identical trap_probe cubin_from_file megakernel_matches_reference_7b; do
    timeout 300 "$CARRY/gpu-tests" --test-threads=1 --nocapture "$t" 2>&1 | tee -a "$OUT/gpu-tests.log"
    rc=${PIPESTATUS[0]}
    summary+=("gpu-test $t rc=$rc")
    if [[ $rc != 0 && $t == megakernel_matches_reference_0_5b ]]; then
      # Where did it go wrong? memcheck names the kernel line (line info is on).
      timeout 240 compute-sanitizer --tool memcheck --print-limit 4 "$CARRY/gpu-tests" --test-threads=1 --nocapture "$t" > "$OUT/sanitizer.log" 2>&1
      head -60 "$OUT/sanitizer.log"
    fi
  done
fi

if [[ $MODE == bench || $MODE == all ]]; then
  : > "$OUT/bench.jsonl"
  for p in ${BENCH_PRESETS:-0.5b 7b 14b}; do
    timeout 240 "$CARRY/qwen-mk" bench --preset "$p" --backend cudarc --json ${BENCH_ARGS:-} 2>>"$OUT/bench.err" | tee -a "$OUT/bench.jsonl"
    summary+=("bench $p rc=${PIPESTATUS[0]}")
  done
fi

echo "== summary"
printf '%s\n' "${summary[@]}"
grep -hE "^test |test result|max rel err|trap probe|  (split|unsplit)|determinism|error paths| -> " "$OUT"/*.log 2>/dev/null | tail -30
cat "$OUT/bench.jsonl" 2>/dev/null

# Exit non-zero when any step failed (the greps above only report).
! printf %s\\n "${summary[@]}" | grep -qv "rc=0$"
