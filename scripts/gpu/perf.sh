#!/usr/bin/env bash
# Issue 8 (decode performance) on the GPU machine: correctness of the
# split attention (flash-decoding) and of the warp-major row map, then the
# decode bench with its A/B profile at short and long context, then Hugging
# Face transformers eager on the same shapes (scripts/gpu/hf_side_by_side.py).
#
#   Here (Rust, no GPU):  bash scripts/gpu/perf.sh build
#       -> .carry/perf/perf-bin.tar.xz (stripped binaries, xz: the carry
#          budget is 16 MB): qwen-mk (cudarc + cust), gpu-tests (cudarc
#          tests/gpu.rs), cust-gpu-tests (cust tests/gpu.rs, both backends),
#          long-context-tests (cust tests/long_context.rs, both backends)
#   GPU machine:          bash scripts/gpu/perf.sh run
#       with carry: [".carry/perf"]; logs under $LOGDIR/perf/ (LOGDIR
#       defaults to $PWD/gpu-out); bench JSON lines in perf/bench.jsonl,
#       HF JSON in perf/hf.json.
#
# `run`: in this order, under one wall-time budget (BUDGET seconds, default
# 200); a step that no longer fits is skipped and says so; every command
# runs under `timeout`; a failure never stops the script; the summary
# (PASS / FAIL / SKIP per check, key numbers) is printed last.
#   1. long-context tests (split attention vs CPU reference at 2,048
#      positions, split vs v1.2 attention at 8,300 (0.5B) and 1,100 (7B), short forced split,
#      warp-major bit-identical), both backends            ~45 s
#   2. cust tests/gpu.rs: decode vs CPU reference 0.5B/7B, determinism,
#      errors, cudarc == cust bit-identical                 ~37 s
#   3. cudarc tests/gpu.rs without its 7B case (covered by 2; FULL=1 runs
#      it too)                                              ~12 s
#   4. bench --profile 0.5b, 7b (short context), both backends' default
#      bench for 0.5b on cust                              ~30 s
#   5. bench 0.5b --context 8192 --profile; 7b --context 8192,32768
#      --profile (split on; the profile times split off and warp-major in
#      the same process)                                    ~35 s
#   6. hf_side_by_side.py (HF_BUDGET s, default what is left, at most 80;
#      it skips 14B first, then 7B, saying so)
#   7. bench --profile 14b (last: at 200 s it usually does not fit; run
#      `perf.sh bench` or BUDGET=300 for it)                ~30 s
# Other modes: `tests`, `bench`, `hf` (one part each, no budget).
# Knobs: BUDGET, FULL=1, STEPS (timed steps, default 200), HF_BUDGET.
set -uo pipefail
MODE=${1:-run}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CARRY=${CARRY:-$ROOT/.carry/perf}

if [[ $MODE == build ]]; then
  set -e
  cd "$ROOT"
  source "$ROOT/scripts/gpu/build-env.sh"
  stage=$(mktemp -d)
  # Copy at once and check the feature: other sessions share target/ and may
  # rebuild target/release/qwen-mk without it in between.
  cargo build -p qwen-mk --release --features cust
  cp target/release/qwen-mk "$stage/qwen-mk"
  if "$stage/qwen-mk" bench --backend cust --preset nope 2>&1 | grep -q "built without the cust"; then
    echo "target/release/qwen-mk lacks the cust feature (a concurrent build?): run build again"; exit 1
  fi
  testbin() {  # crate test-target -> path of the release test executable
    cargo test -p "$1" --release --test "$2" --no-run --message-format=json 2>/dev/null \
      | python3 -c 'import sys,json
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m["target"]["name"]==sys.argv[1] and m.get("executable"): print(m["executable"])' "$2" | tail -1
  }
  a=$(testbin qmk-backend-cudarc gpu); b=$(testbin qmk-backend-cust gpu); c=$(testbin qmk-backend-cust long_context)
  [[ -n $a && -n $b && -n $c ]] || { echo "a test binary is missing: '$a' '$b' '$c'"; exit 1; }
  cp "$a" "$stage/gpu-tests"
  cp "$b" "$stage/cust-gpu-tests"; cp "$c" "$stage/long-context-tests"
  strip "$stage"/*
  rm -rf "$CARRY"; mkdir -p "$CARRY"
  tar -C "$stage" -cf - . | xz -9 -T1 > "$CARRY/perf-bin.tar.xz"
  rm -rf "$stage"
  ls -la "$CARRY"; du -sh "$CARRY"
  exit 0
fi

LOGDIR=${LOGDIR:-$PWD/gpu-out}
LOG="$LOGDIR/perf"; mkdir -p "$LOG"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export QMK_CACHE_DIR=${QMK_CACHE_DIR:-/tmp/qmk-cubins} RUST_BACKTRACE=1
# `exp` and `final` time more rows than `run`.
case $MODE in exp|final) BUDGET=${BUDGET:-400} ;; *) BUDGET=${BUDGET:-200} ;; esac
STEPS=${STEPS:-200}
T0=$SECONDS
summary=()
left() { echo $(( BUDGET - (SECONDS - T0) )); }
echo "== $(date -u +%FT%TZ) perf.sh mode=$MODE budget=${BUDGET}s"
timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm,clocks.mem --format=csv 2>&1 \
  | tee "$LOG/nvidia-smi.txt"
# Outside $LOGDIR: the logs are packed and sent back, the binaries need not be.
BIN=${BIN:-/tmp/qmk-perf-bin}; mkdir -p "$BIN"
if [[ -f $CARRY/perf-bin.tar.xz ]]; then
  timeout 60 tar -C "$BIN" -xJf "$CARRY/perf-bin.tar.xz" || echo "FAILED to unpack $CARRY/perf-bin.tar.xz"
else
  echo "MISSING $CARRY/perf-bin.tar.xz (run 'bash scripts/gpu/perf.sh build' here and carry .carry/perf)"
fi

# tests NAME BINARY NEED LIMIT [args...]: one test process, logged to
# $LOG/NAME.log. PASS needs rc 0, "test result: ok", no SKIPPED line (on the
# GPU machine a skip means no device: a failure here).
tests() {
  local name=$1 bin=$2 need=$3 lim=$4; shift 4
  local l; l=$(left)
  if (( l < need )); then summary+=("SKIP tests $name (budget: ${l}s left, needs ~${need}s)"); return; fi
  (( lim > l )) && lim=$l
  local t=$SECONDS
  timeout -k 5 "$lim" "$BIN/$bin" --test-threads=1 --nocapture "$@" > "$LOG/$name.log" 2>&1
  local rc=$? verdict=FAIL
  if [[ $rc == 0 ]] && grep -q "^test result: ok" "$LOG/$name.log" && ! grep -q "SKIPPED" "$LOG/$name.log"; then
    verdict=PASS
  fi
  (( rc == 124 || rc == 137 )) && verdict="FAIL (timeout ${lim}s)"
  # The harness's own count (with --nocapture a test's output splits its
  # "test ... ok" line, so those lines cannot be counted).
  local ran; ran=$(grep -oE "[0-9]+ passed; [0-9]+ failed" "$LOG/$name.log" | tail -1)
  summary+=("$verdict tests $name: rc=$rc, ${ran:-no result}, $(( SECONDS - t ))s (log perf/$name.log)")
  while read -r x; do summary+=("    ${x:0:170}"); done < <(grep -E "panicked|^test .*FAILED" "$LOG/$name.log" | head -4)
}

# bench NAME NEED LIMIT [qwen-mk bench args...]: JSON lines appended to
# $LOG/bench.jsonl (each tagged with "run": NAME), stderr to bench.log.
bench() {
  local name=$1 need=$2 lim=$3; shift 3
  local l; l=$(left)
  if (( l < need )); then summary+=("SKIP bench $name (budget: ${l}s left, needs ~${need}s)"); return; fi
  (( lim > l )) && lim=$l
  local t=$SECONDS
  echo "-- $name: qwen-mk bench $*" >> "$LOG/bench.log"
  timeout -k 5 "$lim" "$BIN/qwen-mk" bench --json --steps "$STEPS" "$@" > "$LOG/.bench.out" 2>> "$LOG/bench.log"
  local rc=$?
  cat "$LOG/.bench.out" >> "$LOG/bench.log"
  python3 -c 'import sys,json
for l in open(sys.argv[1]):
    try: v=json.loads(l)
    except Exception: continue
    v["run"]=sys.argv[2]; print(json.dumps(v))' "$LOG/.bench.out" "$name" >> "$LOG/bench.jsonl"
  if [[ $rc != 0 ]] || ! grep -q tok_per_s "$LOG/.bench.out"; then
    summary+=("FAIL bench $name rc=$rc $(( SECONDS - t ))s (log perf/bench.log: $(tail -1 "$LOG/bench.log" | cut -c1-120))")
  else
    summary+=("PASS bench $name $(( SECONDS - t ))s")
  fi
}

hf() {
  local l; l=$(left)
  local hb=${HF_BUDGET:-$(( l < 80 ? l : 80 ))}
  if (( hb < 25 )); then summary+=("SKIP hf_side_by_side (budget: ${l}s left)"); return; fi
  local t=$SECONDS
  timeout -k 5 $(( hb + 20 )) python3 "$ROOT/scripts/gpu/hf_side_by_side.py" --budget "$hb" \
    --json-out "$LOG/hf.json" "$LOG/bench.jsonl" "$LOGDIR/prefill/bench.jsonl" > "$LOG/hf.log" 2>&1
  local rc=$?
  summary+=("$([[ $rc == 0 ]] && echo PASS || echo FAIL) hf_side_by_side rc=$rc $(( SECONDS - t ))s (log perf/hf.log)")
}

# `exp`: the A/B decision run (correctness of the split attention and row
# maps, then every profile row); `final`: every decode GPU test on both
# backends, every row of the issue's table on both backends (profile on
# cudarc), then HF side by side (reads prefill/bench.jsonl too, so run
# prefill.sh first in the same pass).
if [[ $MODE == exp ]]; then
  tests long-context long-context-tests 30 150
  : > "$LOG/bench.jsonl"; : > "$LOG/bench.log"
  bench 0.5b-short 5 45 --preset 0.5b --profile
  bench 7b-short 12 60 --preset 7b --profile
  bench 0.5b-long 5 45 --preset 0.5b --context 8192 --profile
  bench 7b-long 25 90 --preset 7b --context 8192,32768 --profile
  bench 14b-short 26 90 --preset 14b --profile
fi
if [[ $MODE == final ]]; then
  tests long-context long-context-tests 30 150
  tests cust-gpu cust-gpu-tests 25 150
  tests cudarc-gpu gpu-tests 15 150
  : > "$LOG/bench.jsonl"; : > "$LOG/bench.log"
  for be in cudarc cust; do
    prof=(); [[ $be == cudarc ]] && prof=(--profile)
    bench 0.5b-$be 5 60 --preset 0.5b --backend $be "${prof[@]}"
    bench 7b-$be 12 90 --preset 7b --backend $be "${prof[@]}"
    bench 0.5b-long-$be 5 60 --preset 0.5b --backend $be --context 8192 "${prof[@]}"
    bench 7b-long-$be 25 120 --preset 7b --backend $be --context 8192,32768 "${prof[@]}"
    bench 14b-$be 26 120 --preset 14b --backend $be "${prof[@]}"
    bench 32b-$be 45 150 --preset 32b --backend $be
  done
  hf
fi
if [[ $MODE == run || $MODE == tests ]]; then
  [[ $MODE == tests ]] && BUDGET=100000
  tests long-context long-context-tests 30 120
  tests cust-gpu cust-gpu-tests 25 120
  if [[ ${FULL:-0} == 1 ]]; then
    tests cudarc-gpu gpu-tests 25 120
  else
    tests cudarc-gpu gpu-tests 8 60 --skip megakernel_matches_reference_7b
  fi
fi
if [[ $MODE == run || $MODE == bench ]]; then
  [[ $MODE == bench ]] && BUDGET=100000
  : > "$LOG/bench.jsonl"; : > "$LOG/bench.log"
  bench 0.5b-short 8 45 --preset 0.5b --profile
  bench 7b-short 18 60 --preset 7b --profile
  bench 0.5b-long 8 45 --preset 0.5b --context 8192 --profile
  bench 7b-long 25 90 --preset 7b --context 8192,32768 --profile
  bench 0.5b-short-cust 6 30 --preset 0.5b --backend cust
fi
if [[ $MODE == run || $MODE == hf ]]; then
  [[ $MODE == hf ]] && BUDGET=${HF_BUDGET:-80}
  hf
fi
if [[ $MODE == run || $MODE == bench ]]; then
  bench 14b-short 30 90 --preset 14b --profile
fi

echo "== summary (perf, $(( SECONDS - T0 ))s)"
printf '%s\n' "${summary[@]}"
# Correctness numbers: one line per long-context test that passed.
grep -hE ": PASS: " "$LOG"/long-context.log 2>/dev/null | cut -c1-200 | head -6
grep -hE "vs CPU reference: [0-9]+ greedy steps" "$LOG"/cust-gpu.log 2>/dev/null | head -4
# Bench table: one line per run/context, then the A/B profile deltas.
python3 - "$LOG/bench.jsonl" <<'EOF' 2>/dev/null || true
import sys, json
target = {("0.5b", 0): 70, ("7b", 0): 92, ("14b", 0): 92, ("32b", 0): 90,
          ("0.5b", 8192): 85, ("7b", 8192): 85, ("7b", 32768): 80}
for l in open(sys.argv[1]):
    try: v = json.loads(l)
    except Exception: continue
    ctx = v.get("context", 0) if v.get("first_timed_pos", 0) >= 1000 else 0
    t = target.get((v["preset"], ctx))
    mark = "" if t is None else ("  target %d%% %s" % (t, "MET" if v["pct_of_floor"] >= t else "not met"))
    print("%-5s %-6s ctx %5d: %8.1f tok/s %8.1f us  %5.1f%% of floor (KV %.0f MB/step)%s" % (
        v["preset"], v["backend"], ctx, v["tok_per_s"], v["us_per_step"], v["pct_of_floor"],
        v.get("kv_bytes", 0) / 1e6, mark))
    p = v.get("profile_us") or {}
    f = p.get("full")
    if f:
        def d(k):
            x = p.get(k)
            return "n/a" if x is None else "%+.1f" % (x - f)
        print("      profile: full %.1f us; no split %s, split forced %s, warp-major %s, cta-major (v1.2 map) %s, split v1.3 %s; attention %.1f (default) / %.1f (v1.2); barriers %.1f" % (
            f, d("full, attention no split (v1.2)"), d("full, split forced"), d("full, warp-major"), d("full, cta-major (v1.2 map)"), d("full, split v1.3"),
            f - p.get("skip attention", f), p.get("full, attention no split (v1.2)", f) - p.get("skip attention, no split", f),
            p.get("barriers only", 0)))
EOF
[[ -f $LOG/hf.log ]] && grep -E "^(HF |shape|  [0-9]|  \(speed)" "$LOG/hf.log" | head -20
exit 0
