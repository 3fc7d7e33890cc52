"""Optional OpenTelemetry tracing of a server process's RPCs (`--tracing EXPORTER`; docs/operations.md#tracing).

Off by default, and then nothing is imported or installed: no interceptor,
no tracer provider, channels as they were. `enable_tracing` gives this
process its own tracer provider (never the global one, which belongs to
whoever embeds the coordinator) exporting to OTLP, the console or a folder
of JSON-lines files. Servers continue the trace of each call through the
standard OpenTelemetry gRPC server interceptor; calls this process makes
carry it on (protos.trace_context). Work handed to other threads keeps the
caller's trace through `carry_context`.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc

from shardserve.protos.trace_context import UNTRACED_METHODS

log = logging.getLogger(__name__)

TRACING_ENV = "SHARDSERVE_TRACING"
EXPORTERS = ("otlp", "console", "file:DIR")
FILE_FLUSH_MS = 200  # --tracing file:DIR writes spans in batches at least this often
T = TypeVar("T")

_provider: Any = None  # this process's TracerProvider while tracing is on, else None


def add_tracing_args(parser: argparse.ArgumentParser) -> None:
    """--tracing (docs/operations.md#tracing)."""
    parser.add_argument(
        "--tracing",
        default=os.environ.get(TRACING_ENV) or None,
        metavar="EXPORTER",
        help="trace RPCs with OpenTelemetry and export the spans: otlp (OTEL_EXPORTER_OTLP_* "
        "settings; needs the `tracing` extra), console (JSON on stderr) or file:DIR (JSON lines "
        f"in DIR/SERVICE-PID.jsonl); default: ${TRACING_ENV}, else off",
    )


def check_exporter(exporter: str) -> str:
    """`exporter` if it is one of EXPORTERS, else ValueError naming --tracing."""
    if exporter in ("otlp", "console") or (exporter.startswith("file:") and exporter[5:]):
        return exporter
    raise ValueError(f"--tracing {exporter!r} is not one of {', '.join(EXPORTERS)}")


def enable_tracing(exporter: str, service: str, attributes: dict[str, Any] | None = None) -> bool:
    """Trace this process's RPCs as `service` (unless OTEL_SERVICE_NAME names it), exporting to `exporter`.

    False (and a log line) when OTEL_SDK_DISABLED is true; ValueError naming --tracing for an unknown
    exporter or a missing package. Idempotent: the first call's provider stays.
    """
    global _provider
    check_exporter(exporter)
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        log.info("--tracing %s ignored: OTEL_SDK_DISABLED is true", exporter)
        return False
    if _provider is not None:
        return True
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
    except ImportError as err:
        raise ValueError(
            f"--tracing needs OpenTelemetry: pip install 'shardserve[tracing]' ({err})"
        ) from None
    named = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service}
    provider = TracerProvider(resource=Resource.create({**named, **(attributes or {})}))
    provider.add_span_processor(_span_processor(exporter, service))
    _provider = provider
    log.info(
        "tracing RPCs as %s, exporting to %s",
        named.get("service.name", os.environ.get("OTEL_SERVICE_NAME")),
        exporter,
    )
    return True


def _span_processor(exporter: str, service: str) -> Any:
    """Batches to OTLP and to a file (written within FILE_FLUSH_MS of a span's end, off the calls' threads);
    writes each span to the console as it ends."""
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
    )

    if exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as err:
            raise ValueError(
                f"--tracing otlp needs opentelemetry-exporter-otlp-proto-http: pip install "
                f"'shardserve[tracing]' ({err})"
            ) from None
        return BatchSpanProcessor(OTLPSpanExporter())
    if exporter == "console":
        return SimpleSpanProcessor(
            ConsoleSpanExporter(out=sys.stderr, formatter=_one_line)
        )  # stdout: the address
    folder = Path(exporter[len("file:") :])
    try:
        folder.mkdir(parents=True, exist_ok=True)
        out = open(
            folder / f"{service}-{os.getpid()}.jsonl", "a", buffering=1
        )  # closed at process exit
    except OSError as err:
        raise ValueError(f"--tracing {exporter}: cannot write there: {err}") from None
    return BatchSpanProcessor(
        ConsoleSpanExporter(out=out, formatter=_one_line), schedule_delay_millis=FILE_FLUSH_MS
    )


def _one_line(finished: Any) -> str:
    """A finished span as one line of JSON (OpenTelemetry's own JSON form)."""
    return finished.to_json(indent=None) + "\n"


def disable_tracing() -> None:
    """Flush and drop this process's provider: later servers and channels are untraced (an embedded coordinator
    that stopped)."""
    global _provider
    provider, _provider = _provider, None
    if provider is not None:
        provider.shutdown()


def tracing_enabled() -> bool:
    return _provider is not None


def server_interceptors() -> list[grpc.ServerInterceptor]:
    """The standard OpenTelemetry server interceptor while tracing is on (continuing each caller's trace), else
    none."""
    if _provider is None:
        return []
    from opentelemetry.instrumentation.grpc import filters, server_interceptor

    untraced = [filters.full_method_name(m) for m in UNTRACED_METHODS]
    return [
        server_interceptor(
            tracer_provider=_provider, filter_=filters.negate(filters.any_of(*untraced))
        )
    ]


def traced_channel(channel: grpc.Channel) -> grpc.Channel:
    """`channel` whose calls carry this process's trace on while tracing is on; `channel` itself otherwise."""
    if _provider is None:
        return channel
    from shardserve.protos.trace_context import TraceContextInterceptor

    return grpc.intercept_channel(channel, TraceContextInterceptor(_provider))


def aio_interceptors() -> list[Any]:
    """The client interceptor of a grpc.aio channel that carries this process's trace on while tracing is on;
    none otherwise."""
    if _provider is None:
        return []
    from shardserve.protos.trace_context import AioTraceContextInterceptor

    return [AioTraceContextInterceptor(_provider)]


def carry_context(fn: Callable[..., T]) -> Callable[..., T]:
    """`fn` run, on whatever thread, in the context current now (its trace): for work handed to a pool or thread.
    Each returned callable may run once at a time."""
    context = contextvars.copy_context()
    return lambda *args, **kwargs: context.run(fn, *args, **kwargs)


@contextlib.contextmanager
def span(name: str, attributes: dict[str, Any] | None = None) -> Iterator[None]:
    """An INTERNAL span around a block (a collective job's run) while tracing is on; nothing otherwise."""
    if _provider is None:
        yield
        return
    tracer = _provider.get_tracer("shardserve")
    with tracer.start_as_current_span(name, attributes=attributes or {}):
        yield
