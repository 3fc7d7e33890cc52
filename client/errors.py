"""Client exceptions: one class per gRPC status code, and under it one per reason, named after the reason
(TensorBusyError for TENSOR_BUSY, as the servers name it TensorBusy), keeping the server's message, its
ErrorInfo reason and metadata.

Each class also subclasses the built-in exception a Python caller expects
(KeyError for an unknown tensor, ValueError for bad input, ...), so callers can
catch either the shardserve class or the built-in one.
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from shardserve.protos.errors import LEADER_KEY, ErrorDetail, Reason, error_detail_of

# The reason of a status that came without an ErrorInfo, where its code alone names one (as the servers read it:
# server/common/errors.py): a peer without the method does not offer that path; exhausted is overloaded.
_REASON_OF_CODE = {
    grpc.StatusCode.UNIMPLEMENTED: Reason.PATH_UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Reason.OVERLOADED,
}


class ShardServeError(Exception):
    """Base of every error raised by the shardserve client: `code` (the gRPC status), `reason` (the
    ErrorInfo reason the server gave, shardserve.protos.errors.Reason) and `metadata` (tensor, rank,
    field ...); retries key on `reason`."""

    code: grpc.StatusCode | None = None
    reason: Reason | None = None

    def __init__(
        self,
        message: str,
        code: grpc.StatusCode | None = None,
        *,
        reason: Reason | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if reason is None and self.reason is None and code is not None:
            reason = _REASON_OF_CODE.get(code)
        if reason is not None:
            self.reason = reason
        self.metadata: dict[str, str] = dict(metadata or {})

    def __str__(self) -> str:  # KeyError would otherwise print repr(message)
        return self.message


class TensorNotFoundError(ShardServeError, KeyError):
    """No tensor of that name (NOT_FOUND)."""

    code = grpc.StatusCode.NOT_FOUND
    reason = Reason.TENSOR_NOT_FOUND


class InvalidArgumentError(ShardServeError, ValueError):
    """A request field is malformed or out of range (INVALID_ARGUMENT); the message names it."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = Reason.INVALID_ARGUMENT


class TensorExistsError(ShardServeError, ValueError):
    """A tensor of that name already exists and overwrite was not asked for (ALREADY_EXISTS)."""

    code = grpc.StatusCode.ALREADY_EXISTS
    reason = Reason.TENSOR_EXISTS


class PreconditionError(ShardServeError):
    """The tensor or cluster is not in the state the call needs (FAILED_PRECONDITION); `reason` says which
    (INVALID_STATE, WRITE_INCOMPLETE, WORLD_MISMATCH, EPOCH_ENDED, STALE_VERSION)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = Reason.INVALID_STATE


class StaleVersionError(PreconditionError):
    """The version the client holds is no longer served (FAILED_PRECONDITION, STALE_VERSION)."""

    reason = Reason.STALE_VERSION


class InvalidStateError(PreconditionError):
    """The tensor or version is not in the state the call needs, already committed say (INVALID_STATE)."""

    reason = Reason.INVALID_STATE


class WriteIncompleteError(PreconditionError):
    """A commit before every shard was fully written (WRITE_INCOMPLETE)."""

    reason = Reason.WRITE_INCOMPLETE


class WorldMismatchError(PreconditionError):
    """A rank or SPMD job disagrees about the world: its size, keys or layout (WORLD_MISMATCH)."""

    reason = Reason.WORLD_MISMATCH


class EpochEndedError(PreconditionError):
    """A collective job of an epoch that ended on a rank (EPOCH_ENDED)."""

    reason = Reason.EPOCH_ENDED


class ResourceExhaustedError(ShardServeError):
    """A request is over a limit (RESOURCE_EXHAUSTED); `reason` says which: QUOTA_EXCEEDED, MEMORY_LIMIT,
    DISK_FULL, REQUEST_TOO_LARGE or OVERLOADED."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = Reason.OVERLOADED


class QuotaExceededError(ResourceExhaustedError):
    """The principal's byte quota (QUOTA_EXCEEDED)."""

    reason = Reason.QUOTA_EXCEEDED


class MemoryLimitError(ResourceExhaustedError):
    """A rank's memory limit or its device memory (MEMORY_LIMIT)."""

    reason = Reason.MEMORY_LIMIT


class DiskFullError(ResourceExhaustedError):
    """A rank could not persist for want of space; nothing was acknowledged (DISK_FULL)."""

    reason = Reason.DISK_FULL


class RequestTooLargeError(ResourceExhaustedError):
    """A request or answer over a byte, id or region limit (REQUEST_TOO_LARGE)."""

    reason = Reason.REQUEST_TOO_LARGE


class OverloadedError(ResourceExhaustedError):
    """Too many streaming calls of one principal or in all: retry later (OVERLOADED)."""

    reason = Reason.OVERLOADED


class UnauthenticatedError(ShardServeError, PermissionError):
    """Missing or wrong token (UNAUTHENTICATED)."""

    code = grpc.StatusCode.UNAUTHENTICATED
    reason = Reason.UNAUTHENTICATED


AuthenticationError = UnauthenticatedError  # its earlier name


class PermissionDeniedError(ShardServeError, PermissionError):
    """The caller is known but not allowed (PERMISSION_DENIED): its role lacks the right, or the tensor is
    outside its patterns; `metadata` names the principal and the tensor or right."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = Reason.PERMISSION_DENIED


class RankUnavailableError(ShardServeError, ConnectionError):
    """A coordinator or rank cannot be reached, or is hung, partitioned or restoring (UNAVAILABLE,
    RANK_UNAVAILABLE): retryable."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = Reason.RANK_UNAVAILABLE


class NotLeaderError(RankUnavailableError):
    """The coordinator asked does not lead (UNAVAILABLE, NOT_LEADER): a standby, or a leader whose lease ran
    out. `leader` is the leader's HOST:PORT it names ("" while it knows none). The client follows it to the
    leader within its deadline; this is raised only when no leader answered in time. Retryable."""

    reason = Reason.NOT_LEADER

    @property
    def leader(self) -> str:
        return self.metadata.get(LEADER_KEY, "")


class ShardsLostError(RankUnavailableError):
    """A read needs a box whose every copy is known gone (DATA_LOSS, SHARDS_LOST): the ranks holding it
    restarted without it (a rank that is only down, hung or partitioned is RankUnavailableError). `boxes` are
    the lost boxes the read touches as (offsets, sizes), `ranks` the ranks that held them. Other boxes of the
    tensor stay readable; a new put (overwrite) or a repair brings the box back. Never retried. Also a
    RankUnavailableError (and so a ConnectionError)."""

    code = grpc.StatusCode.DATA_LOSS
    reason = Reason.SHARDS_LOST

    def __init__(
        self,
        message: str,
        code: grpc.StatusCode | None = None,
        *,
        reason: Reason | None = None,
        metadata: Mapping[str, str] | None = None,
        boxes: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = (),
        ranks: tuple[int, ...] = (),
    ) -> None:
        super().__init__(message, code, reason=reason, metadata=metadata)
        self.boxes = boxes
        self.ranks = ranks


class ChecksumMismatchError(ShardServeError):
    """A read with verify=True got bytes whose checksum is not the shard's (DATA_LOSS, CHECKSUM_MISMATCH), and
    no other copy of the box read right either. `tensor`, `shard` (its index in the layout) and `rank` name the
    copy (the first one tried); the metadata holds them too. Never retried."""

    code = grpc.StatusCode.DATA_LOSS
    reason = Reason.CHECKSUM_MISMATCH

    @property
    def tensor(self) -> str:
        return self.metadata.get("tensor", "")

    @property
    def shard(self) -> int:
        return int(self.metadata.get("shard", "-1"))

    @property
    def rank(self) -> int:
        return int(self.metadata.get("rank", "-1"))


class AbortedError(ShardServeError):
    """The coordinator gave the call up over other work (ABORTED): `reason` TENSOR_BUSY when the tensor stayed
    busy in a reshard or checkpoint past the wait (retry once it has ended), JOB_FAILED when a collective job
    failed on a rank; the message says which."""

    code = grpc.StatusCode.ABORTED
    reason = Reason.TENSOR_BUSY


class TensorBusyError(AbortedError):
    """A reshard, checkpoint or other change held the tensor past the wait: retry once it has ended
    (TENSOR_BUSY)."""

    reason = Reason.TENSOR_BUSY


class JobFailedError(AbortedError):
    """A collective job failed on a rank; nothing was committed (JOB_FAILED)."""

    reason = Reason.JOB_FAILED


class DeadlineExceededError(ShardServeError, TimeoutError):
    """A call ran past its deadline (DEADLINE_EXCEEDED)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


_BY_REASON: dict[Reason, type[ShardServeError]] = {
    Reason.STALE_VERSION: StaleVersionError,
    Reason.SHARDS_LOST: ShardsLostError,
    Reason.CHECKSUM_MISMATCH: ChecksumMismatchError,
}

_BY_CODE: dict[grpc.StatusCode, type[ShardServeError]] = {
    grpc.StatusCode.NOT_FOUND: TensorNotFoundError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.ALREADY_EXISTS: TensorExistsError,
    grpc.StatusCode.FAILED_PRECONDITION: PreconditionError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.UNAVAILABLE: RankUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.ABORTED: AbortedError,
    grpc.StatusCode.DATA_LOSS: ShardsLostError,
}


# The classes of the reasons a status code stands for, each under its code's class.
_BY_CODE_AND_REASON: dict[grpc.StatusCode, dict[Reason, type[ShardServeError]]] = {
    grpc.StatusCode.FAILED_PRECONDITION: {
        Reason.INVALID_STATE: InvalidStateError,
        Reason.WRITE_INCOMPLETE: WriteIncompleteError,
        Reason.WORLD_MISMATCH: WorldMismatchError,
        Reason.EPOCH_ENDED: EpochEndedError,
    },
    grpc.StatusCode.RESOURCE_EXHAUSTED: {
        Reason.QUOTA_EXCEEDED: QuotaExceededError,
        Reason.MEMORY_LIMIT: MemoryLimitError,
        Reason.DISK_FULL: DiskFullError,
        Reason.REQUEST_TOO_LARGE: RequestTooLargeError,
        Reason.OVERLOADED: OverloadedError,
    },
    grpc.StatusCode.UNAVAILABLE: {Reason.NOT_LEADER: NotLeaderError},
    grpc.StatusCode.ABORTED: {
        Reason.TENSOR_BUSY: TensorBusyError,
        Reason.JOB_FAILED: JobFailedError,
    },
}


def error_class(code: grpc.StatusCode | None, reason: Reason | None) -> type[ShardServeError]:
    """The exception class for a status: by reason where one has its own class, else the reason's class under
    its code's, else by code."""
    if reason is not None and reason in _BY_REASON:
        return _BY_REASON[reason]
    if code is None:
        return ShardServeError
    by_reason = _BY_CODE_AND_REASON.get(code, {})
    if reason is not None and reason in by_reason:
        return by_reason[reason]
    return _BY_CODE.get(code, ShardServeError)


def error_from_status(
    code: grpc.StatusCode | None,
    details: str | None,
    where: str = "",
    *,
    detail: ErrorDetail | None = None,
) -> ShardServeError:
    """The client exception for a gRPC status and its ErrorInfo `detail`, keeping the server's message."""
    message = details or (code.name if code is not None else "unknown error")
    if where and code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        message = f"{where}: {message}"
    detail = detail or ErrorDetail(None)
    cls = error_class(code, detail.reason)
    return cls(message, code, reason=detail.reason, metadata=detail.metadata)


def error_from_rpc(err: grpc.RpcError, where: str = "") -> ShardServeError:
    """The client exception for a failed gRPC call (`where` names the peer for connection errors)."""
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    return error_from_status(code, details, where, detail=error_detail_of(err))
