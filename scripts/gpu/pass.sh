#!/usr/bin/env bash
# One whole GPU pass over every part (issue 8 perf, issue 9 prefill, issue 10
# harden), so that a single device call checks and measures everything.
#
#   Here (Rust, no GPU):  bash scripts/gpu/pass.sh build   -> .carry/{perf,prefill,harden}
#   GPU machine:          bash scripts/gpu/pass.sh run [NAME[:MODE[:BUDGET]]...]   (carry: [".carry"])
#
# Each part's own script has a `run` mode with its own time limits; logs go
# to $LOGDIR/<part>/ and are packed into $OUT/logs.tgz (the device tool
# returns at most 8 files). Summaries are printed last.
set -uo pipefail
MODE=${1:-run}; shift || true
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PARTS=${*:-${PARTS:-harden perf prefill}}
cd "$ROOT"

if [[ $MODE == build ]]; then
  set -e
  # Stale carries from earlier passes would eat the 64 MiB transfer budget.
  for d in .carry/*; do
    case "$(basename "$d")" in perf|prefill|harden) ;; *) rm -rf "$d" ;; esac
  done
  for p in $PARTS; do bash "scripts/gpu/$p.sh" build; done
  du -sh .carry .carry/*
  exit 0
fi

OUT=${OUT:-$ROOT/gpu-out}
export LOGDIR=${LOGDIR:-/tmp/qmk-logs}
mkdir -p "$OUT" "$LOGDIR"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export QMK_CACHE_DIR=${QMK_CACHE_DIR:-/tmp/qmk-cubins}
echo "== pass $(date -u +%FT%TZ) parts: $PARTS"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$LOGDIR/nvidia-smi.txt"
# A part is NAME[:MODE[:BUDGET]] (mode default `run`; BUDGET seconds is
# handed to that part's script only).
names=()
for spec in $PARTS; do
  IFS=: read -r p m b <<< "$spec"
  names+=("$p-${m:-run}")
  t0=$(date +%s)
  mkdir -p "$LOGDIR/$p"
  # Each part's stdout is kept (one file per part and mode).
  if [[ -n ${b:-} ]]; then
    BUDGET=$b bash "scripts/gpu/$p.sh" "${m:-run}" > "$LOGDIR/$p/stdout-${m:-run}.log" 2>&1
  else
    bash "scripts/gpu/$p.sh" "${m:-run}" > "$LOGDIR/$p/stdout-${m:-run}.log" 2>&1
  fi
  echo "$spec rc=$? wall=$(( $(date +%s) - t0 ))s" | tee -a "$LOGDIR/parts.txt"
  # The summary is the tail of each part's output.
  tail -${SUMMARY_LINES:-40} "$LOGDIR/$p/stdout-${m:-run}.log" > "$OUT/summary-$p-${m:-run}.txt"
  tar czf "$OUT/logs.tgz" -C "$LOGDIR" .
done
echo "== summaries"
for p in "${names[@]}"; do echo "---- $p"; cat "$OUT/summary-$p.txt"; done
