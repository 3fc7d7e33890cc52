"""What a server requires and presents: client principals, the cluster credential, TLS files; its channels.

Client calls carry ("authorization", "Bearer <token>") and are checked against
the principals (server/common/access.py); the calls coordinator and ranks make
to each other carry ("authorization", "Cluster <secret>"), or, in an mTLS
cluster with a cluster certificate name, their certificate alone. TLS and mTLS
come from PEM files: a server given a CA requires client certificates signed by it.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from shardserve.core.channel_options import MESSAGE_OPTIONS, RECONNECT_OPTIONS
from shardserve.server.common.access import CLUSTER_SCHEME, AccessPolicy
from shardserve.server.common.principals import ClusterCertificate, ClusterSecret, PrincipalBook
from shardserve.server.common.tracing import aio_interceptors, traced_channel

log = logging.getLogger(__name__)


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
    """What a server requires and what its outgoing calls present.

    `principals`: the client principals (None: no client auth); `cluster`: the internal secret its calls to
    peers present and its control RPCs require; `cluster_cert`: the name that marks the cluster's mTLS
    certificates, accepted as the internal credential too (and, without a secret, the only one: calls to peers
    then carry no authorization, the TLS channel presents our certificate); `token`: the single admin token of
    --token, presented on calls to peers only where no cluster credential is configured (in-process setups)."""

    token: str | None = None
    tls: TlsFiles | None = None
    principals: PrincipalBook | None = None
    cluster: ClusterSecret | None = None
    cluster_cert: ClusterCertificate | None = None

    def __post_init__(self) -> None:
        if self.principals is None and self.token:
            object.__setattr__(self, "principals", PrincipalBook(admin_token=self.token))
        if self.cluster_cert is not None:
            check_cluster_certificate(self.tls, self.cluster_cert)

    @property
    def has_cluster_credential(self) -> bool:
        return self.cluster is not None or self.cluster_cert is not None

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        if self.cluster is not None:
            return (("authorization", f"{CLUSTER_SCHEME}{self.cluster.secret}"),)
        if self.cluster_cert is not None:
            return ()
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def access_policy(self) -> AccessPolicy:
        return AccessPolicy(self.principals, self.cluster, self.cluster_cert)


def check_cluster_certificate(tls: TlsFiles | None, cluster_cert: ClusterCertificate) -> None:
    """ValueError naming the flag unless mTLS is on and our own certificate carries the cluster's name (else our
    calls to peers would not count as the cluster's)."""
    if tls is None or tls.ca is None:
        raise ValueError("--cluster-cert-name needs mutual TLS: --tls-cert, --tls-key and --tls-ca")
    names = certificate_names(tls.cert)
    if cluster_cert.name not in names:
        raise ValueError(
            f"--cluster-cert-name {cluster_cert.name!r} is not a name of --tls-cert {tls.cert!r} "
            f"(its CN and subjectAltNames: {', '.join(sorted(names)) or 'none'})"
        )


def certificate_names(path: str) -> set[str]:
    """The subject CN and subjectAltName values of the (first) certificate in the PEM file `path`, as gRPC's
    auth context shows a peer's. The standard library decodes a certificate only through ssl's test helper."""
    try:
        decoded = ssl._ssl._test_decode_cert(path)  # type: ignore[attr-defined]
    except ssl.SSLError as err:
        raise ValueError(f"--tls-cert {path!r}: not a PEM certificate: {err}") from None
    names = {
        value for rdn in decoded.get("subject", ()) for key, value in rdn if key == "commonName"
    }
    return names | {value for _kind, value in decoded.get("subjectAltName", ())}


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """TLS server credentials; with a CA, client certificates are required (mTLS)."""
    return grpc.ssl_server_credentials(
        [(tls.read("key"), tls.read("cert"))],
        root_certificates=tls.read("ca"),
        require_client_auth=tls.ca is not None,
    )


def server_ssl_context(tls: TlsFiles) -> ssl.SSLContext:
    """The bulk port's TLS context from the same files as gRPC's: TLS 1.2+, and with a CA, client certificates
    signed by it are required (mTLS), as server_credentials does."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=tls.ca)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(tls.cert, tls.key)
    context.verify_mode = ssl.CERT_REQUIRED if tls.ca is not None else ssl.CERT_NONE
    return context


def channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    """TLS credentials for calls to peers: trust the CA (or our own cert), present ours for mTLS."""
    return grpc.ssl_channel_credentials(
        root_certificates=tls.read("ca") or tls.read("cert"),
        private_key=tls.read("key"),
        certificate_chain=tls.read("cert"),
    )


class _TokenCallInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the bearer token to every outgoing call."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(details, self._metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, base: grpc.ClientCallDetails, extra: tuple[tuple[str, str], ...]) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = tuple(base.metadata or ()) + extra
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


def make_channel(
    address: str, security: Security = Security(), *, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A channel to a peer that presents this process's token and TLS credentials (and, while tracing is on,
    carries this process's trace on); `options`: gRPC channel options beside the message limits and the
    reconnect backoff every channel has (shardcore.channel_options)."""
    every = [*MESSAGE_OPTIONS, *RECONNECT_OPTIONS, *options]
    if security.tls is not None:
        channel = grpc.secure_channel(address, channel_credentials(security.tls), options=every)
    else:
        channel = grpc.insecure_channel(address, options=every)
    if security.call_metadata():
        channel = grpc.intercept_channel(channel, _TokenCallInterceptor(security.call_metadata()))
    return traced_channel(channel)


def make_aio_channel(address: str, security: Security = Security()) -> grpc.aio.Channel:
    """A grpc.aio channel to a peer, made on the running loop, with the TLS credentials, options and (while
    tracing is on) trace context of make_channel's; its calls pass `security.call_metadata()` themselves (an aio
    interceptor would cost every call a coroutine more)."""
    every = [*MESSAGE_OPTIONS, *RECONNECT_OPTIONS]
    if security.tls is not None:
        return grpc.aio.secure_channel(
            address,
            channel_credentials(security.tls),
            options=every,
            interceptors=aio_interceptors(),
        )
    return grpc.aio.insecure_channel(address, options=every, interceptors=aio_interceptors())
