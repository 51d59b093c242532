#!/usr/bin/env bash
# The cust backend's GPU tests (both backends, one generic test each, plus
# the cudarc == cust bit-identity check) and `cargo bench`'s backend
# comparison, from prebuilt binaries.
#
#   Here (Rust, no GPU):   bash scripts/gpu/cust-and-bench.sh build
#     builds against the stub libcuda (.ci/stub-libcuda.sh), strips, and
#     copies the two executables to .carry/cust/ (git-ignored; ~25 MB).
#   GPU machine:           bash scripts/gpu/cust-and-bench.sh [tests|bench|all]
#     with `carry: [".carry"]`; logs and the bench table go to $OUT.
#
# The binaries have no rpath: on the GPU machine they load the real
# libcuda.so.1 from the driver, and NVRTC from /usr/local/cuda/lib64.
set -uo pipefail
MODE=${1:-all}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CARRY=${CARRY:-$ROOT/.carry/cust}

if [[ $MODE == build ]]; then
  set -e
  cd "$ROOT"
  source "$ROOT/scripts/gpu/build-env.sh"
  exe() { # cargo args... -> path of the named target's executable
    local name=$1; shift
    cargo "$@" --message-format=json 2>/dev/null | python3 -c '
import sys, json
name = sys.argv[1]
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == name and m.get("executable"):
        print(m["executable"])' "$name" | tail -1
  }
  cargo test -p qmk-backend-cust --release --no-run
  cargo bench -p qmk-benches --no-run
  tests=$(exe gpu test -p qmk-backend-cust --release --no-run)
  bench=$(exe backends bench -p qmk-benches --no-run)
  mkdir -p "$CARRY"
  cp "$tests" "$CARRY/cust-gpu-tests"
  cp "$bench" "$CARRY/backend-bench"
  strip "$CARRY/cust-gpu-tests" "$CARRY/backend-bench"
  ls -la "$CARRY"
  exit 0
fi

OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export QMK_CACHE_DIR=${QMK_CACHE_DIR:-/tmp/qmk-cubins}
export RUST_BACKTRACE=1
summary=()
echo "== $(date -u +%FT%TZ) cust-and-bench mode=$MODE"
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1 | tee "$OUT/nvidia-smi-cust.txt"

if [[ $MODE == tests || $MODE == all ]]; then
  # 0.5B and 7B: both backends vs the CPU reference, cudarc == cust bit
  # for bit, error paths. The 7B CPU reference is computed once and shared.
  timeout ${TEST_TIMEOUT:-480} "$CARRY/cust-gpu-tests" --test-threads=1 --nocapture ${TEST_FILTER:-} 2>&1 | tee "$OUT/cust-gpu-tests.log"
  summary+=("cust-gpu-tests rc=${PIPESTATUS[0]}")
fi

if [[ $MODE == bench || $MODE == all ]]; then
  # criterion needs a writable target dir for its reports.
  export CRITERION_HOME=${CRITERION_HOME:-/tmp/criterion}
  QMK_BENCH_TABLE="$OUT/bench-table.md" timeout ${BENCH_TIMEOUT:-420} \
    "$CARRY/backend-bench" --bench 2>&1 | tee "$OUT/backend-bench.log"
  summary+=("backend-bench rc=${PIPESTATUS[0]}")
fi

echo "== summary"
printf '%s\n' "${summary[@]}"
grep -hE "^test |test result|SKIPPED|max rel err|bit-identical|reset recovers" "$OUT"/cust-gpu-tests.log 2>/dev/null | tail -20
grep -hE "time:|thrpt:" -B1 "$OUT"/backend-bench.log 2>/dev/null | grep -vE "^--" | tail -24
cat "$OUT/bench-table.md" 2>/dev/null

# Exit non-zero when any step failed (the greps above only report).
! printf %s\\n "${summary[@]}" | grep -qv "rc=0$"
