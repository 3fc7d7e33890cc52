#!/usr/bin/env bash
# Runs the CUDA-marked tests on a machine with a GPU whose python3 already holds a CUDA torch.
# Wheels for the gRPC/protobuf versions we pin may travel in .whl/ (see README "Development").
set -u
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L
python3 -c "import torch, grpc, google.protobuf as p, torch.distributed as d; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count(), 'nccl', d.is_nccl_available(), torch.cuda.nccl.version() if torch.cuda.is_available() else None, 'grpc', grpc.__version__, 'protobuf', p.__version__)"
python3 -m pytest -p no:cacheprovider -m cuda -v -rs "$@" 2>&1 | tee "$OUT/cuda-tests.log"
