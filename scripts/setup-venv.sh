#!/usr/bin/env bash
# Creates .venv with shardserve and its dependencies (CPU torch by default).
# Idempotent: re-running only installs what changed. Set SHARDSERVE_TORCH to
# override the torch requirement (e.g. a CUDA build on a GPU machine).
#
# The packages go in with uv (installed into the venv by pip first): it downloads, unpacks and compiles the
# bytecode of torch and the rest on every core, where pip took twice as long on one. uv does not read pip's
# configuration, so the directories pip is told to find wheels in (PIP_FIND_LINKS, pip's find-links setting:
# where a machine keeps the CPU build of torch, say) are handed to it. uv reads UV_INDEX_URL and
# UV_EXTRA_INDEX_URL for other indexes (PyTorch's CUDA wheels, a mirror).
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
.venv/bin/python -m pip install --quiet 'uv>=0.9,<1'
find_links=()
for dir in ${PIP_FIND_LINKS:-} $(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true); do
  find_links+=(--find-links "$dir")
done
install() {
  .venv/bin/uv pip install --quiet --python .venv/bin/python --compile-bytecode "${find_links[@]}" "$@"
}
install "${SHARDSERVE_TORCH:-torch==2.13.0}" -e ".[dev]"
# The torchrec extra (shardserve.torchrec and its tests). torchrec asks for the CUDA fbgemm-gpu and tensordict
# for any torch, so the extra's packages go in pinned with --no-deps (fbgemm-gpu-cpu in place of fbgemm-gpu),
# then their torch-free dependencies.
install --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0 \
  tensordict==0.15.3 torchmetrics==1.0.3 tqdm==4.70.1 pyre-extensions==0.0.32
install cloudpickle==3.1.3 pyvers==0.2.3 typing-inspect==0.9.0 lightning-utilities==0.15.3
echo "$want" > "$stamp"
