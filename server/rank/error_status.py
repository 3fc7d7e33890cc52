"""The one table from the rank's own errors (server/rank/errors.py) to service errors with a status and reason.

Every rank servicer decorates its methods with `rank_rpc`, and the bulk port answers its errors through
`error_status`, so a refusal reads the same (code, reason, message, metadata) on every data path. Both
families name a cause alike (TensorNotFound here and there), after its `Reason`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from shardserve.server.common import errors as service
from shardserve.server.common.errors import ErrorStatus, ServiceError, rpc_errors, status_of
from shardserve.server.common.errors import item_errors as service_item_errors
from shardserve.server.rank import errors as rank

SERVICE_ERRORS: Mapping[type[rank.RankError], type[ServiceError]] = {
    rank.InvalidArgument: service.InvalidArgument,
    rank.TensorNotFound: service.TensorNotFound,
    rank.StaleVersion: service.StaleVersion,
    rank.InvalidState: service.InvalidState,
    rank.WriteIncomplete: service.WriteIncomplete,
    rank.TensorBusy: service.TensorBusy,
    rank.MemoryLimit: service.MemoryLimit,
    rank.DiskFull: service.DiskFull,
    rank.RequestTooLarge: service.RequestTooLarge,
    rank.Overloaded: service.Overloaded,
    rank.PermissionDenied: service.PermissionDenied,
    rank.RankUnavailable: service.RankUnavailable,
    rank.EpochEnded: service.EpochEnded,
    rank.PathUnavailable: service.PathUnavailable,
}


def service_error(err: rank.RankError) -> ServiceError:
    """The service error (status code and reason) that answers `err`, with its message and metadata."""
    for kind in type(err).__mro__:
        if kind in SERVICE_ERRORS:
            return SERVICE_ERRORS[kind](err.message, metadata=err.metadata)
    return ServiceError(err.message, metadata=err.metadata)


def error_status(err: BaseException) -> ErrorStatus:
    """The status a rank answers for `err`, whichever layer raised it (the bulk port's error answers)."""
    return status_of(service_error(err) if isinstance(err, rank.RankError) else err)


@contextmanager
def service_errors() -> Iterator[None]:
    """Rank errors raised inside, as the service errors that answer them (inside an `item_errors` of a batch,
    so the entry's name is added to the translated error)."""
    try:
        yield
    except rank.RankError as err:
        raise service_error(err) from err


def item_errors(item: str) -> service_item_errors:
    """Errors raised inside, rank errors translated first, as errors of one entry of a batch (`item`, e.g.
    "shards[3]"): the message prefixed "ITEM: " and `item` in the metadata (common `item_errors`)."""
    return service_item_errors(item, _as_service_error)


def _as_service_error(err: BaseException) -> BaseException:
    return service_error(err) if isinstance(err, rank.RankError) else err


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
