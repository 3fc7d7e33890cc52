"""Bearer-token auth and TLS credentials for servers and for the server-to-server channels.

With a token every call on every service but grpc.health.v1.Health must carry
("authorization", "Bearer <token>"); a server interceptor answers
UNAUTHENTICATED otherwise. TLS and mTLS come from PEM files: a server given a
CA requires client certificates signed by it.
"""
from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import grpc

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: this process's certificate and key, and the CA that signs peers (mTLS when set)."""

    cert: str
    key: str
    ca: str | None = None

    def __post_init__(self) -> None:
        for field in ("cert", "key", "ca"):
            path = getattr(self, field)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"tls {field} file {path!r} does not exist")

    def read(self, field: str) -> bytes | None:
        path = getattr(self, field)
        return Path(path).read_bytes() if path else None


@dataclass(frozen=True)
class Security:
    """What a server requires and what its outgoing calls present: a token and/or TLS files."""

    token: str | None = None
    tls: TlsFiles | None = None

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """TLS server credentials; with a CA, client certificates are required (mTLS)."""
    return grpc.ssl_server_credentials(
        [(tls.read("key"), tls.read("cert"))], root_certificates=tls.read("ca"),
        require_client_auth=tls.ca is not None)


def channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    """TLS credentials for calls to peers: trust the CA (or our own cert), present ours for mTLS."""
    return grpc.ssl_channel_credentials(
        root_certificates=tls.read("ca") or tls.read("cert"),
        private_key=tls.read("key"), certificate_chain=tls.read("cert"))


class _TokenCallInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                            grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the bearer token to every outgoing call."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(details, self._metadata)

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), request_iterator)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, base: grpc.ClientCallDetails, extra: tuple[tuple[str, str], ...]) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = tuple(base.metadata or ()) + extra
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


def make_channel(address: str, security: Security = Security()) -> grpc.Channel:
    """A channel to a peer that presents this process's token and TLS credentials."""
    if security.tls is not None:
        channel = grpc.secure_channel(address, channel_credentials(security.tls), options=CHANNEL_OPTIONS)
    else:
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    if security.token:
        channel = grpc.intercept_channel(channel, _TokenCallInterceptor(security.call_metadata()))
    return channel


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Rejects calls without ("authorization", "Bearer <token>") on every service but health."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("token must not be empty")
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation: Callable[[Any], Any],
                          handler_call_details: grpc.HandlerCallDetails) -> Any:
        method = handler_call_details.method
        if method.startswith(HEALTH_PREFIX):
            return continuation(handler_call_details)
        presented = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if isinstance(presented, str):
            presented = presented.encode()
        if hmac.compare_digest(presented, self._expected):
            return continuation(handler_call_details)
        reason = "missing" if not presented else "wrong"
        log.warning("rejected %s: %s bearer token", method, reason)
        return _denying_handler(continuation(handler_call_details), f"{reason} bearer token in the "
                                f"'authorization' metadata")


def _denying_handler(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED."""
    def deny(request: Any, context: grpc.ServicerContext) -> None:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler is None:
        return grpc.unary_unary_rpc_method_handler(deny)
    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny, **kwargs)
