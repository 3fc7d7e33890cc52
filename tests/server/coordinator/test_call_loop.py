"""The coordinator's call loop (grpc.aio): calls to real loopback servers over mutual TLS carrying the cluster
secret, answers and failures by rank, a rank that registers at another address called there, a closed loop that
refuses calls, and the caller's trace continued on the loop thread, carried on and recorded as a CLIENT span."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.common.auth import Security, TlsFiles, server_credentials
from shardserve.server.common.principals import ClusterSecret
from shardserve.server.coordinator.ranks.call_loop import CallLoop

SERVICE = "shardserve.v1.ShardServer"
SECRET = "a-cluster-secret-of-the-test"
WAIT_S = 10.0


@dataclass
class Peer:
    """A loopback server answering PromoteMany with one checksum (RESOURCE_EXHAUSTED when `refuse`), recording
    each call's metadata."""

    address: str = ""
    refuse: bool = False
    metadata: list[dict[str, str]] = field(default_factory=list)


def _serve(peer: Peer, *, tls: TlsFiles | None) -> grpc.Server:
    def promote(request: pb.PromoteManyRequest, context: grpc.ServicerContext):  # type: ignore[no-untyped-def]
        peer.metadata.append(dict(context.invocation_metadata()))
        if peer.refuse:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "memory limit")
        return pb.PromoteManyResponse(
            checksums=[pb.ShardChecksum(name=v.name, version=v.version) for v in request.versions]
        )

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.unary_unary_rpc_method_handler(
        promote,
        request_deserializer=pb.PromoteManyRequest.FromString,
        response_serializer=pb.PromoteManyResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {"PromoteMany": handler}),)
    )
    if tls is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", server_credentials(tls))
    peer.address = f"127.0.0.1:{port}"
    server.start()
    return server


@pytest.fixture
def peers(tls_files: TlsFiles) -> Iterator[list[Peer]]:
    """Two mTLS servers (the test certificate is CA, server and client certificate at once)."""
    made = [Peer(), Peer()]
    servers = [_serve(peer, tls=tls_files) for peer in made]
    yield made
    for server in servers:
        server.stop(0)


def _request(name: str) -> pb.PromoteManyRequest:
    return pb.PromoteManyRequest(versions=[pb.PromoteVersionRequest(name=name, version=3)])


def _promote(loop: CallLoop, address: str) -> Any:
    """The outcome of PromoteMany of ("t", 3) at `address`, as rank 0."""
    return loop.call_all("PromoteMany", {0: (address, _request("t"))}, timeout=WAIT_S).wait(WAIT_S)[
        0
    ]


def test_calls_go_over_mtls_with_the_cluster_secret_and_fail_on_their_own_future(peers, tls_files):
    peers[1].refuse = True
    loop = CallLoop(Security(tls=tls_files, cluster=ClusterSecret(SECRET)))
    try:
        outcomes = loop.call_all(
            "PromoteMany",
            {0: (peers[0].address, _request("a")), 1: (peers[1].address, _request("b"))},
            timeout=WAIT_S,
        ).wait(WAIT_S)
        assert [c.name for c in outcomes[0].checksums] == ["a"]
        refused = outcomes[1]
        assert isinstance(refused, grpc.RpcError)
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.details() == "memory limit"
    finally:
        loop.close()
    for peer in peers:
        [metadata] = peer.metadata
        assert metadata["authorization"] == f"Cluster {SECRET}"


def test_a_rank_at_another_address_is_called_there(peers, tls_files):
    loop = CallLoop(Security(tls=tls_files))
    try:
        for peer in peers:  # rank 0 registered at one address, then (a new process) at the other
            assert _promote(loop, peer.address).checksums[0].name == "t"
    finally:
        loop.close()
    assert [len(peer.metadata) for peer in peers] == [1, 1]


def test_a_closed_loop_refuses_calls_and_its_thread_ends():
    loop = CallLoop()
    peer = Peer()
    server = _serve(peer, tls=None)
    try:
        assert _promote(loop, peer.address).checksums[0].name == "t"
        loop.close()
        assert not any(t.name == "rank-call-loop" for t in threading.enumerate())
        with pytest.raises(RuntimeError, match="closed"):
            loop.call_all("PromoteMany", {0: (peer.address, _request("t"))}, timeout=WAIT_S)
    finally:
        server.stop(0)


def test_an_unreachable_rank_fails_unavailable():
    loop = CallLoop()
    try:
        with socket_closed() as address:
            failed = _promote(loop, address)
        assert isinstance(failed, grpc.RpcError) and failed.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        loop.close()


@contextlib.contextmanager
def socket_closed() -> Iterator[str]:
    """A loopback address nothing listens on (a port bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    yield f"127.0.0.1:{port}"


def test_the_trace_context_is_carried_on_and_the_call_recorded():
    pytest.importorskip("opentelemetry.sdk.trace")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from shardserve.protos.trace_context import AioTraceContextInterceptor

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    peer = Peer()
    server = _serve(peer, tls=None)

    async def call(refuse: bool) -> None:
        peer.refuse = refuse
        interceptor = AioTraceContextInterceptor(provider)
        async with grpc.aio.insecure_channel(peer.address, interceptors=[interceptor]) as channel:
            method = channel.unary_unary(
                f"/{SERVICE}/PromoteMany",
                request_serializer=pb.PromoteManyRequest.SerializeToString,
                response_deserializer=pb.PromoteManyResponse.FromString,
            )
            with provider.get_tracer("test").start_as_current_span("caller"):
                try:
                    await method(_request("t"), timeout=WAIT_S)
                except grpc.aio.AioRpcError:
                    pass

    try:
        asyncio.run(call(False))
        asyncio.run(call(True))
    finally:
        server.stop(0)
    spans = [s for s in exporter.get_finished_spans() if s.name == f"/{SERVICE}/PromoteMany"]
    callers = [s for s in exporter.get_finished_spans() if s.name == "caller"]
    assert [s.attributes["rpc.grpc.status_code"] for s in spans] == [0, 8]
    assert [s.status.is_ok for s in spans] == [True, False]
    for span, caller, metadata in zip(spans, callers, peer.metadata):
        assert span.parent.span_id == caller.context.span_id
        assert (
            f"{span.context.trace_id:032x}-{span.context.span_id:016x}" in metadata["traceparent"]
        )


def test_a_fan_out_on_the_loop_continues_the_callers_trace(tmp_path):
    """With this process's tracing on, a call the loop makes for a caller inside a span is that span's child
    (the caller's context crosses to the loop thread), and its traceparent reaches the rank."""
    pytest.importorskip("opentelemetry.sdk.trace")
    import json

    from shardserve.server.common import tracing

    peer = Peer()
    server = _serve(peer, tls=None)
    assert tracing.enable_tracing(f"file:{tmp_path}", "call-loop-test")
    loop = CallLoop()
    try:
        with tracing.span("caller"):
            assert _promote(loop, peer.address).checksums[0].name == "t"
    finally:
        loop.close()
        tracing.disable_tracing()  # flushes the spans to the file
        server.stop(0)
    spans = {
        s["name"]: s
        for path in tmp_path.glob("*.jsonl")
        for s in map(json.loads, path.read_text().splitlines())
    }
    caller, call = spans["caller"], spans[f"/{SERVICE}/PromoteMany"]
    assert call["kind"] == "SpanKind.CLIENT"
    assert call["parent_id"] == caller["context"]["span_id"]
    assert call["context"]["trace_id"] == caller["context"]["trace_id"]
    [metadata] = peer.metadata
    trace_id, span_id = call["context"]["trace_id"][2:], call["context"]["span_id"][2:]
    assert metadata["traceparent"].startswith(f"00-{trace_id}-{span_id}-")
