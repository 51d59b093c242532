#!/usr/bin/env bash
# Re-validation after host-side refactors: the cudarc GPU tests, the generic
# both-backends tests (cudarc == cust bit for bit, each vs the CPU reference),
# and the error/abort test again with the status block in mapped host memory.
# Build here first: bash scripts/gpu/build-carry.sh && bash scripts/gpu/cust-and-bench.sh build
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
bash scripts/gpu/check.sh tests > "$OUT/check-tests.log" 2>&1
echo "check.sh tests rc=$?"
TEST_TIMEOUT=240 bash scripts/gpu/cust-and-bench.sh tests > "$OUT/cust-tests.log" 2>&1
echo "cust-and-bench tests rc=$?"
QMK_STATUS_MAPPED=1 timeout 120 .carry/cust/cust-gpu-tests --test-threads=1 --nocapture a_errors_and_determinism \
  > "$OUT/mapped-status.log" 2>&1
echo "mapped status errors test rc=$?"
grep -hE "^test .*(ok|FAILED)|test result|max rel err|bit-identical|first wrong|no wrong layer" "$OUT"/*.log | sort | uniq | head -40
