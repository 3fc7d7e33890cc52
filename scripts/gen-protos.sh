#!/usr/bin/env bash
# Regenerates protos/shardserve_pb2*.py(i) from protos/shardserve.proto, with imports under `shardserve.protos`
# (the import name the protos/ folder has once installed).
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/shardserve/protos"
cp protos/shardserve.proto "$tmp/shardserve/protos/"
.venv/bin/python -m grpc_tools.protoc -I"$tmp" --python_out="$tmp" --grpc_python_out="$tmp" --pyi_out="$tmp" \
  "$tmp/shardserve/protos/shardserve.proto"
cp "$tmp"/shardserve/protos/shardserve_pb2.py "$tmp"/shardserve/protos/shardserve_pb2_grpc.py \
  "$tmp"/shardserve/protos/shardserve_pb2.pyi protos/
