#!/usr/bin/env bash
# Creates .venv with shardserve and its dependencies (CPU torch by default).
# Idempotent: re-running only installs what changed. Set SHARDSERVE_TORCH to
# override the torch requirement (e.g. a CUDA build on a GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.shardserve-installed
want=$(cat pyproject.toml scripts/setup-venv.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "${SHARDSERVE_TORCH:-torch==2.13.0}"
.venv/bin/python -m pip install --quiet -e ".[dev]"
echo "$want" > "$stamp"
