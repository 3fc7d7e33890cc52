"""The error model on the wire (AIP-193): every error status carries a `google.rpc.Status` whose details hold
one `google.rpc.ErrorInfo` with domain "shardserve", a `Reason` and metadata naming the tensor, rank or field.

Servers build it with `rich_status`; clients (ours, or any generic gRPC client through
`grpc_status.rpc_status.from_call`) read it back with `error_info_of`. Retry decisions key on the reason,
never on the message text.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "shardserve"
MAX_METADATA_CHARS = (
    256  # one metadata value (a tensor name may be long; the message holds the rest)
)


class Reason(str, enum.Enum):
    """Why a call failed, one value per cause; docs/operations.md#errors lists them with their status codes."""

    INVALID_ARGUMENT = (
        "INVALID_ARGUMENT"  # a request field is malformed or out of range (metadata: field)
    )
    TENSOR_NOT_FOUND = "TENSOR_NOT_FOUND"  # no tensor (or snapshot, checkpoint) of that name
    TENSOR_EXISTS = "TENSOR_EXISTS"  # the name is taken and overwrite was not asked for
    STALE_VERSION = (
        "STALE_VERSION"  # the version asked for is no longer (or not yet) served: refresh, retry
    )
    TENSOR_BUSY = (
        "TENSOR_BUSY"  # another operation holds the tensor (a reshard, a checkpoint): retry later
    )
    INVALID_STATE = (
        "INVALID_STATE"  # the tensor or version is not in the state the call needs (committed...)
    )
    WRITE_INCOMPLETE = (
        "WRITE_INCOMPLETE"  # a version's shards were not all written: it cannot be committed
    )
    RANK_UNAVAILABLE = (
        "RANK_UNAVAILABLE"  # a rank is down, hung, partitioned or restoring: retryable
    )
    RANK_NOT_REGISTERED = (
        "RANK_NOT_REGISTERED"  # a heartbeat from a rank unknown here: it registers again
    )
    NOT_LEADER = "NOT_LEADER"  # this coordinator does not lead (a standby, or deposed); metadata: leader, term
    CATALOG_UNAVAILABLE = (
        "CATALOG_UNAVAILABLE"  # the coordinator cannot reach its catalog's database: retry later
    )
    SHARDS_LOST = "SHARDS_LOST"  # every copy of a box is known gone: not retryable
    CHECKSUM_MISMATCH = "CHECKSUM_MISMATCH"  # bytes read differ from their shard's checksum
    EPOCH_ENDED = (
        "EPOCH_ENDED"  # a collective job's epoch ended (a participant failed): run the job again
    )
    JOB_FAILED = "JOB_FAILED"  # a collective job failed on a rank; nothing was committed
    WORLD_MISMATCH = "WORLD_MISMATCH"  # an SPMD job's ranks disagree (world size, keys, layout)
    QUOTA_EXCEEDED = "QUOTA_EXCEEDED"  # a principal's byte or tensor quota
    MEMORY_LIMIT = "MEMORY_LIMIT"  # a rank's memory limit
    DISK_FULL = "DISK_FULL"  # a rank could not persist for want of space; nothing was acknowledged
    REQUEST_TOO_LARGE = "REQUEST_TOO_LARGE"  # a request over a byte, id or element limit
    OVERLOADED = "OVERLOADED"  # too many concurrent calls from one peer or in all: retry later
    UNAUTHENTICATED = "UNAUTHENTICATED"  # no token, or one that stands for no principal
    PERMISSION_DENIED = (
        "PERMISSION_DENIED"  # the principal lacks the right or the tensor is outside its patterns
    )
    PATH_UNAVAILABLE = (
        "PATH_UNAVAILABLE"  # this data path (shared memory, bulk port) is not offered here
    )
    CANCELLED = "CANCELLED"  # the caller ended the call
    INTERNAL = "INTERNAL"  # a bug: the message says what failed


@dataclass(frozen=True)
class ErrorDetail:
    """The reason and metadata of a failed call, as read from its status."""

    reason: Reason | None
    metadata: Mapping[str, str] = field(default_factory=dict)


def reason_of(text: str) -> Reason | None:
    """The Reason named `text`, or None for a reason this version does not know."""
    try:
        return Reason(text)
    except ValueError:
        return None


def metadata_strings(metadata: Mapping[str, object] | None) -> dict[str, str]:
    """`metadata` with every value a bounded string and None values left out."""
    out: dict[str, str] = {}
    for key, value in (metadata or {}).items():
        if value is not None:
            out[key] = str(value)[:MAX_METADATA_CHARS]
    return out


def status_proto(
    code: grpc.StatusCode,
    message: str,
    reason: Reason,
    metadata: Mapping[str, object] | None = None,
) -> status_pb2.Status:
    """The google.rpc.Status of an error: `code`, `message` and one ErrorInfo detail."""
    info = error_details_pb2.ErrorInfo(
        reason=reason.value, domain=DOMAIN, metadata=metadata_strings(metadata)
    )
    status = status_pb2.Status(code=code.value[0], message=message)
    status.details.add().Pack(info)
    return status


def rich_status(
    code: grpc.StatusCode,
    message: str,
    reason: Reason,
    metadata: Mapping[str, object] | None = None,
) -> grpc.Status:
    """What `context.abort_with_status` takes: the status with its details in the trailing metadata."""
    return rpc_status.to_status(status_proto(code, message, reason, metadata))


def detail_of_status(status: status_pb2.Status) -> ErrorDetail:
    """The ErrorInfo of a google.rpc.Status (reason None when it carries none of ours)."""
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.domain == DOMAIN:
                return ErrorDetail(reason_of(info.reason), dict(info.metadata))
    return ErrorDetail(None)


LEADER_KEY = "leader"  # the ErrorInfo metadata key of NOT_LEADER: the leader's HOST:PORT ("" while none is known)


def leader_of(detail: ErrorDetail) -> str | None:
    """The leader a NOT_LEADER answer names: its HOST:PORT, "" when the answering coordinator knows no leader
    yet, None when `detail` is not NOT_LEADER."""
    if detail.reason != Reason.NOT_LEADER:
        return None
    return detail.metadata.get(LEADER_KEY, "")


def error_detail_of(err: grpc.RpcError) -> ErrorDetail:
    """The ErrorInfo a failed call carried (reason None for a status from gRPC itself, e.g. a deadline)."""
    try:
        status = rpc_status.from_call(err)
    except (ValueError, AttributeError):  # details whose code or message disagree, or not a call
        return ErrorDetail(None)
    return detail_of_status(status) if status is not None else ErrorDetail(None)
