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
# The torchrec extra (shardserve.torchrec and its tests). torchrec asks for the CUDA fbgemm-gpu and tensordict
# for any torch, so the extra's packages go in pinned with --no-deps (fbgemm-gpu-cpu in place of fbgemm-gpu),
# then their torch-free dependencies.
.venv/bin/python -m pip install --quiet --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0 \
  tensordict==0.15.3 torchmetrics==1.0.3 tqdm==4.70.1 pyre-extensions==0.0.32
.venv/bin/python -m pip install --quiet cloudpickle==3.1.3 pyvers==0.2.3 typing-inspect==0.9.0 \
  lightning-utilities==0.15.3
echo "$want" > "$stamp"
