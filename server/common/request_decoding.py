"""Requests whose bytes do not decode are answered INVALID_ARGUMENT, on every service.

grpcio answers a request its deserializer cannot parse with INTERNAL "Exception
deserializing request!" and logs a traceback, as if the server had failed. The
interceptor here wraps each method's deserializer so that it hands the method a
marker instead of raising, and the method then answers INVALID_ARGUMENT naming
the message type it expected; streamed requests are checked as they are read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

from shardserve.protos.errors import Reason
from shardserve.server.common.errors import abort


class Undecodable:
    """What a request that did not decode becomes: the reason, for the status message."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class RequestDecodingInterceptor(grpc.ServerInterceptor):
    """INVALID_ARGUMENT for undecodable requests instead of grpcio's INTERNAL."""

    def __init__(self) -> None:
        self._wrapped: dict[
            str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]
        ] = {}  # method -> (its, ours)

    def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: grpc.HandlerCallDetails
    ) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        known = self._wrapped.get(method)
        if known is None or known[0] is not handler:  # wrapped once per method, not per call
            known = self._wrapped[method] = (handler, _tolerant(handler, method))
        return known[1]


def _tolerant(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """`handler` with a deserializer that never raises and a behaviour that refuses what did not decode."""
    decode = handler.request_deserializer
    expected = getattr(getattr(decode, "__self__", None), "DESCRIPTOR", None)
    what = expected.full_name if expected is not None else f"request of {method}"

    def tolerant_decode(data: bytes) -> Any:
        try:
            return decode(data)
        except Exception as err:  # noqa: BLE001 - any parse failure is the caller's bad bytes
            return Undecodable(f"request: not a serialized {what} ({type(err).__name__}: {err})")

    kwargs = {
        "request_deserializer": tolerant_decode,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming:
        behavior = handler.stream_stream or handler.stream_unary

        def run_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            return behavior(_checked(requests, context), context)

        make = (
            grpc.stream_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.stream_unary_rpc_method_handler
        )
        return make(run_stream, **kwargs)
    behavior = handler.unary_stream or handler.unary_unary

    def run(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                request.reason,
                reason=Reason.INVALID_ARGUMENT,
            )
        return behavior(request, context)

    make = (
        grpc.unary_stream_rpc_method_handler
        if handler.response_streaming
        else grpc.unary_unary_rpc_method_handler
    )
    return make(run, **kwargs)


def _checked(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
    for request in requests:
        if isinstance(request, Undecodable):
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                request.reason,
                reason=Reason.INVALID_ARGUMENT,
            )
        yield request
