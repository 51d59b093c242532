#!/usr/bin/env bash
# Builds (here, with Rust) the binaries the GPU machine runs, into .carry/
# (git-ignored; pass it in the device tool's `carry`).
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build -p qwen-mk --release
bin=$(cargo test -p qmk-backend-cudarc --release --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import sys,json
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m["target"]["name"]=="gpu" and m.get("executable"): print(m["executable"])' | tail -1)
mkdir -p .carry
cp target/release/qwen-mk .carry/qwen-mk
cp "$bin" .carry/gpu-tests
strip .carry/qwen-mk .carry/gpu-tests
ls -la .carry
