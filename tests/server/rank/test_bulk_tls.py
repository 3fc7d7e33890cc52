"""The bulk port over TLS (server/rank/reads/bulk.py with an ssl context), in-process.

A real ShardStore and a real TLS listening port on 127.0.0.1 with the cluster's
self-signed certificate as server certificate, client certificate and CA
(mTLS): boxes and lookups bit for bit through the client's own TLS context, and
every connection without the right certificate refused before any byte of
data. The whole path through connect() is in tests/client/test_client_tls.py.
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Callable

import grpc
import pytest
import torch
from certificates import Certificates

import shardserve.server.rank.reads.bulk as bulk_reads
from shardserve.client.channel import Credentials
from shardserve.core.metadata import TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.bulk_wire import FRAME, HEADER, KIND_LOOKUP, KIND_READ
from shardserve.protos.chunk_codec import decode_lookup_reply
from shardserve.server.common.auth import TlsFiles, server_ssl_context
from shardserve.server.rank.reads.bulk import BulkReads
from shardserve.server.rank.shard_fill import InitFill
from shardserve.server.rank.store import ShardStore

TIMEOUT_S = 10.0
TLS_ALERT = b"\x15"  # the content type of a TLS alert record
ROWS, COLS = 3000, 512  # 6 MiB of float32: hundreds of TLS records
SOURCE = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(
    ROWS, COLS
)  # what INIT_ARANGE fills


@pytest.fixture(scope="module")
def rogue(certificates: Certificates) -> TlsFiles:
    """A certificate the cluster's CA did not sign."""
    return certificates.self_signed("rogue")


@pytest.fixture
def port(tls_files: TlsFiles):
    store = ShardStore(0)
    meta = ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata(
        (ROWS, COLS), TensorProperties(dtype=torch.float32)
    )
    store.allocate("t", 1, meta, fill=InitFill.ARANGE)
    store.promote("t", 1)
    reads = BulkReads(store, "127.0.0.1", tls=server_ssl_context(tls_files))
    yield reads
    reads.close()


def client_context(ca: str | None, cert: TlsFiles | None) -> ssl.SSLContext:
    """The client's own bulk-port TLS context (client.channel.Credentials.ssl_context)."""
    return Credentials(
        tls_ca=ca, tls_cert=cert.cert if cert else None, tls_key=cert.key if cert else None
    ).ssl_context()


def open_tls(reads: BulkReads, context: ssl.SSLContext) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", reads.port), timeout=TIMEOUT_S)
    sock = context.wrap_socket(raw, server_hostname="127.0.0.1")
    sock.sendall(reads.tickets.issue("ipv4:127.0.0.1:4242"))
    return sock


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        part = sock.recv(n - len(data))
        assert part, f"connection closed after {len(data)} of {n} bytes"
        data += part
    return bytes(data)


def ask(sock: socket.socket, message: bytes, kind: int = KIND_READ) -> tuple[int, bytes]:
    sock.sendall(FRAME.pack(kind, len(message)) + message)
    status, _, length = HEADER.unpack(recv_exactly(sock, HEADER.size))
    return status, recv_exactly(sock, length)


def read_request(offsets=(0, 0), sizes=(ROWS, COLS)) -> bytes:
    return pb.ReadRegionRequest(
        name="t", version=1, shard_index=0, offsets=offsets, sizes=sizes
    ).SerializeToString()


def refused(connect: Callable[[], socket.socket]) -> bool:
    """Whether the rank ends the connection `connect` opens (and sends its ticket on) without answering a read:
    a TLS alert or a plain close, at the handshake, the ticket or the first read (TLS 1.3 refuses a client's
    certificate after the client's side of the handshake is done)."""
    try:
        with connect() as sock:
            sock.sendall(FRAME.pack(KIND_READ, len(read_request())) + read_request())
            answer = sock.recv(HEADER.size)
            return (
                answer == b"" or answer[:1] == TLS_ALERT
            )  # a plaintext socket sees the alert's record
    except (ssl.SSLError, ConnectionError):
        return True


def test_boxes_and_lookups_bit_for_bit_over_mutual_tls(port, tls_files):
    with open_tls(port, client_context(tls_files.ca, tls_files)) as sock:
        assert sock.version() in ("TLSv1.2", "TLSv1.3")
        status, data = ask(sock, read_request())
        assert status == 0 and torch.equal(
            torch.frombuffer(bytearray(data), dtype=torch.float32).view(ROWS, COLS), SOURCE
        )
        status, data = ask(sock, read_request((7, 100), (5, 3)))
        assert status == 0 and torch.equal(
            torch.frombuffer(bytearray(data), dtype=torch.float32).view(5, 3), SOURCE[7:12, 100:103]
        )
        ids = torch.tensor([2999, 0, 17, 17], dtype=torch.int64)
        lookup = pb.LookupRequest(
            items=[pb.LookupItem(name="t", version=1, shard_index=0, ids=ids.numpy().tobytes())]
        )
        status, reply = ask(sock, lookup.SerializeToString(), KIND_LOOKUP)
        assert status == 0
        (chunk,) = decode_lookup_reply(reply)
        rows = torch.frombuffer(bytearray(chunk.data), dtype=torch.float32).view(-1, COLS)
        assert torch.equal(rows, SOURCE[ids])
        status, message = ask(
            sock,
            pb.ReadRegionRequest(
                name="missing", version=1, shard_index=0, offsets=(0, 0), sizes=(1, 1)
            ).SerializeToString(),
        )
        assert (
            grpc.StatusCode.NOT_FOUND.value[0] == status and b"missing" in message
        )  # the connection goes on
        assert ask(sock, read_request((0, 0), (1, 1)))[0] == 0


def test_session_says_the_port_speaks_tls(port):
    class Context:
        def peer(self) -> str:
            return "ipv4:127.0.0.1:4242"

    session = port.OpenBulkSession(pb.BulkSessionRequest(), Context())
    assert session.tls and session.port == port.port and len(session.ticket) == 16


def test_a_client_without_a_certificate_is_refused(port, tls_files):
    assert refused(lambda: open_tls(port, client_context(tls_files.ca, None)))


def test_a_certificate_the_ca_did_not_sign_is_refused(port, tls_files, rogue):
    assert refused(lambda: open_tls(port, client_context(tls_files.ca, rogue)))


def test_a_plaintext_client_is_refused(port, monkeypatch):
    # The ticket is random bytes: when they begin like a TLS record header with a plausible length, the rank's
    # TLS layer waits for the rest of that record and ends the connection only at TICKET_WAIT_S, which must
    # come well before this client's own TIMEOUT_S (else the two race); with a length too long, it answers an
    # alert before closing.
    monkeypatch.setattr(bulk_reads, "TICKET_WAIT_S", 0.5)

    def plaintext() -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port.port), timeout=TIMEOUT_S)
        sock.sendall(port.tickets.issue("ipv4:127.0.0.1:4242"))
        return sock

    assert refused(plaintext)


def test_the_client_refuses_a_rank_its_ca_did_not_sign(port, rogue):
    with pytest.raises(ssl.SSLCertVerificationError):
        open_tls(port, client_context(rogue.ca, rogue))


def test_a_peer_that_never_finishes_its_handshake_frees_its_slot(port, tls_files, monkeypatch):
    monkeypatch.setattr(bulk_reads, "TICKET_WAIT_S", 0.5)
    silent = socket.create_connection(
        ("127.0.0.1", port.port), timeout=TIMEOUT_S
    )  # connects, sends nothing
    try:
        ended = threading.Event()

        def wait_closed() -> None:
            try:
                if silent.recv(1) == b"":
                    ended.set()
            except ConnectionError:
                ended.set()

        waiter = threading.Thread(target=wait_closed, daemon=True)
        waiter.start()
        assert ended.wait(TIMEOUT_S), "the rank kept a connection that never started its handshake"
        with open_tls(
            port, client_context(tls_files.ca, tls_files)
        ) as sock:  # others are served meanwhile
            assert ask(sock, read_request((0, 0), (2, 2)))[0] == 0
    finally:
        silent.close()
