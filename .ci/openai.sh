#!/usr/bin/env bash
# Installs the official `openai` Python package (pinned) into a venv for the
# `qwen-mk serve` client tests, and prints the environment for them:
#   eval "$(bash .ci/openai.sh)"
# Progress goes to stderr; stdout carries only `export` lines.
set -euo pipefail
VENV=${QMK_OPENAI_VENV:-$HOME/.cache/qwen-mk/openai-venv}
VERSION=3.57.0
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV" >&2
fi
if ! "$VENV/bin/python" -m pip show openai 2>/dev/null | grep -q "^Version: $VERSION\$"; then
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "openai==$VERSION" >&2
fi
"$VENV/bin/python" -c 'import openai' >&2
echo "export QMK_OPENAI_PYTHON='$VENV/bin/python'"
