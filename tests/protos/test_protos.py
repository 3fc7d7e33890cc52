"""The committed generated protos match what `make protos` produces from protos/shardserve.proto."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("shardserve_pb2.py", "shardserve_pb2_grpc.py", "shardserve_pb2.pyi")


def test_generated_protos_are_up_to_date(tmp_path):
    protoc = pytest.importorskip("grpc_tools.protoc")
    out = (
        tmp_path / "shardserve" / "protos"
    )  # the import name of the protos/ folder (scripts/gen-protos.sh)
    out.mkdir(parents=True)
    shutil.copy(ROOT / "protos" / "shardserve.proto", out / "shardserve.proto")
    args = [
        "grpc_tools.protoc",
        f"-I{tmp_path}",
        f"--python_out={tmp_path}",
        f"--grpc_python_out={tmp_path}",
        f"--pyi_out={tmp_path}",
        str(out / "shardserve.proto"),
    ]
    assert protoc.main(args) == 0, "protoc failed"
    stale = [
        name
        for name in GENERATED
        if (out / name).read_text() != (ROOT / "protos" / name).read_text()
    ]
    assert not stale, f"generated files are stale, run `make protos`: {stale}"


def test_generated_modules_import_and_define_both_services():
    from shardserve.protos import shardserve_pb2 as pb
    from shardserve.protos import shardserve_pb2_grpc as pb_grpc

    assert set(pb.DESCRIPTOR.services_by_name) == {"Coordinator", "ShardServer", "Leadership"}
    assert pb.DESCRIPTOR.package == "shardserve.v1"
    assert hasattr(pb_grpc, "add_CoordinatorServicer_to_server") and hasattr(
        pb_grpc, "ShardServerStub"
    )
