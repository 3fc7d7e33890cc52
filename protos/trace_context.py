"""W3C trace context in gRPC call metadata: the client-side interceptor both the client and the servers use.

The OpenTelemetry gRPC instrumentation's own client interceptor turns a
response stream into a plain generator, which has no cancel() or code(); the
collective-job runner and the client's readers need both. This interceptor
instead starts a CLIENT span, injects its `traceparent` into the call's
metadata (the standard server interceptor on the other side continues the
trace from it) and returns gRPC's own call object, ending the span when the
call ends. OpenTelemetry is imported only by whoever makes one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import grpc

# Calls never traced: periodic liveness traffic would bury the calls an operator looks for.
UNTRACED_METHODS = frozenset(
    {
        "/shardserve.v1.Coordinator/Heartbeat",
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
    }
)


class _CallDetails(grpc.ClientCallDetails):
    """A copy of a call's details with other metadata."""

    def __init__(
        self, details: grpc.ClientCallDetails, metadata: tuple[tuple[str, str], ...]
    ) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


class ClientSpans:
    """The CLIENT span of a call (named by its full method) and the metadata that carries its context on."""

    def __init__(
        self, tracer_provider: Any = None, untraced: Iterable[str] = UNTRACED_METHODS
    ) -> None:
        from opentelemetry import trace

        self._trace = trace
        self._tracer = trace.get_tracer("shardserve.grpc", tracer_provider=tracer_provider)
        self._untraced = frozenset(untraced)

    def start(self, full_method: str) -> tuple[Any, dict[str, str]] | None:
        """The span of a call to `full_method` begun, and the `traceparent` metadata to send; None for an untraced
        method."""
        if full_method in self._untraced:
            return None
        from opentelemetry.propagate import inject

        service, _, method = full_method.lstrip("/").partition("/")
        span = self._tracer.start_span(
            full_method,
            kind=self._trace.SpanKind.CLIENT,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method},
        )
        carrier: dict[str, str] = {}
        with self._trace.use_span(span, end_on_exit=False):
            inject(carrier)
        return span, carrier

    def failed(self, span: Any, err: BaseException) -> None:
        """End `span` of a call that could not start."""
        span.record_exception(err)
        span.end()

    def end(self, span: Any, code: grpc.StatusCode | None, details: str | None) -> None:
        """Record the call's status code on its span and end it."""
        from opentelemetry.trace import Status, StatusCode

        if code is not None:
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code != grpc.StatusCode.OK:
                span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}"))
        span.end()


class TraceContextInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """A CLIENT span per call (named by its full method), its context sent as `traceparent` metadata."""

    def __init__(
        self, tracer_provider: Any = None, untraced: Iterable[str] = UNTRACED_METHODS
    ) -> None:
        self._spans = ClientSpans(tracer_provider, untraced)

    def _call(
        self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, request: Any
    ) -> Any:
        started = self._spans.start(details.method)
        if started is None:
            return continuation(details, request)
        span, carrier = started
        try:
            call = continuation(
                _CallDetails(details, (*(details.metadata or ()), *carrier.items())), request
            )
        except BaseException as err:
            self._spans.failed(span, err)
            raise
        call.add_done_callback(lambda done: self._spans.end(span, done.code(), done.details()))
        return call

    def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, request: Any
    ) -> Any:
        return self._call(continuation, details, request)

    def intercept_unary_stream(
        self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, request: Any
    ) -> Any:
        return self._call(continuation, details, request)

    def intercept_stream_unary(
        self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, requests: Any
    ) -> Any:
        return self._call(continuation, details, requests)

    def intercept_stream_stream(
        self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, requests: Any
    ) -> Any:
        return self._call(continuation, details, requests)


class AioTraceContextInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """The same CLIENT span and `traceparent` for the unary calls of a grpc.aio channel (the coordinator's
    fan-outs to its ranks); the span ends when the call does."""

    def __init__(
        self, tracer_provider: Any = None, untraced: Iterable[str] = UNTRACED_METHODS
    ) -> None:
        self._spans = ClientSpans(tracer_provider, untraced)

    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        started = self._spans.start(method)
        if started is None:
            return await continuation(details, request)
        span, carrier = started
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *carrier.items())
        try:
            call = await continuation(details._replace(metadata=metadata), request)
        except BaseException as err:
            self._spans.failed(span, err)
            raise
        self._spans.end(span, await call.code(), await call.details())
        return call
