#!/usr/bin/env bash
# The one entry point for GPU work: builds here (no GPU needed), runs there.
#
#   Here:          bash scripts/gpu/run.sh build
#                  -> .carry/gpu/bin.tar.xz: qwen-mk (cudarc + cust) and every
#                     GPU test program, stripped. With BASE=DIR, DIR/qwen-mk is
#                     packed too as the A/B baseline (`ab` below).
#   GPU machine:   bash scripts/gpu/run.sh [STEP...]     (device carry: .carry/gpu)
#
# Steps (default: tests checksums bench prefill; `all` adds hf):
#   tests       every GPU test program, both drivers, one test at a time
#               (without the 7B 3,000-token prefill case, whose CPU reference
#               takes minutes; FULL=1 runs it)
#   test-NAME   one GPU test program (gpu, long_context, prefill, faults,
#               endurance, scale, speculative, multi_token), e.g. `test-faults`
#   alttest-NAME a variant's test program carried as $CARRY/alt-test-NAME.xz
#               (built here from a lab patch), e.g. `alttest-ring-multi_token`
#   checksums   per-step logit checksums at 0.5B, 7B and 14B, both drivers; written
#               to $OUT/checksums.txt and compared against the recorded file
#   bench       qwen-mk bench: decode 0.5B / 7B / 14B (short context), 7B at
#               8,192 and 32,768 positions, both drivers at 0.5B and 7B
#   prefill     qwen-mk bench --prefill: 0.5B and 7B at 512 and 2,048 tokens
#   upload      the streamed weight upload: bench 0.5B / 14B / 32B / 72B
#               (synthetic weights streamed through the pinned ring; 72B also
#               at 4,096 positions) with upload GB/s and peak RSS (VmHWM) in
#               the summary
#   file14b     the file path at 14B: write-synthetic a 14B checkpoint to
#               $SYNTH_DIR (default /tmp/qmk-synth-14b, 29.5 GB), bench
#               --model it (page cache dropped first where allowed, then
#               warm), delete it
#   compile     kernel compile alongside the upload, cold (empty cubin cache)
#               then warm, 0.5B and 7B
#   scale72     72B on one GPU: the scale program's `scale_72b` (weights
#               streamed from the synthetic source, 8 greedy steps on both
#               drivers vs the CPU reference regenerating the weights layer
#               by layer); QMK_SCALE_CUBINS (default .carry/cubins, written
#               here by the scale program's ignored `precompile_cubins`)
#               skips NVRTC
#   bisect72    the 32-bit trap at 72B shapes per tensor group (`bisect_72b`)
#   ab          baseline vs this build, interleaved in rounds: decode 0.5B,
#               7B, 14B, 7B at 32,768 positions and prefill 7B at 2,048
#               (needs BASE at build time). AB_ROWS="name=bench args;..."
#               replaces the rows, AB_ROUNDS (default 2) the rounds; variant
#               binaries put at $CARRY/alt-NAME.xz here (xz of a qwen-mk
#               build) join them
#   table       qwen-mk bench on every row of the decode table, this build
#               only, both drivers: 0.5B / 7B / 14B / 32B (216 positions),
#               72B, 0.5B at 8,192 and 7B at 8,192 and 32,768;
#               TABLE_ROWS="name=bench args;..." replaces the rows
#   profile     qwen-mk bench --profile at 0.5B, 7B and 14B: the phase-skip
#               variants and the step timeline per op (critical path, mean
#               CTA busy time, barriers); PROFILE_ROWS="name=bench args;..."
#               replaces the rows (e.g. "7b-32k=--preset 7b --context 32768");
#               PROFILE_ALTS=1 profiles the variant binaries too
#   multicost   the multi-token step's cost table: qwen-mk bench
#               --multi-tokens at 0.5B, 7B, 14B and 32B (T = 1 .. the
#               device's most, us per launch and one-token steps);
#               MULTI_ROWS="name=bench args;..." replaces the rows;
#               MULTI_ALTS=1 times the variant binaries too; MULTI_PROFILE=1
#               adds --profile: the step timeline of each T too (a line per
#               run and T: total, each op's critical path, barriers; the
#               one-token profile variants run as well)
#   tensor-cores the tensor-core weight phases (Options::tensor_cores, off
#               by default until this passes on a GPU): their GPU tests (7B
#               logits against the CPU reference, one-token steps and the
#               prefill; multi-token steps bit-identical to one-token steps at
#               7B and 32B), then `multicost` rows at 7B, 14B and 32B with and
#               without --tensor-cores, each T's time over the CUDA-core
#               one-token step (TC_ROWS="name=bench args;..." replaces the
#               presets)
#   tp          tensor parallelism: the tensor_parallel test program (ranks
#               co-resident on GPU 0, or one per GPU with QMK_TP_DEVICES set
#               to the GPU count when there are 2 or more; the real 0.5B
#               goldens at 2 ranks when the model is there, as `real`)
#   tpbench     qwen-mk bench --tp: co-resident 0.5B and 32B at 2 ranks on
#               one GPU; 32B and 72B at 2, 4 and 8 ranks as the GPUs allow
#   tp-allreduce the tensor-parallel all-reduce lab
#               (scripts/gpu/lab/tp-allreduce: its binary is in the bundle when
#               nvcc was there at build time, else nvcc builds it on the GPU
#               machine): ranks co-resident on GPU 0, and
#               one per GPU where there are several; $OUT/tp-allreduce.txt
#   tensor-dot  the tensor-core dot-product lab (scripts/gpu/lab/tensor-dot:
#               binaries from the bundle, or from TD_BIN_DIR, else nvcc
#               builds them on the GPU machine): mma column independence,
#               the weight phases at T = 1 .. 8 on tensor cores and the
#               CUDA-core lab beside them; $OUT/tensor-dot.txt
#   ncu         Nsight Compute on one launch of each of NCU_KERNELS (default
#               qmk_decode_step and qmk_decode_multi_5) at NCU_PRESET (7b):
#               speed of light, compute and memory workload, warp states,
#               scheduler (ncu --clock-control none; $OUT/ncu-KERNEL.txt);
#               NCU_SECTIONS="--section X ..." adds sections, NCU_ALTS=1
#               profiles the variant binaries too ($OUT/ncu-KERNEL-NAME.txt)
#   hf          Hugging Face transformers eager on the same shapes
#               (scripts/gpu/hf_side_by_side.py)
#   goldens     the real 0.5B weights (as `real`): only transformers' plain
#               goldens on both drivers (`test-real_weights goldens_plain`),
#               the quick check for a kernel change that moves the bits
#   real        the real 0.5B weights (QMK_REAL_QWEN, default /tmp/real-qwen/model,
#               put there earlier in the same lease by real-qwen-to-device):
#               transformers' goldens with Qwen2.5's YaRN setting
#               (scripts/gpu/hf_golden.py, CPU, written to $OUT with its
#               rotary table), then the real_weights test program: plain
#               goldens, YaRN goldens, YaRN at 40,000 positions vs the CPU
#               reference fed the GPU's cache
#   speculate   the real 0.5B weights (as `real`): qwen-mk bench --prompts
#               benches/prompts/code-edit.jsonl, plain against prompt-lookup
#               decoding (every step verifying 7 guesses: --speculate-always)
#               on both drivers, then the adaptive rule's choice (auto); fails
#               if a greedy output differs; then the speculative test program
#               with them (goldens, ngram and the 0.5B drafting for itself,
#               both drivers)
#   serve       the real 0.5B weights (as `real`): the openai client suite
#               (crates/cli/tests/serve_openai.py) against `qwen-mk serve` on
#               both drivers, with the wheels carried in bin.tar.xz; then
#               scripts/gpu/serve_speed.py: the server's logged time to first
#               token and tok/s against `generate` on the same request
#   sanitizer   compute-sanitizer memcheck, racecheck, synccheck, initcheck on
#               a short prefill + decode (0.5B, both drivers; 1.5B shapes in
#               2 layers, cudarc), on steps of the split attention at 300
#               positions, and on the multi-token step (every T once, 0.5B and
#               7B shapes, cudarc); the OOB hook must be caught;
#               SAN_MATCH=REGEX keeps the runs whose name matches
#
# Every step runs under `timeout`; a failure never stops the script; logs go
# to $OUT/logs.tgz and a summary (PASS / FAIL per step, key numbers) is
# printed last.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CARRY=${CARRY:-$ROOT/.carry/gpu}
# GPU test programs: package:test-target.
TEST_PROGRAMS=${TEST_PROGRAMS:-"qmk-gpu-tests:gpu qmk-gpu-tests:long_context qmk-gpu-tests:prefill
  qmk-gpu-tests:faults qmk-gpu-tests:endurance qmk-gpu-tests:scale qmk-gpu-tests:checksums
  qmk-gpu-tests:real_weights qmk-gpu-tests:speculative qmk-gpu-tests:multi_token
  qmk-gpu-tests:tensor_parallel"}

if [[ ${1:-} == build ]]; then
  set -e
  cd "$ROOT"
  eval "$(bash .ci/stub-libcuda.sh)"
  # find_cuda_helper only searches $CUDA_LIBRARY_PATH/lib64.
  if [[ ! -e $CUDA_LIBRARY_PATH/lib64 ]]; then
    mkdir -p /tmp/qmk-cust-stub && ln -sfn "$CUDA_LIBRARY_PATH" /tmp/qmk-cust-stub/lib64
    export CUDA_LIBRARY_PATH=/tmp/qmk-cust-stub
  fi
  stage=$(mktemp -d)
  cargo build -p qwen-mk --release --features cust
  cp "${CARGO_TARGET_DIR:-target}/release/qwen-mk" "$stage/qwen-mk"
  for spec in $TEST_PROGRAMS; do
    pkg=${spec%%:*} t=${spec#*:}
    exe=$(cargo test -p "$pkg" --release --test "$t" --no-run --message-format=json 2>"$stage/cargo.err" \
      | python3 -c 'import sys, json
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == sys.argv[1] and m.get("executable"):
        print(m["executable"])' "$t" | tail -1) || exe=
    [[ -n $exe ]] || { cat "$stage/cargo.err"; echo "no test program for $spec"; exit 1; }
    cp "$exe" "$stage/test-$t"
  done
  rm -f "$stage/cargo.err"
  if [[ -n ${BASE:-} ]]; then cp "$BASE/qwen-mk" "$stage/base-qwen-mk"; fi
  # The tensor-parallel all-reduce lab and the tensor-core dot-product lab,
  # where nvcc is here (optional).
  if command -v nvcc > /dev/null; then
    AR_BIN_DIR="$stage" bash scripts/gpu/lab/tp-allreduce/run.sh build || echo "the all-reduce lab did not build"
    TD_BIN_DIR="$stage" bash scripts/gpu/lab/tensor-dot/run.sh build || echo "the tensor-dot lab did not build"
  else
    echo "no nvcc here: the bundle has no all-reduce lab (tp-allreduce) and no tensor-dot lab"
  fi
  find "$stage" -maxdepth 1 -type f -exec strip {} +
  # The `openai` client and its dependencies for the GPU machine's Python
  # (3.12, no network there): the version CI pins.
  v=$(sed -n 's/^VERSION=//p' .ci/openai.sh)
  python3 -m pip download -q --disable-pip-version-check "openai==$v" --only-binary=:all: \
    --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 -d "$stage/wheels"
  rm -rf "$CARRY"; mkdir -p "$CARRY"
  tar -C "$stage" -cf - . | xz -6 -T2 > "$CARRY/bin.tar.xz"
  rm -rf "$stage"
  ls -la "$CARRY"
  exit 0
fi

OUT=${OUT:-$ROOT/gpu-out}
LOG=/tmp/qmk-logs
BIN=/tmp/qmk-bin
mkdir -p "$OUT" "$LOG" "$BIN"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export QMK_CACHE_DIR=${QMK_CACHE_DIR:-/tmp/qmk-cubins} RUST_BACKTRACE=1
STEPS=${*:-tests checksums bench prefill}
# `all` as a word only: a substring replacement would also rewrite tp-allreduce.
STEPS=$(for s in $STEPS; do [[ $s == all ]] && echo tests checksums bench prefill hf || echo "$s"; done)
STEPS=$(echo $STEPS)
summary=()
note() { summary+=("$*"); echo "$*"; }

echo "== $(date -u +%FT%TZ) run.sh: $STEPS"
timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv 2>&1 | tee "$LOG/nvidia-smi.txt"
# A warm machine keeps the last call's binaries: start from this carry's only,
# so a baseline or variant left out of it is not run again.
rm -rf "${BIN:?}"/* && tar -C "$BIN" -xJf "$CARRY/bin.tar.xz" || note "FAIL unpack $CARRY/bin.tar.xz"
# Variant binaries for `ab` and `profile` (built here), optional:
# $CARRY/alt-NAME.xz becomes $BIN/alt-NAME.
for f in "$CARRY"/alt-*.xz; do
  [[ -f $f ]] || continue
  a=$BIN/$(basename "$f" .xz)
  xz -dc "$f" > "$a" && chmod +x "$a"
done
# (alt-test-NAME: a variant's GPU test program, for `alttest-NAME`, not a qwen-mk.)
ALTS=$(cd "$BIN" && ls alt-* 2>/dev/null | grep -v '^alt-test-' | tr '\n' ' ')

# One test program, one test at a time; PASS needs exit 0, a result line and
# no SKIPPED line (on the GPU machine a skip is a failure).
# The real 0.5B model directory in $R (put there by real-qwen-to-device
# earlier in the lease); a FAIL note for step $1 when it is not there.
real_model() {
  R=${QMK_REAL_QWEN:-/tmp/real-qwen/model}
  [[ -f $R/config.json ]] || { note "FAIL $1: no model at $R"; return 1; }
}
# transformers' greedy goldens of the real 0.5B and their prompts.
GOLDEN=$ROOT/crates/model/tests/data/golden

run_tests() {
  local name=$1 lim=$2; shift 2
  local t=$SECONDS
  timeout -k 5 "$lim" "$BIN/$name" --test-threads=1 --nocapture "$@" > "$LOG/$name.log" 2>&1
  local rc=$? verdict=FAIL
  if [[ $rc == 0 ]] && grep -q "^test result: ok" "$LOG/$name.log" && ! grep -q "SKIPPED" "$LOG/$name.log"; then
    verdict=PASS
  fi
  (( rc == 124 || rc == 137 )) && verdict="FAIL (timeout ${lim}s)"
  local ran; ran=$(grep -oE "[0-9]+ passed; [0-9]+ failed" "$LOG/$name.log" | tail -1)
  note "$verdict $name: rc=$rc, ${ran:-no result}, $(( SECONDS - t ))s"
  grep -E "panicked|^test .*FAILED|mismatch" "$LOG/$name.log" | head -6 | while read -r x; do note "    ${x:0:200}"; done
}

# bench NAME BINARY ARGS...: one JSON line per object, tagged with the run name.
bench() {
  local name=$1 bin=$2; shift 2
  local t=$SECONDS
  timeout -k 5 "${BENCH_LIMIT:-300}" "$BIN/$bin" bench --json "$@" > "$LOG/bench-$name.json" 2> "$LOG/bench-$name.err"
  local rc=$?
  python3 - "$name" "$LOG/bench-$name.json" >> "$LOG/bench.jsonl" <<'EOF'
import json, sys
name, path = sys.argv[1], sys.argv[2]
for line in open(path):
    line = line.strip()
    if line.startswith("{"):
        o = json.loads(line); o["run"] = name; print(json.dumps(o))
EOF
  note "bench $name rc=$rc $(( SECONDS - t ))s: $(python3 - "$LOG/bench-$name.json" <<'EOF'
import json, sys
out = []
for line in open(sys.argv[1]):
    line = line.strip()
    if not line.startswith("{"): continue
    o = json.loads(line)
    keys = ["tok_per_s", "us_per_step", "pct_of_floor", "prefill_ms", "ttft_ms", "median_ms", "context",
            "upload_gbps", "upload_read_s", "upload_wait_s", "compile_s", "plain_tok_per_s",
            "speculative_tok_per_s", "speedup", "acceptance", "tokens_per_step", "identical"]
    if "name" in o and "summary" not in o: continue
    if o.get("peak_rss_bytes"): o["peak_rss_gib"] = o["peak_rss_bytes"] / 2**30; keys.append("peak_rss_gib")
    # bench --multi-tokens: each T's cost in one-token steps, T = 1, 2, ...
    if o.get("multi_tokens"): o["multi_steps"] = "/".join(f'{r["steps"]:.3f}' for r in o["multi_tokens"]); keys.append("multi_steps")
    out.append(" ".join(f"{k}={o[k]:.4g}" if isinstance(o[k], float) else f"{k}={o[k]}" for k in keys if k in o))
print(" | ".join(out)[:400])
EOF
)"
  [[ $rc == 0 ]] || tail -3 "$LOG/bench-$name.err" | while read -r x; do note "    ${x:0:200}"; done
}

# Arguments of one test program: the 7B 3,000-token prefill case needs a CPU
# reference of ~40 TFLOP, skipped unless FULL=1.
test_args() {
  [[ $1 == test-prefill && -z ${FULL:-} ]] && echo "--skip c_7b_prompt_3000"
  # The 72B tests take a call of their own each (steps scale72, bisect72).
  [[ $1 == test-scale ]] && echo "--skip scale_72b --skip bisect_72b"
}

for step in $STEPS; do
  echo "== step $step ($(date -u +%T))"
  case $step in
    tests)
      for p in "$BIN"/test-*; do
        n=$(basename "$p")
        [[ $n == test-checksums || $n == test-real_weights ]] && continue
        run_tests "$n" 500 $(test_args "$n")
      done ;;
    test-*)
      run_tests "$step" 550 $(test_args "$step") ;;
    alttest-*)
      # A variant's GPU test program, carried as $CARRY/alt-test-NAME.xz.
      run_tests "alt-test-${step#alttest-}" 550 ;;
    checksums)
      rm -f "$OUT/checksums.txt"
      QMK_CHECKSUMS_OUT="$OUT/checksums.txt" run_tests test-checksums 540
      wc -l "$OUT/checksums.txt" 2>/dev/null ;;
    bench)
      for p in 0.5b 7b; do
        for d in cudarc cust; do bench "$p-$d" qwen-mk --preset $p --backend $d; done
      done
      bench 14b-cudarc qwen-mk --preset 14b
      bench 7b-long qwen-mk --preset 7b --context 8192,32768 ;;
    prefill)
      for p in 0.5b 7b; do
        for n in 512 2048; do bench "prefill-$p-$n" qwen-mk --preset $p --prefill $n --prefill-chunk $n; done
      done ;;
    upload)
      for p in 0.5b 14b 32b 72b; do bench "upload-$p" qwen-mk --preset $p --steps 64; done
      BENCH_LIMIT=450 bench upload-72b-4096 qwen-mk --preset 72b --context 4096 --steps 64 ;;
    file14b)
      D=${SYNTH_DIR:-/tmp/qmk-synth-14b}
      t=$SECONDS
      timeout -k 5 900 "$BIN/qwen-mk" write-synthetic --preset 14b --out "$D" -q > "$LOG/write-14b.log" 2>&1
      note "write-synthetic 14b rc=$? $(( SECONDS - t ))s: $(du -sh "$D" 2>/dev/null | cut -f1)"
      sync; if echo 3 > /proc/sys/vm/drop_caches 2>/dev/null; then c=cold; else c=cache-kept; fi
      BENCH_LIMIT=600 bench "file14b-$c" qwen-mk --model "$D" --steps 64
      bench file14b-warm qwen-mk --model "$D" --steps 64
      rm -rf "$D" ;;
    compile)
      for p in 0.5b 7b; do
        C=$(mktemp -d)
        QMK_CACHE_DIR=$C bench "compile-cold-$p" qwen-mk --preset $p --steps 16
        QMK_CACHE_DIR=$C bench "compile-warm-$p" qwen-mk --preset $p --steps 16
        rm -rf "$C"
      done ;;
    scale72|bisect72)
      export QMK_SCALE_CUBINS=${QMK_SCALE_CUBINS:-$ROOT/.carry/cubins}
      t=${step%72}
      [[ $t == scale ]] && t=scale_72b || t=bisect_72b
      run_tests test-scale 590 --exact "$t"
      mv "$LOG/test-scale.log" "$LOG/test-scale-$t.log"
      grep -h "RESULT\|upload)\|streamed CPU\| | N=" "$LOG/test-scale-$t.log" | while read -r x; do note "    ${x:0:300}"; done ;;
    ab)
      [[ -x $BIN/base-qwen-mk ]] || { note "FAIL ab: no baseline binary (BASE at build time)"; continue; }
      IFS=';' read -ra rows <<< "${AB_ROWS:-0.5b=--preset 0.5b;7b=--preset 7b;14b=--preset 14b;7b-32k=--preset 7b --context 32768;prefill-7b-2048=--preset 7b --prefill 2048 --prefill-chunk 2048}"
      for r in $(seq "${AB_ROUNDS:-2}"); do
        for v in base-qwen-mk qwen-mk $ALTS; do
          for row in "${rows[@]}"; do
            # shellcheck disable=SC2086
            bench "ab$r-$v-${row%%=*}" $v ${row#*=}
          done
        done
      done ;;
    table)
      IFS=';' read -ra rows <<< "${TABLE_ROWS:-0.5b=--preset 0.5b;0.5b-cust=--preset 0.5b --backend cust;7b=--preset 7b;7b-cust=--preset 7b --backend cust;14b=--preset 14b;14b-cust=--preset 14b --backend cust;32b=--preset 32b;32b-cust=--preset 32b --backend cust;72b=--preset 72b;72b-cust=--preset 72b --backend cust;0.5b-8k=--preset 0.5b --context 8192;0.5b-8k-cust=--preset 0.5b --context 8192 --backend cust;7b-long=--preset 7b --context 8192,32768;7b-long-cust=--preset 7b --context 8192,32768 --backend cust}"
      for row in "${rows[@]}"; do
        # shellcheck disable=SC2086
        bench "table-${row%%=*}" qwen-mk ${row#*=}
      done ;;
    multicost)
      IFS=';' read -ra rows <<< "${MULTI_ROWS:-0.5b=--preset 0.5b;7b=--preset 7b;14b=--preset 14b;32b=--preset 32b}"
      prof=$([[ ${MULTI_PROFILE:-0} == 1 ]] && echo --profile)
      for v in qwen-mk ${MULTI_ALTS:+$ALTS}; do
        for row in "${rows[@]}"; do
          # shellcheck disable=SC2086
          bench "multi-${row%%=*}$([[ $v == qwen-mk ]] || echo "-$v")" $v ${row#*=} --multi-tokens --steps 32 $prof
        done
      done
      python3 - "$LOG/bench.jsonl" <<'EOF' | tee "$OUT/multicost.txt"
import json, sys
objs = [json.loads(line) for line in open(sys.argv[1])]
objs = [o for o in objs if o["run"].startswith("multi-") and "multi_tokens" in o]
for o in objs:
    print(o["run"], o["context"], " ".join(f'T{r["tokens"]}={r["us"]:.1f}us/{r["steps"]:.3f}' for r in o["multi_tokens"]))
# MULTI_PROFILE=1: where each T's launch goes (Timeline::OPS order).
OPS = ["qkv_proj", "attention", "o_proj", "mlp gate/up", "mlp down", "lm_head"]
for o in objs:
    for r in o.get("timelines", []):
        t = r["timeline"]
        ops = " ".join(f'{k.replace(" ", "_")}={t["ops"][k]["critical_us"]:.1f}' for k in OPS if k in t["ops"])
        print(f'{o["run"]} {o["context"]} T={r["tokens"]} total_us={t["total_us"]:.1f} critical_us {ops} barrier_us={t["barrier_us"]:.1f}')
EOF
      ;;
    tensor-cores)
      run_tests test-gpu 550 tensor_cores
      mv "$LOG/test-gpu.log" "$LOG/test-gpu-tensor-cores.log"
      run_tests test-multi_token 550 tensor_cores
      mv "$LOG/test-multi_token.log" "$LOG/test-multi_token-tensor-cores.log"
      IFS=';' read -ra rows <<< "${TC_ROWS:-7b=--preset 7b;14b=--preset 14b;32b=--preset 32b}"
      for row in "${rows[@]}"; do
        # shellcheck disable=SC2086
        bench "multi-${row%%=*}" qwen-mk ${row#*=} --multi-tokens --steps 32
        # shellcheck disable=SC2086
        bench "multi-${row%%=*}-tc" qwen-mk ${row#*=} --multi-tokens --steps 32 --tensor-cores
      done
      python3 - "$LOG/bench.jsonl" <<'EOF' | tee "$OUT/tensor-cores.txt"
import json, sys
objs = {}
for line in open(sys.argv[1]):
    o = json.loads(line)
    if o["run"].startswith("multi-") and "multi_tokens" in o:
        objs[o["run"]] = o
for name, o in objs.items():
    if name.endswith("-tc") or name + "-tc" not in objs: continue
    base = o["multi_tokens"][0]["us"]
    tc = objs[name + "-tc"]["multi_tokens"]
    print(name, "CUDA cores T=1", f"{base:.1f}us;", "tensor cores",
          " ".join(f'T{r["tokens"]}={r["us"]:.1f}us/{r["us"] / base:.3f}' for r in tc))
EOF
      ;;
    tp-allreduce)
      # Without a binary from the bundle the lab builds here, where nvcc is.
      [[ -x $BIN/ar ]] || command -v nvcc > /dev/null \
        || { note "FAIL tp-allreduce: no lab binary and no nvcc"; continue; }
      t=$SECONDS
      OUT=$OUT AR_BIN_DIR=$BIN timeout -k 5 590 bash "$ROOT/scripts/gpu/lab/tp-allreduce/run.sh" > "$LOG/tp-allreduce.log" 2>&1
      rc=$?
      note "$([[ $rc == 0 ]] && echo PASS || echo FAIL) tp-allreduce: rc=$rc, $(grep -c RESULT "$LOG/tp-allreduce.log") runs, $(( SECONDS - t ))s"
      grep -E "^rc=[1-9]|failed runs" "$LOG/tp-allreduce.log" | head -8 | while read -r x; do note "    ${x:0:200}"; done ;;
    tensor-dot)
      tdb=${TD_BIN_DIR:-$BIN}
      compgen -G "$tdb/td-*" > /dev/null || command -v nvcc > /dev/null \
        || { note "FAIL tensor-dot: no lab binaries and no nvcc"; continue; }
      t=$SECONDS
      OUT=$OUT TD_BIN_DIR=$tdb timeout -k 5 590 bash "$ROOT/scripts/gpu/lab/tensor-dot/run.sh" > "$LOG/tensor-dot.log" 2>&1
      rc=$?
      v=PASS; { [[ $rc != 0 ]] || grep -qE "DIFFER|WRONG|[1-9][0-9]* differ" "$LOG/tensor-dot.log"; } && v=FAIL
      note "$v tensor-dot: rc=$rc, $(( SECONDS - t ))s"
      grep -E "^(columns|down|[0-9.]+B:|[1-8] +[0-9])" "$LOG/tensor-dot.log" | while read -r x; do note "    ${x:0:160}"; done ;;
    ncu)
      for v in qwen-mk ${NCU_ALTS:+$ALTS}; do
        for k in ${NCU_KERNELS:-qmk_decode_step qmk_decode_multi_5}; do
          t=$SECONDS
          f=$OUT/ncu-$k$([[ $v == qwen-mk ]] || echo "-$v").txt
          # shellcheck disable=SC2086
          timeout -k 5 "${BENCH_LIMIT:-300}" ncu --clock-control none --kernel-name "$k" --launch-skip 3 \
            --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
            --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
            --section LaunchStats --section Occupancy --section InstructionStats ${NCU_SECTIONS:-} \
            "$BIN/$v" bench --preset "${NCU_PRESET:-7b}" --multi-tokens --steps 16 --warmup 1 > "$f" 2>&1
          note "ncu $k $v rc=$? $(( SECONDS - t ))s"
        done
      done ;;
    profile)
      IFS=';' read -ra rows <<< "${PROFILE_ROWS:-0.5b=--preset 0.5b;7b=--preset 7b;14b=--preset 14b}"
      for v in qwen-mk ${PROFILE_ALTS:+$ALTS}; do
        for row in "${rows[@]}"; do
          # shellcheck disable=SC2086
          bench "profile-${row%%=*}$([[ $v == qwen-mk ]] || echo "-$v")" $v ${row#*=} --profile
        done
      done
      python3 - "$LOG/bench.jsonl" <<'EOF' | tee "$OUT/timeline.txt"
import json, sys
for line in open(sys.argv[1]):
    o = json.loads(line)
    t = o.get("timeline")
    if not o["run"].startswith("profile-") or not t: continue
    print(f'{o["run"]}: {o["us_per_step"]:.1f} us/step timed, {t["total_us"]:.1f} traced, barriers {t["barrier_us"]:.1f}, '
          f'skew {t["launch_skew_us"]:.1f}, tail {t["tail_us"]:.1f}, tick <= {t["tick_ns"]} ns')
    for k, v in t["ops"].items():
        print(f'    {k:<12} critical {v["critical_us"]:8.1f}  busy {v["busy_mean_us"]:8.1f}  barriers {v["barrier_us"]:6.1f}')
    a = t.get("attention_parts")
    if a:
        print(f'    split attention, {a["items"]:.0f} items/layer: mean item q {a["q_us"]:.1f} stream {a["stream_us"]:.1f} '
              f'partial {a["partial_us"]:.1f} combine {a["combine_us"]:.1f}; last item q/stream/partial '
              f'{"/".join(f"{x:.1f}" for x in a["slowest_us"])}; critical = to last partial {a["to_last_partial_us"]:.1f} '
              f'+ combine {a["combine_tail_us"]:.1f} + to barrier {a["to_arrival_us"]:.1f} us')
    for k, v in o.get("profile_us", {}).items():
        print(f'    profile {k:<28} {v:8.1f} us')
EOF
      ;;
    speculate)
      real_model speculate || continue
      P=$ROOT/benches/prompts/code-edit.jsonl
      for d in cudarc cust; do
        bench "speculate-ngram-$d" qwen-mk --model "$R" --backend $d --prompts "$P" \
          --speculate ngram --speculate-always
      done
      bench speculate-auto-cudarc qwen-mk --model "$R" --backend cudarc --prompts "$P"
      QMK_REAL_QWEN=$R run_tests test-speculative 400 ;;
    tp)
      gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
      (( gpus >= 2 )) && export QMK_TP_DEVICES=$gpus
      if real_model tp; then
        export QMK_REAL_QWEN=$R QMK_GOLDENS=$GOLDEN/qwen2.5-coder-0.5b-instruct.jsonl
      fi
      run_tests test-tensor_parallel 560
      unset QMK_TP_DEVICES QMK_REAL_QWEN QMK_GOLDENS
      grep -h "PASS\|refused\|stopped" "$LOG"/test-tensor_parallel.log | while read -r x; do note "    ${x:0:300}"; done ;;
    tpbench)
      gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
      for p in 0.5b 32b; do
        bench "tp2-co-$p" qwen-mk --preset $p --tp 2 --tp-co-resident --steps 64
      done
      for n in 2 4 8; do
        (( gpus >= n )) || continue
        for p in 32b 72b; do bench "tp$n-$p" qwen-mk --preset $p --tp $n --steps 64; done
      done ;;
    goldens)
      real_model goldens || continue
      QMK_REAL_QWEN=$R QMK_GOLDENS=$GOLDEN/qwen2.5-coder-0.5b-instruct.jsonl \
        run_tests test-real_weights 300 goldens_plain
      grep -h "PASS\|diverges" "$LOG"/test-real_weights.log | while read -r x; do note "    ${x:0:300}"; done ;;
    real)
      real_model real || continue
      export QMK_REAL_QWEN=$R QMK_GOLDENS=$GOLDEN/qwen2.5-coder-0.5b-instruct.jsonl
      yarn='{"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}'
      t=$SECONDS
      timeout -k 5 450 python3 "$ROOT/scripts/gpu/hf_golden.py" "$R" "$GOLDEN/prompts.jsonl" \
        "$OUT/golden-yarn.jsonl" --rope-scaling "$yarn" --rope-out "$OUT/rope-yarn.json" \
        > "$LOG/hf-golden-yarn.log" 2>&1 &
      hf=$!
      run_tests test-real_weights 450 goldens_plain yarn_long
      mv "$LOG/test-real_weights.log" "$LOG/test-real_weights-plain-long.log"
      wait $hf
      note "hf golden yarn rc=$? $(( SECONDS - t ))s"; tail -12 "$LOG/hf-golden-yarn.log"
      QMK_GOLDENS_YARN=$OUT/golden-yarn.jsonl run_tests test-real_weights 300 goldens_yarn
      grep -h "PASS\|diverges" "$LOG"/test-real_weights*.log | while read -r x; do note "    ${x:0:300}"; done ;;
    serve)
      # The openai client suite against `qwen-mk serve` on the real 0.5B
      # weights, both drivers; then the server's own time to first token
      # and tok/s against `generate`'s on the same request.
      real_model serve || continue
      V=/tmp/qmk-openai-venv
      python3 -m venv --system-site-packages "$V" > "$LOG/venv.log" 2>&1 \
        && "$V/bin/pip" install -q --no-index --find-links "$BIN/wheels" openai >> "$LOG/venv.log" 2>&1 \
        || { note "FAIL serve: installing openai from the carried wheels"; tail -5 "$LOG/venv.log"; continue; }
      for d in cudarc cust; do
        t=$SECONDS
        timeout -k 5 300 "$V/bin/python" "$ROOT/crates/cli/tests/serve_openai.py" --qwen-mk "$BIN/qwen-mk" \
          --model "$R" --backend $d > "$LOG/serve-openai-$d.log" 2>&1
        rc=$?; v=FAIL; [[ $rc == 0 ]] && v=PASS
        note "$v serve-openai $d: rc=$rc, $(grep -o 'serve-openai: .*' "$LOG/serve-openai-$d.log"), $(( SECONDS - t ))s"
        grep "^FAIL" "$LOG/serve-openai-$d.log" | head -5 | while read -r x; do note "    ${x:0:200}"; done
        timeout -k 5 200 "$V/bin/python" "$ROOT/scripts/gpu/serve_speed.py" --qwen-mk "$BIN/qwen-mk" \
          --model "$R" --backend $d > "$LOG/serve-speed-$d.log" 2>&1
        rc=$?; v=FAIL; [[ $rc == 0 ]] && v=PASS
        note "$v serve-speed $d: rc=$rc"; while read -r x; do note "    $x"; done < "$LOG/serve-speed-$d.log"
      done ;;
    hf)
      t=$SECONDS
      timeout -k 5 300 python3 "$ROOT/scripts/gpu/hf_side_by_side.py" --budget 200 \
        --json-out "$OUT/hf.json" "$LOG/bench.jsonl" > "$LOG/hf.log" 2>&1
      note "hf rc=$? $(( SECONDS - t ))s"; tail -15 "$LOG/hf.log" ;;
    sanitizer)
      # The faults program's sanitizer target (17-token prefill in two
      # chunks + 3 decode steps, 0.5B) under each tool and driver, and its
      # split-attention target (3 traced steps at 300 positions with the
      # split forced: partials, tickets, combine) on cudarc, 4 at a time;
      # racecheck on 2 of the 24 layers (every layer runs the same code; all
      # 24 do not finish in 290 s). The same target at 1.5B shapes, 2
      # layers, cudarc (q/k/v's single v rows, no staged phase). Then the
      # OOB hook under memcheck, which must be caught (exit 99).
      SAN=/usr/local/cuda/bin/compute-sanitizer
      san() {
        local name=$1 tool=$2 child=$3 test=$4 preset=${5:-0.5b} vocab=${6:-} lim=200 layers="" extra=()
        [[ $tool == memcheck ]] && extra=(--padding 65536)
        [[ $tool == racecheck ]] && { lim=290; layers=2; }
        [[ $preset != 0.5b ]] && layers=2
        QMK_SAN_PRESET=$preset QMK_SAN_LAYERS=$layers QMK_SAN_VOCAB=$vocab QMK_TEST_SPIN_S=$((lim + 60)) QMK_TEST_DEADLINE_S=$((lim + 60)) \
          QMK_FAULT_CHILD=$child timeout -k 5 $lim "$SAN" --tool "$tool" "${extra[@]}" --error-exitcode 99 \
          "$BIN/test-faults" --exact "$test" --nocapture --test-threads=1 > "$LOG/$name.log" 2>&1
        echo $? > "$LOG/$name.rc"
      }
      runs=()
      for tool in racecheck memcheck synccheck initcheck; do
        for d in cudarc cust; do runs+=("san-$tool-$d $tool - sanitize_target::$d"); done
        runs+=("san-split-$tool-cudarc $tool - sanitize_split_target::cudarc")
        runs+=("san-1.5b-$tool-cudarc $tool - sanitize_target::cudarc 1.5b")
        # The multi-token step, every T once: 0.5B and 7B shapes (7B: 2
        # layers), a 4,096-row vocabulary.
        runs+=("san-multi-$tool-cudarc $tool - sanitize_multi_target::cudarc 0.5b 4096")
        runs+=("san-multi-7b-$tool-cudarc $tool - sanitize_multi_target::cudarc 7b 4096")
      done
      runs+=("san-oob-memcheck memcheck sanitize_oob_child::cudarc sanitize_oob_child::cudarc")
      # SAN_MATCH=REGEX keeps the runs whose name matches.
      if [[ -n ${SAN_MATCH:-} ]]; then
        kept=()
        for r in "${runs[@]}"; do [[ ${r%% *} =~ $SAN_MATCH ]] && kept+=("$r"); done
        runs=("${kept[@]}")
      fi
      for r in "${runs[@]}"; do
        san $r &
        while (( $(jobs -rp | wc -l) >= 4 )); do wait -n; done
      done
      wait
      for r in "${runs[@]}"; do
        set -- $r; f=$LOG/$1.log; rc=$(cat "$LOG/$1.rc")
        es=$(grep -m1 -E "ERROR SUMMARY|RACECHECK SUMMARY" "$f" | sed 's/^========= //')
        if [[ $1 == san-oob-* ]]; then
          v=FAIL; [[ $rc == 99 ]] && grep -q "Invalid __global__ read" "$f" && v=PASS
          note "$v $1 (must be caught): rc=$rc; $es"
        else
          v=FAIL
          [[ $rc == 0 ]] && grep -q "test result: ok. 1 passed" "$f" && ! grep -q SKIPPED "$f" \
            && [[ $es == "ERROR SUMMARY: 0 errors" || $es == "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)" ]] && v=PASS
          note "$v $1: rc=$rc, ${es:-no summary line}"
        fi
      done ;;
    *) note "FAIL unknown step $step" ;;
  esac
  tar czf "$OUT/logs.tgz" -C "$LOG" .
done
echo "== summary"
printf '%s\n' "${summary[@]}"
