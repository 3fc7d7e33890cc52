#!/usr/bin/env bash
# Runs the CUDA-marked tests (pytest arguments may replace the selection: `... -m "not cuda" -n 8`)
# on a machine with a GPU whose python3 already holds a CUDA torch.
# Wheels for the gRPC/protobuf versions we pin may travel in .whl/ (see README "Development").
set -u
# Installed into python3's own environment (not a --target dir) so that the processes tests start see them too.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade .whl/*.whl || exit 1
fi
export PYTHONPATH=$PWD
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L
python3 -c "import torch, grpc, google.protobuf as p, torch.distributed as d; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count(), 'nccl', d.is_nccl_available(), torch.cuda.nccl.version() if torch.cuda.is_available() else None, 'grpc', grpc.__version__, 'protobuf', p.__version__)"
if [ $# -eq 0 ]; then set -- -m cuda -v; fi
python3 -m pytest -p no:cacheprovider -rs "$@" 2>&1 | tee "$OUT/cuda-tests.log"
