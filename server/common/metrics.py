"""Prometheus metrics both servers share: per-RPC counts, errors and latencies, and the /metrics HTTP endpoint.

Each server process builds one `ServerMetrics` over its own CollectorRegistry
(several coordinators may live in one test process), records every RPC through
`MetricsInterceptor` (one counter bump and one histogram observation per call,
never per message), and serves the registry on `--metrics-port` with
prometheus-client's HTTP server. Tensor-name labels go through `TensorLabels`,
which caps how many distinct names a process reports (the rest are `_other`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.common.access import replace_behavior

LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    120.0,
)
# Distinct tensor names a process labels its series with; later names count as OTHER_TENSOR.
MAX_TENSOR_LABELS = 64
OTHER_TENSOR = "_other"


class TensorLabels:
    """The label value of a tensor name: the name itself for the first `limit` names seen, OTHER_TENSOR after, so
    a client that creates millions of tensors cannot blow up the number of series."""

    def __init__(self, limit: int = MAX_TENSOR_LABELS) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self.limit = limit
        self._names: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, name: str) -> str:
        if name in self._names:
            return name
        with self._lock:
            if len(self._names) < self.limit:
                self._names.add(name)
                return name
        return OTHER_TENSOR


# The services each role serves: their methods' series exist at 0 from the start, so a dashboard's rate()
# sees the first error of a method too (a counter born at 1 has no earlier sample to differ from).
SERVICES = {"coordinator": "Coordinator", "rank": "ShardServer"}
# The codes whose per-method error series are made at start: the ones servers answer with.
ANSWERED_CODES = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.INTERNAL,
)
# Not errors of the server: the caller ended the call (a stream closed early, a cancel).
CALLER_ENDED = frozenset({grpc.StatusCode.OK, grpc.StatusCode.CANCELLED})


class ServerMetrics:
    """A process's registry and the RPC metrics every server records."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.registry = CollectorRegistry(auto_describe=True)
        self.tensor_label = TensorLabels()
        self.rpc_requests = Counter(
            "shardserve_rpc_requests",
            "gRPC calls handled, by method",
            ["method"],
            registry=self.registry,
        )
        self.rpc_errors = Counter(
            "shardserve_rpc_errors",
            "gRPC calls that ended with an error status (not OK, not CANCELLED by the caller), "
            "by method and status code",
            ["method", "code"],
            registry=self.registry,
        )
        self.rpc_failed = Counter(
            "shardserve_rpc_failed",
            "gRPC calls that ended with an error status (the sum of shardserve_rpc_errors over codes), "
            "by method",
            ["method"],
            registry=self.registry,
        )
        self.rpc_latency = Histogram(
            "shardserve_rpc_latency_seconds",
            "time from a call's start to its last answer message, by method",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        # method -> its (requests counter, latency histogram) children
        self._rpc_children: dict[str, tuple[Any, Any]] = {}
        self._start_at_zero(SERVICES.get(role))

    def _start_at_zero(self, service: str | None) -> None:
        """Make the request and error series of every method of `service` (a name in the proto), at 0."""
        if service is None:
            return
        for method in pb.DESCRIPTOR.services_by_name[service].methods_by_name:
            self.rpc_requests.labels(method)
            self.rpc_failed.labels(method)
            for code in ANSWERED_CODES:
                self.rpc_errors.labels(method, code.name)

    def add_collector(self, collector: Collector) -> None:
        """Register a collector whose values are read at scrape time (gauges of live state)."""
        self.registry.register(collector)

    def record_rpc(self, method: str, seconds: float, code: grpc.StatusCode | None) -> None:
        """One finished call of `method` (the short name) that took `seconds` and ended with `code`."""
        children = self._rpc_children.get(method)
        if (
            children is None
        ):  # labels() takes a lock and builds a key: once per method, not per call
            children = self._rpc_children[method] = (
                self.rpc_requests.labels(method),
                self.rpc_latency.labels(method),
            )
        children[0].inc()
        children[1].observe(seconds)
        if code is not None and code not in CALLER_ENDED:
            self.rpc_errors.labels(method, code.name).inc()
            self.rpc_failed.labels(method).inc()


class GaugeCollector(Collector):
    """A collector that builds its gauge families at scrape time from `read()`: (name, help, labels, samples)."""

    def __init__(self, read: Callable[[], list[Gauge]]) -> None:
        self._read = read

    def describe(self) -> Iterator[GaugeMetricFamily]:
        """Nothing: the registry would otherwise collect once to learn the names when the collector is
        registered, and reading the live state costs what a scrape does (a coordinator's whole catalog,
        seconds of its start-up at 100,000 versions)."""
        return iter(())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for gauge in self._read():
            family = GaugeMetricFamily(gauge.name, gauge.help, labels=list(gauge.labels))
            for values, value in gauge.samples or ():
                family.add_metric(list(values), value)
            yield family


@dataclass
class Gauge:
    """One gauge family read at scrape time: its samples are (label values, value)."""

    name: str
    help: str
    labels: tuple[str, ...] = ()
    samples: list[tuple[tuple[str, ...], float]] | None = None

    def __post_init__(self) -> None:
        if self.samples is None:
            self.samples = []

    def add(self, value: float, *labels: str) -> Gauge:
        assert self.samples is not None
        self.samples.append((labels, float(value)))
        return self


class MetricsInterceptor(grpc.ServerInterceptor):
    """Counts every call (health and reflection aside), its latency and its status code."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: grpc.HandlerCallDetails
    ) -> Any:
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith("/shardserve."):
            return handler
        return _timed(handler, method.rsplit("/", 1)[-1], self.metrics)


def _timed(
    handler: grpc.RpcMethodHandler, method: str, metrics: ServerMetrics
) -> grpc.RpcMethodHandler:
    """`handler` that records its call in `metrics` once it ended (a streamed answer: when its last message
    was produced)."""
    behavior = (
        handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    )

    if handler.response_streaming:

        def run_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            start, code = time.perf_counter(), grpc.StatusCode.UNKNOWN
            try:
                yield from behavior(request, context)
                code = _code_of(context)
            except GeneratorExit:  # the caller closed the stream before its end: not an error
                code = grpc.StatusCode.CANCELLED
                raise
            except Exception:
                code = _code_of(context, grpc.StatusCode.UNKNOWN)
                raise
            finally:
                metrics.record_rpc(method, time.perf_counter() - start, code)

        return replace_behavior(handler, run_stream)

    def run(request: Any, context: grpc.ServicerContext) -> Any:
        start, code = time.perf_counter(), grpc.StatusCode.UNKNOWN
        try:
            answer = behavior(request, context)
            code = _code_of(context)
            return answer
        except Exception:
            code = _code_of(context, grpc.StatusCode.UNKNOWN)
            raise
        finally:
            metrics.record_rpc(method, time.perf_counter() - start, code)

    return replace_behavior(handler, run)


def _code_of(
    context: grpc.ServicerContext, default: grpc.StatusCode = grpc.StatusCode.OK
) -> grpc.StatusCode:
    """The status the handler set (context.abort or set_code), else `default`."""
    code = context.code()
    if code is None:
        return default
    if isinstance(code, grpc.StatusCode):
        return code
    for status in grpc.StatusCode:  # some grpcio versions keep the raw (int, str) value
        if status.value == code or status.value[0] == code:
            return status
    return default


@dataclass
class MetricsEndpoint:
    """A running /metrics HTTP server."""

    host: str
    port: int
    _server: Any

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_metrics(metrics: ServerMetrics, host: str, port: int) -> MetricsEndpoint:
    """Serve `metrics` at http://HOST:PORT/metrics (port 0: any free port) on a daemon thread."""
    if not 0 <= port < 65536:
        raise ValueError(f"--metrics-port {port} is not a TCP port (0-65535)")
    server, _ = start_http_server(port, addr=host, registry=metrics.registry)
    return MetricsEndpoint(host, server.server_port, server)
