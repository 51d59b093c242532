#!/usr/bin/env bash
# Minimises fuzz/corpus/<target>/ for every target (or the targets given as
# arguments): a greedy set cover of the coverage features of the project's
# own code, cut where it reaches COVER_PERCENT (default 90) of the features
# the whole corpus reaches, plus the hand-made seeds (seed-*) and the inputs
# of past findings (regress-*). fuzz/README.md says why and what it gave.
#
#   bash fuzz/minimise.sh [target ...]
#
# Needs the stable toolchain (RUSTC_BOOTSTRAP=1 stands in for nightly), a C++
# compiler for libFuzzer and python3. CARGO_TARGET_DIR defaults to
# fuzz/target. Deterministic for a given corpus and build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
FUZZ=$PWD
TARGET_DIR=${CARGO_TARGET_DIR:-$FUZZ/target}
TRIPLE=x86_64-unknown-linux-gnu
COVER_PERCENT=${COVER_PERCENT:-90}
TARGETS=("$@")
[[ ${#TARGETS[@]} -gt 0 ]] || TARGETS=(config safetensors_header sharded_index chat_template)

# The flags `cargo fuzz build -s none` uses, except the coverage level: 0 for
# every crate by default, 4 (edges) for the crates whose code the corpus is
# meant to cover. Registry crates (serde_json, tokenizers, ...) then add no
# features, so the cover keeps inputs that reach different paths of our
# parsers and of the vendored template engine, not of serde_json's lexer.
export RUSTC_BOOTSTRAP=1
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
-Cllvm-args=-sanitizer-coverage-pc-table -Cllvm-args=-sanitizer-coverage-trace-compares \
--cfg fuzzing -Cllvm-args=-simplifycfg-branch-fold-threshold=0 \
-Cllvm-args=-sanitizer-coverage-stack-depth -Cdebug-assertions -Ccodegen-units=1"
edges='["-Cllvm-args=-sanitizer-coverage-level=4"]'
cargo build -Z profile-rustflags --manifest-path "$FUZZ/Cargo.toml" --target "$TRIPLE" --release \
    --config 'profile.release.debug="line-tables-only"' \
    --config "profile.release.package.qmk-fuzz.rustflags=$edges" \
    --config "profile.release.package.qmk-model.rustflags=$edges" \
    --config "profile.release.package.qmk-layout.rustflags=$edges" \
    --config "profile.release.package.minijinja.rustflags=$edges" \
    --bins --target-dir "$TARGET_DIR"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for t in "${TARGETS[@]}"; do
    corpus=$FUZZ/corpus/$t
    mkdir -p "$work/$t/old" "$work/$t/merged" "$work/$t/new"
    cp -p "$corpus"/* "$work/$t/old/"
    # libFuzzer's set-cover merge over features without hit-count buckets
    # (-use_counters=0); its control file lists every input's features.
    "$TARGET_DIR/$TRIPLE/release/$t" -set_cover_merge=1 -use_counters=0 \
        -merge_control_file="$work/$t/control" -rss_limit_mb=4096 -timeout=60 \
        "$work/$t/merged" "$work/$t/old" > "$work/$t/merge.log" 2>&1
    python3 - "$work/$t/control" "$COVER_PERCENT" > "$work/$t/keep" <<'EOF'
import os, sys
lines = open(sys.argv[1]).read().split("\n")
n = int(lines[0])
files = lines[2:2 + n]
feats = {}
for line in lines[2 + n:]:
    p = line.split()
    if p and p[0] == "FT":
        feats[int(p[1])] = set(map(int, p[2:]))
total = set().union(*feats.values())
goal = len(total) * int(sys.argv[2]) / 100
size = {i: os.path.getsize(files[i]) for i in feats}
name = {i: os.path.basename(files[i]) for i in feats}
left, got = set(total), 0
while got < goal:
    # Most new features first; ties: the smaller, then the first by name.
    best = max(feats, key=lambda i: (len(feats[i] & left), -size[i], [-ord(c) for c in name[i]]))
    got += len(feats[best] & left)
    left -= feats[best]
    print(files[best])
print(f"{len(total)} features, kept {got}", file=sys.stderr)
EOF
    xargs -a "$work/$t/keep" -d '\n' cp -p -t "$work/$t/new/"
    cp -p "$work/$t/old"/seed-* "$work/$t/old"/regress-* "$work/$t/new/" 2>/dev/null || true
    rm -f "$corpus"/*
    cp -p "$work/$t/new"/* "$corpus/"
    echo "$t: $(ls "$work/$t/old" | wc -l) -> $(ls "$corpus" | wc -l) files"
done
