#!/usr/bin/env bash
# Issue 9 on the GPU machine: the tensor-core prefill kernel
# (qmk_prefill_chunk) on both backends vs the CPU reference, then time to
# first token.
#
#   Here (Rust, no GPU):  bash scripts/gpu/prefill.sh build
#       -> .carry/prefill/{qwen-mk,prefill-tests} (stripped, git-ignored)
#   GPU machine:          bash scripts/gpu/prefill.sh [tests|sanitize|bench|all]
#       with carry: [".carry/prefill"]; logs under $OUT.
#
# Knobs (environment):
#   QMK_PREFILL_CHUNK  positions per launch in the tests (default 256: 512 and
#                      3000 take several chunks)
#   TEST_FILTER        substring filter for the tests (default: all but the
#                      7B 3000-token case, whose CPU reference is the slow part;
#                      FULL=1 adds it)
#   CHUNKS             chunk sizes the bench sweeps (default "256 512 1024")
#   PRESETS / LENS     bench presets (default "0.5b 7b") and prompt lengths
#                      (default "512 2048")
#   T_TESTS / T_BENCH  time limits, seconds (default 420 / 240)
#   SANITIZE=1         `all` also runs compute-sanitizer memcheck on the small
#                      case (mode `sanitize` runs only that; T_SAN, default 300)
set -uo pipefail
MODE=${1:-all}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CARRY=${CARRY:-$ROOT/.carry/prefill}

if [[ $MODE == build ]]; then
  set -e
  cd "$ROOT"
  eval "$(bash .ci/stub-libcuda.sh)"
  # find_cuda_helper 0.2 only searches $CUDA_LIBRARY_PATH/lib64.
  if [[ ! -e "$CUDA_LIBRARY_PATH/lib64" ]]; then
    mkdir -p /tmp/qmk-cust-stub && ln -sfn "$CUDA_LIBRARY_PATH" /tmp/qmk-cust-stub/lib64
    export CUDA_LIBRARY_PATH=/tmp/qmk-cust-stub
  fi
  cargo build -p qwen-mk --release
  bin=$(cargo test -p qmk-backend-cust --release --test prefill --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import sys,json
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m["target"]["name"]=="prefill" and m.get("executable"): print(m["executable"])' | tail -1)
  rm -rf "$CARRY"; mkdir -p "$CARRY"
  cp target/release/qwen-mk "$CARRY/qwen-mk"; cp "$bin" "$CARRY/prefill-tests"
  strip "$CARRY/qwen-mk" "$CARRY/prefill-tests"
  du -sh "$CARRY"
  exit 0
fi

OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export QMK_CACHE_DIR=${QMK_CACHE_DIR:-/tmp/qmk-cubins} RUST_BACKTRACE=1
summary=()
echo "== $(date -u +%FT%TZ) prefill.sh mode=$MODE"
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/nvidia-smi-prefill.txt"

if [[ $MODE == tests || $MODE == all ]]; then
  if [[ -n ${TEST_FILTER:-} ]]; then
    filt=("$TEST_FILTER")
  elif [[ ${FULL:-0} == 1 ]]; then
    filt=()
  else
    filt=(--skip c_7b_prompt_3000)
  fi
  # Errors + a decode/prefill continuation first (small, 0.5B), then every
  # prompt length, 0.5B then 7B (the weights and CPU references are shared
  # by the two backends' instances of each test).
  timeout ${T_TESTS:-420} "$CARRY/prefill-tests" --test-threads=1 --nocapture "${filt[@]}" 2>&1 \
    | tee "$OUT/prefill-tests.log"
  summary+=("prefill-tests rc=${PIPESTATUS[0]}")
fi

if [[ $MODE == sanitize || ( $MODE == all && ${SANITIZE:-0} == 1 ) ]]; then
  # memcheck on the small case (0.5B, 3 decode steps + 40 prompt positions
  # in chunks of 16): out-of-bounds fragment loads show up here first.
  if [[ -x /usr/local/cuda/bin/compute-sanitizer ]]; then
    timeout ${T_SAN:-300} /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
      "$CARRY/prefill-tests" --test-threads=1 --nocapture --exact a_errors_and_continuation::cudarc 2>&1 \
      | tee "$OUT/prefill-memcheck.log" | tail -15
    summary+=("memcheck rc=${PIPESTATUS[0]}")
  else
    summary+=("memcheck skipped: no compute-sanitizer")
  fi
fi

if [[ $MODE == bench || $MODE == all ]]; then
  : > "$OUT/prefill-bench.jsonl"
  for preset in ${PRESETS:-0.5b 7b}; do
    for n in ${LENS:-512 2048}; do
      for c in ${CHUNKS:-256 512 1024}; do
        (( c > n )) && continue
        echo "-- bench --preset $preset --prefill $n --prefill-chunk $c"
        timeout ${T_BENCH:-240} "$CARRY/qwen-mk" bench --preset "$preset" --backend cudarc \
          --prefill "$n" --prefill-chunk "$c" --json 2>&1 | tee -a "$OUT/prefill-bench.jsonl"
        summary+=("bench $preset n=$n chunk=$c rc=${PIPESTATUS[0]}")
      done
    done
  done
fi

echo "== summary"
printf '%s\n' "${summary[@]}"
grep -hE "^test |test result|SKIPPED|rel err|panicked" "$OUT"/prefill-tests.log 2>/dev/null | tail -40
grep -h ttft_ms "$OUT"/prefill-bench.jsonl 2>/dev/null | python3 -c '
import sys, json
for l in sys.stdin:
    try: v = json.loads(l)
    except Exception: continue
    print("%5s n=%5d chunk=%5d: TTFT %.2f ms (%.1f TFLOP/s), %s regs, grid %s" % (v["preset"], v["prefill_tokens"], v["chunk"], v["ttft_ms"], v["tflops"], v["registers"], v["grid"]))' || true
