"""Whether a client traces its calls, and the interceptor that does it (docs/operations.md#tracing).

A library traces through the application's OpenTelemetry setup: spans go to
the tracer provider the application installed (or one it passes), and the
client installs none of its own. Each call's context travels to the
coordinator and the ranks in its metadata (protos.trace_context), so a
reshard's spans on every process share the caller's trace id.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import grpc

log = logging.getLogger(__name__)
TRACING_ENV = "SHARDSERVE_TRACING"  # the servers' exporter; any value but 0/off/false also turns client tracing on
_OFF = ("", "0", "off", "false", "no")


def tracing_wanted(tracing: Any) -> bool:
    """`tracing` as connect() got it: None reads $SHARDSERVE_TRACING; True/False; or a TracerProvider (on)."""
    if tracing is None:
        return os.environ.get(TRACING_ENV, "").strip().lower() not in _OFF
    return tracing is not False


def call_interceptor(tracing: Any) -> grpc.UnaryUnaryClientInterceptor | None:
    """The interceptor that traces every call of a client given `tracing` (connect()'s argument), or None when
    off. Without OpenTelemetry installed: ValueError naming `tracing` when asked for in the call, a warning
    (and no tracing) when only $SHARDSERVE_TRACING asked."""
    if not tracing_wanted(tracing):
        return None
    if tracing is not None and not isinstance(tracing, bool) and not hasattr(tracing, "get_tracer"):
        raise ValueError(
            f"tracing must be None, a bool or an OpenTelemetry TracerProvider, got "
            f"{type(tracing).__name__}"
        )
    try:
        from shardserve.protos.trace_context import TraceContextInterceptor

        return TraceContextInterceptor(
            None if isinstance(tracing, bool) or tracing is None else tracing
        )
    except ImportError as err:
        if tracing is None:
            log.warning(
                "$%s is set but OpenTelemetry is not installed: calls are not traced (%s)",
                TRACING_ENV,
                err,
            )
            return None
        raise ValueError(
            f"tracing needs opentelemetry-api: pip install 'shardserve[tracing]' ({err})"
        ) from None
