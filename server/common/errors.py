"""One place that turns Python exceptions into gRPC statuses with an ErrorInfo reason (AIP-193).

Store and coordinator logic raise `ServiceError` subclasses (or shardcore's ValueError/TypeError/KeyError);
the `rpc_errors` decorator used by the servicers aborts the call with the matching status code, a message
that names the bad field, and a `google.rpc.Status` detail whose ErrorInfo carries the `Reason`
(shardserve.protos.errors) and metadata naming the tensor, rank or field, so a bad request never takes a
server down and clients decide retries by reason. A status code that stands for several causes
(FAILED_PRECONDITION, RESOURCE_EXHAUSTED, ABORTED) has one subclass per cause.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import grpc

from shardserve.protos.errors import Reason, error_detail_of, rich_status

log = logging.getLogger(__name__)


class ServiceError(Exception):
    """An error with a gRPC status code and a reason; the message names the bad field, `metadata` the
    tensor, rank or field it is about."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    reason: Reason = Reason.INTERNAL

    def __init__(
        self,
        message: str,
        code: grpc.StatusCode | None = None,
        *,
        reason: Reason | None = None,
        metadata: Mapping[str, object] | None = None,
    ) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        if reason is not None:
            self.reason = reason
        self.metadata: dict[str, object] = dict(metadata or {})

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = Reason.INVALID_ARGUMENT


class TensorNotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND
    reason = Reason.TENSOR_NOT_FOUND


class RankNotRegistered(ServiceError):
    """A heartbeat from a rank this coordinator does not know (it restarted, or this one took over): the rank
    registers again on NOT_FOUND."""

    code = grpc.StatusCode.NOT_FOUND
    reason = Reason.RANK_NOT_REGISTERED


class TensorExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS
    reason = Reason.TENSOR_EXISTS


class StaleVersion(ServiceError):
    """The version asked for is no longer (or not yet) served here: the caller refreshes and retries."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = Reason.STALE_VERSION


class InvalidState(ServiceError):
    """The tensor or version is not in the state the call needs (already committed, reserved for a job, held
    by a live rank); the message says which."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = Reason.INVALID_STATE


class WriteIncomplete(ServiceError):
    """A version's shards were not all written (or a write left one torn): it cannot be committed."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = Reason.WRITE_INCOMPLETE


class WorldMismatch(ServiceError):
    """The ranks of an SPMD job (or of a collective job) disagree about its world, keys or layout."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = Reason.WORLD_MISMATCH


class EpochEnded(ServiceError):
    """A collective job's epoch ended (a participant failed or a newer epoch began): run the job again."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = Reason.EPOCH_ENDED


class TensorBusy(ServiceError):
    """Other work holds the tensor (a reshard, a checkpoint, a conflicting writer): retry later."""

    code = grpc.StatusCode.ABORTED
    reason = Reason.TENSOR_BUSY


class JobFailed(ServiceError):
    """A collective job failed on a rank; nothing it did was committed."""

    code = grpc.StatusCode.ABORTED
    reason = Reason.JOB_FAILED


class QuotaExceeded(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = Reason.QUOTA_EXCEEDED


class MemoryLimit(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = Reason.MEMORY_LIMIT


class DiskFull(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = Reason.DISK_FULL


class RequestTooLarge(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = Reason.REQUEST_TOO_LARGE


class Overloaded(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = Reason.OVERLOADED


class RankUnavailable(ServiceError):
    """A rank is down, hung, partitioned or restoring: retryable."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = Reason.RANK_UNAVAILABLE


class NotLeader(ServiceError):
    """This coordinator does not lead its cluster (a standby, or a leader deposed: its lease term no longer
    holds): `metadata` names the leader's address ("leader") and term ("term") where known; ask the leader."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = Reason.NOT_LEADER


class CatalogUnavailable(ServiceError):
    """The catalog's database cannot be reached (restarting, failing over, partitioned) or refused the call
    for want of a connection: nothing was changed, or a commit's outcome is unknown and the caller's retry
    finds it; retryable."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = Reason.CATALOG_UNAVAILABLE


class ShardsLost(ServiceError):
    """The work needs a box no live rank holds (every copy is on a dead rank or was lost)."""

    code = grpc.StatusCode.DATA_LOSS
    reason = Reason.SHARDS_LOST


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED
    reason = Reason.UNAUTHENTICATED


class PermissionDenied(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED
    reason = Reason.PERMISSION_DENIED


class PathUnavailable(ServiceError):
    """A data path (shared memory, the bulk port) is not offered by this server: the client falls back."""

    code = grpc.StatusCode.UNIMPLEMENTED
    reason = Reason.PATH_UNAVAILABLE


@dataclass(frozen=True)
class ErrorStatus:
    """What a server answers for an error: code, message, reason and metadata."""

    code: grpc.StatusCode
    message: str
    reason: Reason
    metadata: Mapping[str, object]


_REASON_OF_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: Reason.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE: Reason.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND: Reason.TENSOR_NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS: Reason.TENSOR_EXISTS,
    grpc.StatusCode.UNAVAILABLE: Reason.RANK_UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: Reason.RANK_UNAVAILABLE,
    grpc.StatusCode.DATA_LOSS: Reason.SHARDS_LOST,
    grpc.StatusCode.UNAUTHENTICATED: Reason.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED: Reason.PERMISSION_DENIED,
    grpc.StatusCode.CANCELLED: Reason.CANCELLED,
    grpc.StatusCode.UNIMPLEMENTED: Reason.PATH_UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Reason.OVERLOADED,
}


def reason_for_code(code: grpc.StatusCode) -> Reason:
    """The reason of a status that came without one (from gRPC itself, or relayed from a peer's call)."""
    return _REASON_OF_CODE.get(code, Reason.INTERNAL)


def relayed(
    err: grpc.RpcError, message: str, *, metadata: Mapping[str, object] | None = None
) -> ServiceError:
    """A peer's failed call as an error of this server: its code, reason and metadata kept (a status without
    an ErrorInfo gets the reason its code stands for), `metadata` added, `message` instead of its own."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    detail = error_detail_of(err)
    reason = detail.reason or reason_for_code(code)
    merged = {**detail.metadata, **(metadata or {})}
    return ServiceError(message, code, reason=reason, metadata=merged)


def status_of(err: BaseException) -> ErrorStatus:
    """The status a server answers for `err`."""
    if isinstance(err, ServiceError):
        return ErrorStatus(err.code, err.message, err.reason, err.metadata)
    if isinstance(err, grpc.RpcError):  # a request stream the client cancelled or let time out
        if hasattr(err, "code"):
            code = err.code()
            return ErrorStatus(code, err.details() or "", reason_for_code(code), {})
        message = "the client ended the request stream (cancelled or past its deadline)"
        return ErrorStatus(grpc.StatusCode.CANCELLED, message, Reason.CANCELLED, {})
    if isinstance(err, KeyError):
        message = str(err.args[0]) if err.args else "not found"
        return ErrorStatus(grpc.StatusCode.NOT_FOUND, message, Reason.TENSOR_NOT_FOUND, {})
    if isinstance(err, (ValueError, TypeError)):
        return ErrorStatus(grpc.StatusCode.INVALID_ARGUMENT, str(err), Reason.INVALID_ARGUMENT, {})
    if isinstance(err, MemoryError):
        message = f"out of memory: {err}"
        return ErrorStatus(grpc.StatusCode.RESOURCE_EXHAUSTED, message, Reason.MEMORY_LIMIT, {})
    message = f"internal error: {type(err).__name__}: {err}"
    return ErrorStatus(grpc.StatusCode.INTERNAL, message, Reason.INTERNAL, {})


class item_errors:  # noqa: N801 - used as a function: `with item_errors("shards[3]"):`
    """Errors raised inside, with their status, as errors of one entry of a batch (`item`, e.g. "shards[3]"):
    the message prefixed "ITEM: " and `item` in the metadata, so the caller knows which entry failed.
    `translate` first turns a layer's own errors into service errors (the rank's: error_status.py; it returns
    any other error as it is). A class, not a generator: a batch enters one per entry, and a generator's context
    manager costs several times more."""

    __slots__ = ("item", "translate")

    def __init__(
        self, item: str, translate: Callable[[BaseException], BaseException] | None = None
    ) -> None:
        self.item, self.translate = item, translate

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: Any
    ) -> Literal[False]:
        if err is None:
            return False
        if self.translate is not None:
            err = self.translate(err)
        if not isinstance(err, (ServiceError, ValueError, TypeError, KeyError)):
            return False  # raised as it is
        status = status_of(err)
        metadata = {**status.metadata, "item": self.item}
        message = f"{self.item}: {status.message}"
        raise ServiceError(message, status.code, reason=status.reason, metadata=metadata) from None


MAX_MESSAGE_CHARS = 2000  # a status message travels in a header: gRPC refuses headers over 16 KiB


def bounded_message(message: str) -> str:
    """`message`, cut to MAX_MESSAGE_CHARS: errors quote the caller's input, which may be megabytes, and an
    oversized status would reach the client as RESOURCE_EXHAUSTED instead of the real error."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return f"{message[:MAX_MESSAGE_CHARS]}... ({len(message) - MAX_MESSAGE_CHARS} more characters)"


def abort(
    context: grpc.ServicerContext,
    code: grpc.StatusCode,
    message: str,
    *,
    reason: Reason,
    metadata: Mapping[str, object] | None = None,
) -> None:
    """End the call with `code`, `message` and an ErrorInfo of `reason` (raises, as context.abort does)."""
    context.abort_with_status(rich_status(code, bounded_message(message), reason, metadata))


def request_metadata(request: object) -> dict[str, object]:
    """The ErrorInfo metadata a request implies: the tensor its top-level `name` field names."""
    name = getattr(request, "name", None)
    return {"tensor": name} if isinstance(name, str) and name else {}


def abort_for(
    context: grpc.ServicerContext, method: str, err: BaseException, *, request: object = None
) -> None:
    """End the call with the status of `err`, logged (with the traceback for an INTERNAL error); the
    metadata names the tensor of `request` unless the error names one itself."""
    status = status_of(err)
    if status.code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method)
    else:
        log.info("%s -> %s (%s): %s", method, status.code.name, status.reason.value, status.message)
    metadata = {**request_metadata(request), **status.metadata}
    abort(context, status.code, status.message, reason=status.reason, metadata=metadata)


def rpc_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a servicer method (unary or server-streaming) to map exceptions to status codes."""
    name = method.__qualname__
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def streaming(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
            try:
                yield from method(self, request, context)
            except Exception as err:  # noqa: BLE001 - every error becomes a status code
                if _is_abort(err):
                    raise
                abort_for(context, name, err, request=request)

        return streaming

    @functools.wraps(method)
    def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Exception as err:  # noqa: BLE001 - every error becomes a status code
            if _is_abort(err):
                raise
            abort_for(context, name, err, request=request)

    return unary


def _is_abort(err: BaseException) -> bool:
    """True for the exception grpc raises inside context.abort (already answered)."""
    return type(err) is Exception and not err.args
