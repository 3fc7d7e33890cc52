"""One place that turns Python exceptions into gRPC status codes.

Store and coordinator logic raise `ServiceError` subclasses (or shardcore's
ValueError/TypeError/KeyError); the `rpc_errors` decorator used by both
servicers aborts the call with the matching status code and a message that
names the bad field, so a bad request never takes a server down.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc

log = logging.getLogger(__name__)


class ServiceError(Exception):
    """An error with a gRPC status code; the message names the bad field."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(ServiceError):
    """The work needs a box no live rank holds (every copy is on a dead rank or was lost)."""

    code = grpc.StatusCode.DATA_LOSS


class Aborted(ServiceError):
    """A conflict with other work on the same thing (e.g. a tensor busy in a long reshard): retry later."""

    code = grpc.StatusCode.ABORTED


def status_of(err: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a server answers for `err`."""
    if isinstance(err, ServiceError):
        return err.code, err.message
    if isinstance(err, grpc.RpcError):  # a request stream the client cancelled or let time out
        if hasattr(err, "code"):
            return err.code(), err.details() or ""
        return (
            grpc.StatusCode.CANCELLED,
            "the client ended the request stream (cancelled or past its deadline)",
        )
    if isinstance(err, KeyError):
        return grpc.StatusCode.NOT_FOUND, str(err.args[0]) if err.args else "not found"
    if isinstance(err, (ValueError, TypeError)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(err)
    if isinstance(err, MemoryError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of memory: {err}"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}: {err}"


@contextmanager
def item_errors(item: str) -> Iterator[None]:
    """Errors raised inside, with their status, as errors of one entry of a batch (`item`, e.g. "shards[3]"):
    the message prefixed "ITEM: " so the caller knows which entry failed."""
    try:
        yield
    except ServiceError as err:
        raise type(err)(f"{item}: {err.message}", err.code) from None
    except (ValueError, TypeError, KeyError) as err:
        code, message = status_of(err)
        raise ServiceError(f"{item}: {message}", code) from None


MAX_MESSAGE_CHARS = 2000  # a status message travels in a header: gRPC refuses headers over 16 KiB


def bounded_message(message: str) -> str:
    """`message`, cut to MAX_MESSAGE_CHARS: errors quote the caller's input, which may be megabytes, and an
    oversized status would reach the client as RESOURCE_EXHAUSTED instead of the real error."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return f"{message[:MAX_MESSAGE_CHARS]}... ({len(message) - MAX_MESSAGE_CHARS} more characters)"


def _abort(context: grpc.ServicerContext, method: str, err: BaseException) -> None:
    code, message = status_of(err)
    message = bounded_message(message)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method)
    else:
        log.info("%s -> %s: %s", method, code.name, message)
    context.abort(code, message)


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
                _abort(context, name, err)

        return streaming

    @functools.wraps(method)
    def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Exception as err:  # noqa: BLE001 - every error becomes a status code
            if _is_abort(err):
                raise
            _abort(context, name, err)

    return unary


def _is_abort(err: BaseException) -> bool:
    """True for the exception grpc raises inside context.abort (already answered)."""
    return type(err) is Exception and not err.args
