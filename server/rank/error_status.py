"""The one table from the rank's own errors (server/rank/errors.py) to service errors with a status and reason.

Every rank servicer decorates its methods with `rank_rpc`, and the bulk port answers its errors through
`error_status`, so a refusal reads the same (code, reason, message, metadata) on every data path.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from shardserve.server.common.errors import (
    ErrorStatus,
    InvalidArgument,
    InvalidState,
    MemoryLimit,
    NotFound,
    RequestTooLarge,
    ServiceError,
    StaleVersion,
    TensorBusy,
    WriteIncomplete,
    rpc_errors,
    status_of,
)
from shardserve.server.rank.errors import (
    BadRequest,
    BoxTooLarge,
    IllegalTransition,
    OverMemory,
    RankError,
    RowsOnly,
    ShardReserved,
    ShardsIncomplete,
    TensorUnknown,
    VersionBusy,
    VersionCommitted,
    VersionExists,
    VersionNotServed,
)

SERVICE_ERRORS: Mapping[type[RankError], type[ServiceError]] = {
    BadRequest: InvalidArgument,
    TensorUnknown: NotFound,
    VersionNotServed: StaleVersion,
    VersionCommitted: InvalidState,
    VersionExists: InvalidState,
    ShardReserved: InvalidState,
    RowsOnly: InvalidState,
    IllegalTransition: InvalidState,
    ShardsIncomplete: WriteIncomplete,
    VersionBusy: TensorBusy,
    OverMemory: MemoryLimit,
    BoxTooLarge: RequestTooLarge,
}


def service_error(err: RankError) -> ServiceError:
    """The service error (status code and reason) that answers `err`, with its message and metadata."""
    for kind in type(err).__mro__:
        if kind in SERVICE_ERRORS:
            return SERVICE_ERRORS[kind](err.message, metadata=err.metadata)
    return ServiceError(err.message, metadata=err.metadata)


def error_status(err: BaseException) -> ErrorStatus:
    """The status a rank answers for `err`, whichever layer raised it (the bulk port's error answers)."""
    return status_of(service_error(err) if isinstance(err, RankError) else err)


@contextmanager
def service_errors() -> Iterator[None]:
    """Rank errors raised inside, as the service errors that answer them (inside an `item_errors` of a batch,
    so the entry's name is added to the translated error)."""
    try:
        yield
    except RankError as err:
        raise service_error(err) from err


def rank_rpc(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a rank servicer method (unary or server-streaming): rank errors become their service errors,
    then every error a status (common `rpc_errors`)."""
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def streaming(self: Any, request: Any, context: Any) -> Any:
            with service_errors():
                yield from method(self, request, context)

        return rpc_errors(streaming)

    @functools.wraps(method)
    def unary(self: Any, request: Any, context: Any) -> Any:
        with service_errors():
            return method(self, request, context)

    return rpc_errors(unary)
