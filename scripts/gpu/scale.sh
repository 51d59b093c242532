#!/usr/bin/env bash
# Issue 7 on the GPU machine: 14B and 32B shapes (synthetic weights) on both
# backends vs the CPU reference + bench, the 32-bit trap bisected in a real
# decode, the 72B refusal, and (if time remains) compute-sanitizer memcheck
# on one 14B step.
#
#   Here:        bash scripts/gpu/scale.sh build   (-> .carry/scale/, ~20 MB)
#   GPU machine: bash scripts/gpu/scale.sh run     (carry: [".carry/scale"])
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CARRY="$ROOT/.carry/scale"
if [[ ${1:-run} == build ]]; then
  set -e
  cd "$ROOT"
  source "$ROOT/scripts/gpu/build-env.sh"
  cargo build -p qwen-mk --release
  bin=$(cargo test -p qmk-backend-cust --release --test scale --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import sys,json
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m["target"]["name"]=="scale" and m.get("executable"): print(m["executable"])' | tail -1)
  rm -rf "$CARRY"; mkdir -p "$CARRY"
  cp target/release/qwen-mk "$CARRY/qwen-mk"; cp "$bin" "$CARRY/scale-tests"
  strip "$CARRY/qwen-mk" "$CARRY/scale-tests"
  eval "$(bash .ci/nvrtc.sh)"
  QMK_SCALE_PRECOMPILE="$CARRY/cubins" "$CARRY/scale-tests" --ignored --exact precompile_cubins --nocapture
  du -sh "$CARRY"
  exit 0
fi
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export QMK_CACHE_DIR=/tmp/qmk-cubins QMK_SCALE_CUBINS="$CARRY/cubins" RUST_BACKTRACE=1
T=$CARRY/scale-tests
echo "== $(date -u +%FT%TZ) scale.sh"; nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
free -g | head -2
{ "$CARRY/qwen-mk" plan --preset 72b | tail -3; echo "-- bench --preset 72b:"; timeout 30 "$CARRY/qwen-mk" bench --preset 72b; echo "rc=$?";
  echo "-- bench --preset 72b --steps 40000 (KV cache past the device):"; timeout 30 "$CARRY/qwen-mk" bench --preset 72b --steps 40000; echo "rc=$?"; } 2>&1 | tee "$OUT/72b.log"
timeout ${T14:-110} "$T" --test-threads=1 --nocapture --exact scale_14b 2>&1 | tee "$OUT/scale-14b.log"; echo "scale_14b rc=${PIPESTATUS[0]} at ${SECONDS}s"
timeout ${T32:-95} "$T" --test-threads=1 --nocapture --exact scale_32b 2>&1 | tee "$OUT/scale-32b.log"; echo "scale_32b rc=${PIPESTATUS[0]} at ${SECONDS}s"
left=$(( ${BUDGET:-200} - SECONDS - 5 ))
if (( left > 30 )) && [[ -x /usr/local/cuda/bin/compute-sanitizer ]]; then
  timeout $left /usr/local/cuda/bin/compute-sanitizer --tool memcheck "$T" --test-threads=1 --nocapture --exact one_step_14b 2>&1 | tee "$OUT/sanitizer-14b.log" | tail -15
  echo "sanitizer rc=${PIPESTATUS[0]} (limit ${left}s) at ${SECONDS}s"
else echo "sanitizer skipped: ${left}s left"; fi
echo "== summary"; grep -hE "RESULT|BENCH|bisect: |SKIPPED|panicked|test result" "$OUT"/scale-*.log
