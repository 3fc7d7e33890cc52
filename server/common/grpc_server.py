"""Starting a gRPC server the way both servers need it: thread pool, auth, TLS, health, reflection."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shardserve.core.channel_options import MESSAGE_OPTIONS
from shardserve.server.common.access import AccessInterceptor
from shardserve.server.common.auth import Security, server_credentials
from shardserve.server.common.metrics import MetricsInterceptor, ServerMetrics
from shardserve.server.common.request_decoding import RequestDecodingInterceptor
from shardserve.server.common.stream_limits import StreamLimits, StreamLimitSettings
from shardserve.server.common.tracing import server_interceptors

log = logging.getLogger(__name__)


@dataclass
class RunningServer:
    """A started gRPC server, the port it bound and its health servicer."""

    server: grpc.Server
    host: str
    port: int
    health: health.HealthServicer
    services: tuple[str, ...]
    limits: StreamLimits

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, grace: float = 2.0) -> None:
        """Mark every service NOT_SERVING, then stop, letting calls in flight finish within `grace`."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait(grace + 1.0)
        self.limits.close()


def split_address(listen: str) -> tuple[str, int]:
    """("host", port) from "host:port" (IPv6 hosts in brackets); ValueError names `listen`."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"listen address {listen!r} is not HOST:PORT")
    return host, int(port)


def start_server(
    listen: str,
    security: Security,
    add_servicers: Callable[[grpc.Server], list[str]],
    limits: StreamLimitSettings = StreamLimitSettings(),
    metrics: ServerMetrics | None = None,
) -> RunningServer:
    """Serve the services `add_servicers` registers (it returns their full names) plus health and reflection,
    on `limits.workers` threads, checking every call's access and the stream limits; with `metrics`, every
    call's count, status and latency are recorded there too; while tracing is on (server.common.tracing), every
    call continues its caller's trace."""
    host, _ = split_address(listen)
    stream_limits = StreamLimits(limits)
    interceptors = [
        AccessInterceptor(security.access_policy(), stream_limits.wrap),
        RequestDecodingInterceptor(),
    ]
    if metrics is not None:
        interceptors.insert(
            0, MetricsInterceptor(metrics)
        )  # outermost: refused calls are counted too
    interceptors = [*server_interceptors(), *interceptors]  # refused calls are traced too
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=limits.workers, thread_name_prefix="grpc"),
        interceptors=interceptors,
        options=[*MESSAGE_OPTIONS, ("grpc.so_reuseport", 0)],
    )  # a port in use is an error
    names = tuple(add_servicers(server))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        names + (health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    if security.tls is not None:
        port = server.add_secure_port(listen, server_credentials(security.tls))
    else:
        port = server.add_insecure_port(
            listen
        )  # grpcio raises RuntimeError itself when it cannot bind
    server.start()
    for name in ("",) + names:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "serving %s on %s:%d%s%s%s",
        ", ".join(names),
        host,
        port,
        " with TLS" if security.tls else "",
        f" for {security.principals.size} principals"
        if security.principals
        else " without client auth",
        " and the cluster credential" if security.has_cluster_credential else "",
    )
    return RunningServer(server, host, port, health_servicer, names, stream_limits)
