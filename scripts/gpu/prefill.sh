#!/usr/bin/env bash
# Issue 9 on the GPU machine: the tensor-core prefill kernel
# (qmk_prefill_chunk) on both backends vs the CPU reference, time to first
# token, and the step-by-step vs batched threshold table.
#
#   Here (Rust, no GPU):  bash scripts/gpu/prefill.sh build
#       -> .carry/prefill/{qwen-mk,prefill-tests} (stripped, git-ignored)
#   GPU machine:          bash scripts/gpu/prefill.sh [run|all|final|quick|debug|profile|explore|ncu|tests|sanitize|bench]
#       with carry: [".carry/prefill"]; logs under $LOGDIR/prefill/
#       (LOGDIR defaults to $PWD/gpu-out).
#
# `run` (= `all`): everything below in priority order under one wall-time
# budget (BUDGET seconds, default 145); a step that no longer fits is
# skipped and says so. Every command runs under `timeout`; a failure never
# stops the script. The summary (PASS / FAIL / SKIP per check, TTFT table,
# threshold table) is printed last, under 40 lines.
#   1. tests, 0.5B: errors + continuation, prompts 1 / 17 / 512, both backends
#   2. bench 0.5B: 512 (chunk 512), 2048 (chunks 512, 2048)
#   3. tests, 7B: prompts 512 and 17, both backends; threshold table (cudarc)
#   4. bench 7B: 512 (chunk 512), 2048 (chunks 2048, 512)
#   5. threshold table 0.5B (both backends)
#   6. tests, 0.5B prompt 3000 (both backends)
#   7. if time is left: 7B prompt 1 (both), bench 0.5B 512 chunk 256
# The 7B 3000-token case is not in `run`: its CPU reference prefill is ~40
# TFLOP (~3-4 min on the 16 cores there). `tests` with FULL=1 runs it.
#
# Other modes: `tests` (every test but c_7b_prompt_3000 unless FULL=1;
# TEST_FILTER overrides), `bench` (PRESETS x LENS x CHUNKS), `sanitize`
# (compute-sanitizer memcheck on the small case).
# Knobs: QMK_PREFILL_CHUNK (test chunk, default 256), BUDGET, T_TESTS,
# T_BENCH, T_SAN.
set -uo pipefail
MODE=${1:-run}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CARRY=${CARRY:-$ROOT/.carry/prefill}

if [[ $MODE == build ]]; then
  set -e
  cd "$ROOT"
  source "$ROOT/scripts/gpu/build-env.sh"
  cargo build -p qwen-mk --release
  bin=$(cargo test -p qmk-backend-cust --release --test prefill --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import sys,json
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m["target"]["name"]=="prefill" and m.get("executable"): print(m["executable"])' | tail -1)
  rm -rf "$CARRY"; mkdir -p "$CARRY"
  cp target/release/qwen-mk "$CARRY/qwen-mk"; cp "$bin" "$CARRY/prefill-tests"
  # Reference files written here (REF_DIR, default /tmp/qmk-ref) ride along.
  if ls "${REF_DIR:-/tmp/qmk-ref}"/*.bin >/dev/null 2>&1; then
    mkdir -p "$CARRY/ref"; cp "${REF_DIR:-/tmp/qmk-ref}"/*.bin "$CARRY/ref/"
  fi
  strip "$CARRY/qwen-mk" "$CARRY/prefill-tests"
  du -sh "$CARRY"
  exit 0
fi

LOGDIR=${LOGDIR:-$PWD/gpu-out}
LOG="$LOGDIR/prefill"; mkdir -p "$LOG"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export QMK_CACHE_DIR=${QMK_CACHE_DIR:-/tmp/qmk-cubins} RUST_BACKTRACE=1
BUDGET=${BUDGET:-145}
T0=$SECONDS
summary=()
left() { echo $(( BUDGET - (SECONDS - T0) )); }
echo "== $(date -u +%FT%TZ) prefill.sh mode=$MODE budget=${BUDGET}s"
timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm,clocks.mem --format=csv 2>&1 \
  | tee "$LOG/nvidia-smi.txt"
[[ -x $CARRY/prefill-tests && -x $CARRY/qwen-mk ]] || echo "MISSING binaries in $CARRY (run 'build' here and carry .carry/prefill)"

# tests NAME NEED LIMIT [test-binary args...]: one test process, logged to
# $LOG/NAME.log. PASS needs rc 0, "test result: ok", no SKIPPED line (on the
# GPU machine a skip means no device: a failure here).
tests() {
  local name=$1 need=$2 lim=$3; shift 3
  local l; l=$(left)
  if (( l < need )); then summary+=("SKIP tests $name (budget: ${l}s left, needs ~${need}s)"); return; fi
  (( lim > l )) && lim=$l
  local t=$SECONDS
  timeout -k 5 "$lim" "$CARRY/prefill-tests" --test-threads=1 --nocapture "$@" > "$LOG/$name.log" 2>&1
  local rc=$? verdict=FAIL
  if [[ $rc == 0 ]] && grep -q "^test result: ok" "$LOG/$name.log" && ! grep -q "^SKIPPED\|SKIPPED " "$LOG/$name.log"; then
    verdict=PASS
  fi
  (( rc == 124 || rc == 137 )) && verdict="FAIL (timeout ${lim}s)"
  local ran; ran=$(grep -oE "[0-9]+ passed; [0-9]+ failed" "$LOG/$name.log" | tail -1)
  grep -q "SKIPPED " "$LOG/$name.log" && ran="$ran, $(grep -c "SKIPPED " "$LOG/$name.log") SKIPPED"
  summary+=("$verdict tests $name: rc=$rc, ${ran:-no result}, $(( SECONDS - t ))s (log prefill/$name.log)")
  while read -r x; do summary+=("    ${x:0:160}"); done < <(grep -E "panicked|^test .*FAILED" "$LOG/$name.log" | head -3)
}

# bench PRESET N CHUNK NEED LIMIT [FLAGS]: qwen-mk bench --prefill, JSON
# appended to $LOG/bench.jsonl (FLAGS: --kernel-flags, e.g. 262144 =
# FLAG_PF_MMA_SYNC, the mma.sync GEMM instead of wgmma on sm_90a).
bench() {
  local preset=$1 n=$2 c=$3 need=$4 lim=$5 flags=${6:-0}
  local l; l=$(left)
  if (( l < need )); then summary+=("SKIP bench $preset n=$n chunk=$c (budget: ${l}s left)"); return; fi
  (( lim > l )) && lim=$l
  echo "-- bench --preset $preset --prefill $n --prefill-chunk $c --kernel-flags $flags" >> "$LOG/bench.log"
  timeout -k 5 "$lim" "$CARRY/qwen-mk" bench --preset "$preset" --backend cudarc \
    --prefill "$n" --prefill-chunk "$c" --kernel-flags "$flags" --json > "$LOG/.bench.out" 2>> "$LOG/bench.log"
  local rc=$?
  cat "$LOG/.bench.out" >> "$LOG/bench.log"
  grep ttft_ms "$LOG/.bench.out" >> "$LOG/bench.jsonl"
  # Successes show in the TTFT table below.
  if [[ $rc != 0 ]] || ! grep -q ttft_ms "$LOG/.bench.out"; then
    summary+=("FAIL bench $preset n=$n chunk=$c rc=$rc (log prefill/bench.log)")
  fi
}

# profile PRESET:N:CHUNK NEED LIMIT: qwen-mk bench --prefill --profile
# (each phase skipped in turn, the GEMM A/B flags), appended to
# $LOG/profile.log; FLAGS: extra --kernel-flags.
profile() {
  local pr n c l; IFS=: read -r pr n c <<< "$1"
  l=$(left)
  if (( l < $2 )); then summary+=("SKIP profile $1 (budget: ${l}s left)"); return; fi
  echo "-- bench --preset $pr --prefill $n --prefill-chunk $c --profile" >> "$LOG/profile.log"
  timeout -k 5 "$3" "$CARRY/qwen-mk" bench --preset "$pr" --backend cudarc --prefill "$n" \
    --prefill-chunk "$c" --profile --kernel-flags "${FLAGS:-0}" >> "$LOG/profile.log" 2>&1 \
    || summary+=("FAIL profile $1")
}

if [[ $MODE == run || $MODE == all ]]; then
  : > "$LOG/bench.jsonl"; : > "$LOG/bench.log"
  tests t1-0.5b 20 60 a_errors_and_continuation b_0_5b_prompt_1:: b_0_5b_prompt_17 b_0_5b_prompt_512
  bench 0.5b 512 512 6 30
  bench 0.5b 2048 512 6 30
  bench 0.5b 2048 2048 6 30
  tests t2-7b 45 90 c_7b_prompt_512 c_7b_prompt_17 c_7b_threshold::cudarc
  bench 7b 512 512 12 40
  bench 7b 2048 2048 12 40
  bench 7b 2048 512 12 40
  tests t3-threshold-0.5b 8 30 b_0_5b_threshold
  tests t4-0.5b-3000 22 60 b_0_5b_prompt_3000
  tests t5-7b-1 18 45 c_7b_prompt_1::
  bench 0.5b 512 256 6 30
fi

# quick: correctness (0.5B, 7B 17 / 512) and time to first token; AB=1
# adds the mma.sync GEMM (FLAG_PF_MMA_SYNC) at 7B for the wgmma A/B.
if [[ $MODE == quick ]]; then
  : > "$LOG/bench.jsonl"; : > "$LOG/bench.log"
  tests t1-0.5b 20 90 a_errors_and_continuation b_0_5b_prompt_1:: b_0_5b_prompt_17 b_0_5b_prompt_512
  bench 0.5b 512 512 6 60
  bench 0.5b 2048 2048 6 30
  bench 7b 512 512 12 120
  bench 7b 2048 2048 12 40
  [[ ${AB:-0} == 1 ]] && bench 7b 512 512 12 40 262144
  [[ ${AB:-0} == 1 ]] && bench 7b 2048 2048 12 40 262144
  tests t2-7b 45 90 c_7b_prompt_512 c_7b_prompt_17
  tests t3-stream-k 20 90 d_stream_k
fi

# profile: where the time goes (bench --prefill --profile: each phase
# skipped in turn), 7B and 0.5B.
if [[ $MODE == profile ]]; then
  : > "$LOG/profile.log"
  for spec in ${PROFILE_RUNS:-7b:2048:2048 7b:512:512 0.5b:2048:2048 0.5b:512:512}; do
    profile "$spec" 0 120
  done
  grep -E "^--|time to first|profile" "$LOG/profile.log" | tail -40
fi

# final: every correctness case on both backends (7B at 3,000 tokens
# against the reference file carried in $CARRY/ref, written here by
# `write_reference`, see crates/backend-cust/tests/prefill.rs), the
# stream-K vs data-parallel agreement, the TTFT table, the 7B profiles with
# the in-process GEMM A/B, and HF eager in the same run.
if [[ $MODE == final ]]; then
  : > "$LOG/bench.jsonl"; : > "$LOG/bench.log"; : > "$LOG/profile.log"
  tests f1-0.5b 30 150 a_errors_and_continuation b_0_5b_prompt_1:: b_0_5b_prompt_17 b_0_5b_prompt_512 b_0_5b_prompt_3000
  tests f2-7b 40 150 c_7b_prompt_1:: c_7b_prompt_17 c_7b_prompt_512
  tests f3-stream-k 20 120 d_stream_k
  if [[ -f $CARRY/ref/7b-3000.bin ]]; then
    export QMK_PREFILL_REF_DIR=$CARRY/ref
    tests f4-7b-3000 20 120 c_7b_prompt_3000
    unset QMK_PREFILL_REF_DIR
  else
    summary+=("SKIP tests 7b 3000: no $CARRY/ref/7b-3000.bin")
  fi
  bench 0.5b 512 512 6 60
  bench 0.5b 2048 2048 6 60
  bench 7b 512 512 12 60
  bench 7b 2048 2048 12 60
  tests f5-threshold 20 90 b_0_5b_threshold::cudarc c_7b_threshold::cudarc
  for spec in 7b:2048:2048 7b:512:512; do profile "$spec" 25 90; done
  # Decode after the sm_90a switch (the decode kernel is in the same cubin).
  for pr in 0.5b 7b; do
    timeout -k 5 60 "$CARRY/qwen-mk" bench --preset "$pr" --backend cudarc --json >> "$LOG/decode.jsonl" 2>> "$LOG/bench.log" \
      || summary+=("FAIL decode bench $pr")
  done
  while read -r x; do summary+=("$x"); done < <(python3 -c 'import json,sys
for l in open(sys.argv[1]):
    v=json.loads(l); print("decode %s: %.1f tok/s, %.1f %% of floor" % (v["preset"], v["tok_per_s"], v.get("pct_of_floor", float("nan"))))' "$LOG/decode.jsonl" 2>/dev/null)
  hb=$(( $(left) - 10 )); (( hb > 90 )) && hb=90
  if (( hb >= 30 )); then
    timeout -k 5 $(( hb + 20 )) python3 "$ROOT/scripts/gpu/hf_side_by_side.py" --ttft-only --budget "$hb" \
      --json-out "$LOG/hf.json" "$LOG/bench.jsonl" > "$LOG/hf.log" 2>&1
    summary+=("hf_side_by_side rc=$? (log prefill/hf.log)")
  else
    summary+=("SKIP hf_side_by_side (budget: ${hb}s)")
  fi
  grep -E "^--|time to first|profile" "$LOG/profile.log" | tail -30
  tail -12 "$LOG/hf.log" 2>/dev/null
fi

# debug: the small correctness cases on each GEMM path (QMK_TEST_KERNEL_FLAGS:
# 0 = wgmma + stream-K, 524288 = no stream-K, 262144 = mma.sync), the
# stream-K A/B benches, memcheck of the 1-token case.
if [[ $MODE == debug ]]; then
  : > "$LOG/bench.jsonl"; : > "$LOG/bench.log"
  for f in 0 524288 262144; do
    export QMK_TEST_KERNEL_FLAGS=$f; tests "dbg-0.5b-f$f" 10 90 b_0_5b_prompt_1:: b_0_5b_prompt_17
  done
  bench 7b 2048 2048 12 150
  bench 7b 2048 2048 12 60 524288
  bench 7b 512 512 12 60
  bench 7b 512 512 12 60 524288
  bench 7b 64 64 12 60
  bench 0.5b 512 512 6 60
  bench 0.5b 512 512 6 60 524288
  export QMK_TEST_KERNEL_FLAGS=0; tests dbg-7b-f0 30 120 c_7b_prompt_17::cudarc
  if [[ -x /usr/local/cuda/bin/compute-sanitizer ]] && (( $(left) > 60 )); then
    timeout $(( $(left) - 5 )) /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
      "$CARRY/prefill-tests" --test-threads=1 --nocapture --exact b_0_5b_prompt_1::cudarc \
      > "$LOG/memcheck.log" 2>&1
    summary+=("memcheck rc=$?: $(grep -h 'ERROR SUMMARY' "$LOG/memcheck.log" | tail -1)")
  fi
fi

# explore: correctness of the default build (0.5B / 7B at 17 and 512, the
# stream-K agreement), then in-process A/B of kernel-flag variants
# (AB_FLAGS, timed interleaved: bench --ab) for AB_RUNS, the torch/cuBLAS
# GEMM reference on the same shapes (torch_gemm_ref.py), and the GPU's
# power, clocks and throttle reasons sampled every 200 ms throughout
# (power.csv, summarised per step from marks.txt).
mark() { echo "$(date +%s.%N) $*" >> "$LOG/marks.txt"; }
if [[ $MODE == explore ]]; then
  : > "$LOG/marks.txt"; : > "$LOG/ab.log"
  nvidia-smi --query-gpu=timestamp,power.draw,power.limit,clocks.sm,clocks.mem,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,noheader,nounits -lms 200 > "$LOG/power.csv" 2>&1 &
  smi=$!
  mark tests
  tests e1-correct 40 150 b_0_5b_prompt_17 b_0_5b_prompt_512 c_7b_prompt_17 c_7b_prompt_512 d_stream_k
  # EXPLORE_3000=1: 7B at 3,000 tokens in chunks of 2,048 against the
  # carried reference file (the 2,048-token chunk runs the split tail).
  if [[ ${EXPLORE_3000:-0} == 1 && -f $CARRY/ref/7b-3000.bin ]]; then
    QMK_PREFILL_CHUNK=2048 QMK_PREFILL_REF_DIR=$CARRY/ref tests e2-7b-3000-c2048 20 120 c_7b_prompt_3000
  fi
  for spec in ${AB_RUNS:-7b:2048 7b:512 0.5b:2048 0.5b:512}; do
    IFS=: read -r pr n <<< "$spec"
    (( $(left) < 20 )) && { summary+=("SKIP ab $spec (budget)"); continue; }
    mark "ab $spec"
    echo "-- bench --preset $pr --prefill $n --ab ${AB_FLAGS:-0,1048576}" >> "$LOG/ab.log"
    timeout -k 5 $(( $(left) - 5 )) "$CARRY/qwen-mk" bench --preset "$pr" --backend cudarc --prefill "$n" \
      --prefill-chunk "$n" --ab "${AB_FLAGS:-0,1048576}" --ab-rounds "${AB_ROUNDS:-4}" >> "$LOG/ab.log" 2>&1 \
      || summary+=("FAIL ab $spec")
  done
  if (( $(left) > 40 )); then
    mark "torch 7b 2048"
    timeout -k 5 $(( $(left) - 5 )) python3 "$ROOT/scripts/gpu/torch_gemm_ref.py" --preset 7b --tokens 2048 \
      --json-out "$LOG/torch-gemm.json" > "$LOG/torch-gemm.log" 2>&1 || summary+=("FAIL torch_gemm_ref")
  fi
  mark end
  kill $smi 2>/dev/null
  grep -E "^--|time to first|ab flags" "$LOG/ab.log"
  cat "$LOG/torch-gemm.log" 2>/dev/null | grep "^torch"
  python3 - "$LOG/marks.txt" "$LOG/power.csv" <<'PY' || true
import sys, datetime
marks = [l.split(None, 1) for l in open(sys.argv[1])]
rows = []
for l in open(sys.argv[2]):
    f = [x.strip() for x in l.split(",")]
    try:
        ts = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=datetime.timezone.utc).timestamp()
        rows.append((ts, float(f[1]), float(f[2]), float(f[3]), float(f[5]), f[6]))
    except Exception:
        pass
for (t0, name), (t1, _) in zip(marks, marks[1:]):
    r = [x for x in rows if float(t0) <= x[0] < float(t1)]
    busy = [x for x in r if x[1] > 200]
    if not busy:
        print("power %-14s no samples above 200 W (%d samples)" % (name.strip(), len(r))); continue
    pw = sorted(x[1] for x in busy); ck = sorted(x[3] for x in busy)
    reasons = sorted(set(x[5] for x in busy))
    print("power %-14s %3d busy samples: W median %.0f max %.0f (limit %.0f), SM MHz median %.0f min %.0f, max temp %.0f C, throttle %s"
          % (name.strip(), len(busy), pw[len(pw)//2], pw[-1], busy[0][2], ck[len(ck)//2], ck[0], max(x[4] for x in busy), " ".join(reasons)))
PY
fi

# ncu: Nsight Compute on one prefill launch with every phase but one
# skipped (NCU_RUNS: PRESET:N:PHASE, PHASE = qkv / attention / o_proj /
# gate_up / down), so the report is that phase's GEMM or attention alone:
# speed of light, compute and memory workload, warp stall reasons.
if [[ $MODE == ncu ]]; then
  NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
  [[ -x $NCU ]] || summary+=("SKIP ncu: not found")
  for spec in ${NCU_RUNS:-7b:2048:gate_up 7b:2048:down}; do
    [[ -x $NCU ]] || break
    IFS=: read -r pr n ph <<< "$spec"
    case $ph in qkv) keep=1;; attention) keep=2;; o_proj) keep=4;; gate_up) keep=8;; down) keep=16;; *) keep=0;; esac
    flags=$(( (63 & ~keep) << 8 ))
    (( $(left) < 30 )) && { summary+=("SKIP ncu $spec (budget)"); continue; }
    mark "ncu $spec"
    timeout -k 5 $(( $(left) - 5 )) "$NCU" --clock-control none -k regex:qmk_prefill_chunk --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats \
      "$CARRY/qwen-mk" bench --preset "$pr" --backend cudarc --prefill "$n" --prefill-chunk "$n" \
      --prefill-reps 2 --kernel-flags "$flags" > "$LOG/ncu-$pr-$n-$ph.log" 2>&1
    summary+=("ncu $spec rc=$? (log prefill/ncu-$pr-$n-$ph.log)")
    grep -E "Duration|Throughput|Hit Rate|Pipe|Stall|Issued|Eligible|Active Warps|Bank|Executed Ipc|SM Frequency" "$LOG/ncu-$pr-$n-$ph.log" | head -60
  done
fi

if [[ $MODE == tests ]]; then
  if [[ -n ${TEST_FILTER:-} ]]; then
    filt=("$TEST_FILTER")
  elif [[ ${FULL:-0} == 1 ]]; then
    filt=()
  else
    filt=(--skip c_7b_prompt_3000)
  fi
  BUDGET=100000
  tests all 0 "${T_TESTS:-900}" "${filt[@]}"
fi

if [[ $MODE == sanitize ]]; then
  # memcheck on small cases: 0.5B, 3 decode steps + 40 prompt positions in
  # chunks of 16 (out-of-bounds fragment loads show up here first), and
  # the 17-token prompt (its down projection runs stream-K: partials,
  # flags, nonce).
  if [[ -x /usr/local/cuda/bin/compute-sanitizer ]]; then
    for t in ${SAN_TESTS:-a_errors_and_continuation::cudarc b_0_5b_prompt_17::cudarc}; do
      timeout ${T_SAN:-300} /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
        "$CARRY/prefill-tests" --test-threads=1 --nocapture --exact "$t" \
        > "$LOG/memcheck-$t.log" 2>&1
      rc=$?
      summary+=("$([[ $rc == 0 ]] && echo PASS || echo FAIL) memcheck $t rc=$rc: $(grep -h 'ERROR SUMMARY' "$LOG/memcheck-$t.log" | tail -1)")
    done
  else
    summary+=("SKIP memcheck: no compute-sanitizer")
  fi
fi

if [[ $MODE == bench ]]; then
  : > "$LOG/bench.jsonl"; : > "$LOG/bench.log"
  BUDGET=100000
  for preset in ${PRESETS:-0.5b 7b}; do
    for n in ${LENS:-512 2048}; do
      for c in ${CHUNKS:-256 512 1024 2048}; do
        (( c > n )) && continue
        bench "$preset" "$n" "$c" 0 "${T_BENCH:-240}"
      done
    done
  done
fi

echo "== summary (prefill, $(( SECONDS - T0 ))s)"
printf '%s\n' "${summary[@]}"
# Correctness numbers, one line per test that got that far.
grep -hoE "^(0\.5b|7b) (cudarc|cust) prefill of [0-9]+ tokens vs CPU reference: logits rel err [^;]*" \
  "$LOG"/t*.log "$LOG"/all.log 2>/dev/null | sed -E 's/ vs CPU reference: logits rel err/: logits/; s/ greedy ids equal/ ids eq/' | head -14
# Threshold table, one line per (preset, backend): tokens steps/batched ms.
grep -hE "^threshold .*: +[0-9]+ \|" "$LOG"/t*.log "$LOG"/all.log 2>/dev/null | awk '
  { k = $2 " " $3; if (!(k in row)) order[n++] = k; row[k] = row[k] sprintf(" %s:%s/%s", $4, $6, $8) }
  END { for (i = 0; i < n; i++) print "threshold " order[i] " tokens:steps/batched ms" row[order[i]] }'
grep -hE "^threshold .*first faster" "$LOG"/t*.log "$LOG"/all.log 2>/dev/null | head -4
python3 - "$LOG/bench.jsonl" <<'EOF' 2>/dev/null || true
import sys, json
tgt = {("0.5b", 512): 6.2, ("0.5b", 2048): 23.0, ("7b", 512): 19.7, ("7b", 2048): 56.4}
for l in open(sys.argv[1]):
    try: v = json.loads(l)
    except Exception: continue
    t = tgt.get((v["preset"], v["prefill_tokens"]))
    mark = "" if t is None else ("  < target %.1f" % t if v["ttft_ms"] < t else "  >= target %.1f" % t)
    fl = v.get("kernel_flags", 0)
    print("TTFT %4s n=%4d chunk=%4d%s: %7.2f ms (%5.1f TFLOP/s)%s" % (v["preset"], v["prefill_tokens"], v["chunk"], " flags=%d" % fl if fl else "", v["ttft_ms"], v["tflops"], mark))
EOF
