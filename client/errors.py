"""Client exceptions: one class per gRPC status code, keeping the server's message.

Each class also subclasses the built-in exception a Python caller expects
(KeyError for an unknown tensor, ValueError for bad input, ...), so callers can
catch either the shardserve class or the built-in one.
"""

from __future__ import annotations

import grpc


class ShardServeError(Exception):
    """Base of every error raised by the shardserve client."""

    code: grpc.StatusCode | None = None

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:  # KeyError would otherwise print repr(message)
        return self.message


class TensorNotFoundError(ShardServeError, KeyError):
    """No tensor of that name (NOT_FOUND)."""

    code = grpc.StatusCode.NOT_FOUND


class InvalidArgumentError(ShardServeError, ValueError):
    """A request field is malformed or out of range (INVALID_ARGUMENT); the message names it."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class TensorExistsError(ShardServeError, ValueError):
    """A tensor of that name already exists and overwrite was not asked for (ALREADY_EXISTS)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class StaleVersionError(ShardServeError):
    """The version the client holds is no longer served (FAILED_PRECONDITION)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhaustedError(ShardServeError):
    """A request is over a configured byte or memory limit (RESOURCE_EXHAUSTED)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class AuthenticationError(ShardServeError, PermissionError):
    """Missing or wrong token (UNAUTHENTICATED or PERMISSION_DENIED)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class RankUnavailableError(ShardServeError, ConnectionError):
    """A coordinator or rank cannot be reached (UNAVAILABLE)."""

    code = grpc.StatusCode.UNAVAILABLE


class ShardsLostError(RankUnavailableError):
    """A read needs a box with no live copy (DATA_LOSS): every rank holding it is dead or lost it (restarted
    empty). `boxes` are the lost boxes the read touches as (offsets, sizes), `ranks` the ranks that held them.
    Other boxes of the tensor stay readable; a new put (overwrite) or a repair brings the box back. Also a
    RankUnavailableError (and so a ConnectionError), which is what such a read raised before boxes were
    tracked."""

    code = grpc.StatusCode.DATA_LOSS

    def __init__(
        self,
        message: str,
        code: grpc.StatusCode | None = None,
        boxes: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = (),
        ranks: tuple[int, ...] = (),
    ) -> None:
        super().__init__(message, code)
        self.boxes = boxes
        self.ranks = ranks


class AbortedError(ShardServeError):
    """The coordinator gave the call up over other work (ABORTED): the tensor stayed busy in a reshard or
    checkpoint past the wait (retry once it has ended), or a collective job failed on a rank; the message says
    which."""

    code = grpc.StatusCode.ABORTED


class DeadlineExceededError(ShardServeError, TimeoutError):
    """A call ran past its deadline (DEADLINE_EXCEEDED)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


_BY_CODE: dict[grpc.StatusCode, type[ShardServeError]] = {
    grpc.StatusCode.NOT_FOUND: TensorNotFoundError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.ALREADY_EXISTS: TensorExistsError,
    grpc.StatusCode.FAILED_PRECONDITION: StaleVersionError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
    grpc.StatusCode.UNAVAILABLE: RankUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.ABORTED: AbortedError,
    grpc.StatusCode.DATA_LOSS: ShardsLostError,
}


def error_from_status(
    code: grpc.StatusCode | None, details: str | None, where: str = ""
) -> ShardServeError:
    """The client exception for a gRPC status, keeping the server's message."""
    message = details or (code.name if code is not None else "unknown error")
    if where and code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        message = f"{where}: {message}"
    cls = _BY_CODE.get(code, ShardServeError) if code is not None else ShardServeError
    return cls(message, code)


def error_from_rpc(err: grpc.RpcError, where: str = "") -> ShardServeError:
    """The client exception for a failed gRPC call (`where` names the peer for connection errors)."""
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    return error_from_status(code, details, where)
