#!/usr/bin/env bash
# Builds, here, what two GPU calls in one lease need to measure the ring
# patch against main (README.md): main's bundle (run.sh build, the baseline
# `qwen-mk`), then in a scratch worktree with weight-ring.patch applied the
# variants as $CARRY/alt-*.xz: alt-ring (the patch as is), alt-ring-half
# (half segments everywhere: MULTI_RING_BIG = 0), and the patched
# multi-token test program alt-test-ring-multi_token. Then, on the GPU machine:
#   MULTI_ALTS=1 MULTI_PROFILE=1 MULTI_ROWS="7b=--preset 7b;32b=--preset 32b" \
#     bash scripts/gpu/run.sh multicost
#   bash scripts/gpu/run.sh alttest-ring-multi_token
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../.." && pwd)"
CARRY=${CARRY:-$ROOT/.carry/gpu}
WT=${RING_WORKTREE:-/tmp/qmk-ring-wt}
TGT=${RING_TARGET_DIR:-/tmp/qmk-ring-target}
cd "$ROOT"
bash scripts/gpu/run.sh build
eval "$(bash .ci/stub-libcuda.sh)"
git worktree remove --force "$WT" 2> /dev/null || rm -rf "$WT"
git worktree add --detach "$WT" HEAD
cd "$WT"
git apply scripts/gpu/lab/multi-ring/weight-ring.patch
H=kernels/src/header.rs
grep -q '^pub const MULTI_RING_BIG: u64 = 1;' $H
variant() {  # NAME: the qwen-mk of the tree as it is now
  CARGO_TARGET_DIR=$TGT cargo build -q -p qwen-mk --release
  strip -o "$TGT/alt-$1" "$TGT/release/qwen-mk"
  xz -T0 -c "$TGT/alt-$1" > "$CARRY/alt-$1.xz"
}
variant ring
exe=$(CARGO_TARGET_DIR=$TGT cargo test -q -p qmk-gpu-tests --release --test multi_token --no-run \
  --message-format=json 2> /dev/null | python3 -c 'import sys, json
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "multi_token" and m.get("executable"):
        print(m["executable"])' | tail -1)
strip -o "$TGT/alt-test-ring-multi_token" "$exe"
xz -T0 -c "$TGT/alt-test-ring-multi_token" > "$CARRY/alt-test-ring-multi_token.xz"
sed -i 's/^pub const MULTI_RING_BIG: u64 = 1;/pub const MULTI_RING_BIG: u64 = 0;/' $H
variant ring-half
cd "$ROOT"
git worktree remove --force "$WT"
ls -la "$CARRY"
