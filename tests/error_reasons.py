"""Reading a failed call's error the way a generic gRPC client does (grpc_status.rpc_status.from_call and
google.rpc.ErrorInfo), for the tests of each error reason."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from shardserve.protos.errors import Reason

DOMAIN = "shardserve"


def error_info(err: grpc.RpcError) -> error_details_pb2.ErrorInfo:
    """The one ErrorInfo in the google.rpc.Status of `err`'s trailing metadata (fails the test otherwise)."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None, f"{err.code()} carries no google.rpc.Status: {err.details()}"
    assert status.code == err.code().value[0] and status.message == err.details()
    infos = []
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            infos.append(info)
    assert len(infos) == 1, f"expected one ErrorInfo, got {infos}"
    return infos[0]


def assert_status(
    err: grpc.RpcError, code: grpc.StatusCode, reason: Reason, **metadata: object
) -> error_details_pb2.ErrorInfo:
    """`err` has status `code` and an ErrorInfo of domain "shardserve", `reason` and at least `metadata`."""
    assert err.code() == code, f"{err.code()} ({err.details()}), expected {code}"
    info = error_info(err)
    assert info.domain == DOMAIN
    assert info.reason == reason.value, f"{info.reason} ({err.details()}), expected {reason.value}"
    for key, value in metadata.items():
        assert info.metadata.get(key) == str(value), f"metadata {dict(info.metadata)}: {key}"
    return info
