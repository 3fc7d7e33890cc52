"""The bulk TCP port (server/rank/reads/bulk.py): tickets and the port's protocol, in-process.

A real ShardStore and a real listening port on 127.0.0.1, spoken to with plain
sockets: boxes and lookups bit for bit, request errors that keep the
connection, refused tickets, malformed frames, the connection cap and close(). The client's use of
the port (path choice, fallback, reads during reshards) is in
tests/client/test_data_paths.py; token and TLS in tests/server/test_server_security.py and
tests/client/test_client_tls.py.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import grpc
import pytest
import torch
from fake_clock import FakeClock
from google.rpc import status_pb2
from server_helpers import recv_exactly

import shardserve.server.rank.reads.bulk as bulk_reads
from shardserve.core.metadata import TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.protos import bulk_wire
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.bulk_wire import (
    HEADER,
    KIND_LOOKUP,
    KIND_READ,
    KIND_READS,
    STATUS_BODY,
    send_parts,
)
from shardserve.protos.chunk_codec import decode_lookup_reply
from shardserve.protos.errors import detail_of_status
from shardserve.server.rank.error_status import error_status
from shardserve.server.rank.errors import RankError
from shardserve.server.rank.reads.bulk import BulkReads, Tickets, peer_ip
from shardserve.server.rank.shard_fill import InitFill
from shardserve.server.rank.store import ShardStore

TIMEOUT_S = 10.0
SOURCE = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)  # what INIT_ARANGE fills


@pytest.fixture
def port():
    store = ShardStore(0)
    meta = ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata(
        (6, 4), TensorProperties(dtype=torch.float32)
    )
    store.allocate("t", 1, meta, fill=InitFill.ARANGE)
    store.promote("t", 1)
    reads = BulkReads(store, "127.0.0.1")
    yield reads
    reads.close()


def open_connection(reads: BulkReads, ticket: bytes | None = None) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", reads.port), timeout=TIMEOUT_S)
    sock.sendall(reads.tickets.issue("ipv4:127.0.0.1:4242") if ticket is None else ticket)
    return sock


def answer(sock: socket.socket) -> tuple[int, bytes]:
    """An answer's status and body: for an error, the message of the google.rpc.Status that follows, which
    must carry a shardserve ErrorInfo."""
    status, body_kind, length = HEADER.unpack(recv_exactly(sock, HEADER.size))
    body = recv_exactly(sock, length)
    if status == 0:
        assert body_kind == 0
        return status, body
    assert body_kind == STATUS_BODY
    error = status_pb2.Status.FromString(body)
    assert error.code == status and detail_of_status(error).reason is not None
    return status, error.message.encode()


def ask(sock: socket.socket, frame: bytes, kind: int = KIND_READ) -> tuple[int, bytes]:
    sock.sendall(struct.pack("<II", kind, len(frame)) + frame)
    return answer(sock)


def request(name: str = "t", version: int = 1, offsets=(0, 0), sizes=(6, 4)) -> bytes:
    return pb.ReadRegionRequest(
        name=name, version=version, shard_index=0, offsets=offsets, sizes=sizes
    ).SerializeToString()


def closed(sock: socket.socket) -> bool:
    return sock.recv(1) == b""


def code(status: int) -> grpc.StatusCode:
    return next(c for c in grpc.StatusCode if c.value[0] == status)


def test_boxes_bit_for_bit_on_one_kept_connection(port):
    with open_connection(port) as sock:
        for offsets, sizes in (
            ((0, 0), (6, 4)),
            ((2, 1), (3, 2)),
            ((5, 3), (1, 1)),
            ((0, 0), (0, 4)),
        ):
            status, body = ask(sock, request(offsets=offsets, sizes=sizes))
            expected = SOURCE[
                offsets[0] : offsets[0] + sizes[0], offsets[1] : offsets[1] + sizes[1]
            ]
            assert status == 0
            assert torch.equal(
                torch.frombuffer(bytearray(body), dtype=torch.float32).reshape(sizes)
                if body
                else torch.empty(sizes),
                expected,
            )


def test_lookups_bit_for_bit(port):
    ids = torch.tensor([5, 0, 3, 3])
    lookup = pb.LookupRequest(
        items=[pb.LookupItem(name="t", version=1, shard_index=0, ids=ids.numpy().tobytes())]
    )
    with open_connection(port) as sock:
        status, body = ask(sock, lookup.SerializeToString(), KIND_LOOKUP)
        assert status == 0
        (chunk,) = decode_lookup_reply(body)
        assert chunk.version == 1 and chunk.offset == 0 and chunk.nbytes == 4 * 4 * 4
        assert torch.equal(
            torch.frombuffer(bytearray(chunk.data), dtype=torch.float32).view(4, 4), SOURCE[ids]
        )
        bad = pb.LookupRequest(
            items=[pb.LookupItem(name="t", version=1, shard_index=0, ids=b"\1\2\3")]
        )
        status, message = ask(sock, bad.SerializeToString(), KIND_LOOKUP)
        assert code(status) == grpc.StatusCode.INVALID_ARGUMENT and b"items[0].ids" in message
        assert ask(sock, request())[0] == 0


@pytest.mark.parametrize(
    "frame,expected,field",
    [
        (request(name="nope"), grpc.StatusCode.NOT_FOUND, "nope"),
        (request(version=7), grpc.StatusCode.FAILED_PRECONDITION, "version"),
        (request(offsets=(4, 0), sizes=(3, 4)), grpc.StatusCode.INVALID_ARGUMENT, "sizes"),
        (request(name=""), grpc.StatusCode.INVALID_ARGUMENT, "name"),
        (
            pb.ReadRegionRequest(
                name="t", version=1, shard_index=5, offsets=(0, 0), sizes=(1, 1)
            ).SerializeToString(),
            grpc.StatusCode.INVALID_ARGUMENT,
            "shard_index",
        ),
    ],
)
def test_request_errors_are_answered_and_keep_the_connection(port, frame, expected, field):
    with open_connection(port) as sock:
        status, message = ask(sock, frame)
        assert code(status) == expected and field in message.decode()
        status, body = ask(sock, request())
        assert status == 0 and torch.equal(
            torch.frombuffer(bytearray(body), dtype=torch.float32), SOURCE.flatten()
        )


def test_unknown_used_and_foreign_tickets_are_refused(port):
    ticket = port.tickets.issue("ipv4:127.0.0.1:1")
    for bad in (b"\0" * 16, None):
        with open_connection(port, bad) as sock:  # None: a fresh ticket, used once here ...
            if bad is None:
                assert ask(sock, request())[0] == 0
                continue
            status, message = answer(sock)
            assert code(status) == grpc.StatusCode.PERMISSION_DENIED and b"ticket" in message
            assert closed(sock)
    with open_connection(port, ticket) as sock:
        assert ask(sock, request())[0] == 0
    with open_connection(port, ticket) as sock:  # ... and refused the second time
        assert code(answer(sock)[0]) == grpc.StatusCode.PERMISSION_DENIED
    with open_connection(
        port, port.tickets.issue("ipv4:10.0.0.1:1")
    ) as sock:  # asked for from another host
        status, message = answer(sock)
        assert (
            code(status) == grpc.StatusCode.PERMISSION_DENIED and b"issued to 10.0.0.1" in message
        )


@pytest.mark.parametrize(
    "frame,field",
    [
        (struct.pack("<II", KIND_READ, 1 << 30), b"over the bulk port's 8388608-byte limit"),
        (struct.pack("<II", 9, 0), b"kind 9 is none of 1 (read), 2 (lookup), 3 (write), 4 (reads)"),
    ],
)
def test_frames_out_of_step_are_refused_and_close_the_connection(port, frame, field):
    with open_connection(port) as sock:
        sock.sendall(frame)
        status, message = answer(sock)
        assert code(status) == grpc.StatusCode.INVALID_ARGUMENT and field in message
        assert closed(sock)
    with open_connection(port) as sock:  # still serving
        assert ask(sock, request())[0] == 0


@pytest.mark.parametrize(
    "kind,name",
    [
        (KIND_READ, b"ReadRegionRequest"),
        (KIND_LOOKUP, b"LookupRequest"),
        (KIND_READS, b"ReadRegionsRequest"),
    ],
)
def test_undecodable_requests_are_refused_and_keep_the_connection(port, kind, name):
    with open_connection(port) as sock:
        status, message = ask(sock, b"\x0a\xff\xff\xff\xff\x0f", kind)  # a field claiming 4 GiB
        assert (
            code(status) == grpc.StatusCode.INVALID_ARGUMENT
            and b"not a serialized " + name in message
        )
        assert ask(sock, request())[0] == 0


def test_a_peer_that_goes_silent_mid_ticket_does_not_block_others(port):
    with socket.create_connection(("127.0.0.1", port.port), timeout=TIMEOUT_S) as silent:
        silent.sendall(b"\1\2\3")
        with open_connection(port) as sock:
            assert ask(sock, request())[0] == 0


def test_a_peer_that_trickles_its_ticket_or_frame_is_cut_off(port, monkeypatch):
    """A connection holds one of MAX_CONNECTIONS slots: its ticket, and each request frame once begun, must arrive
    whole within a deadline, not merely one byte per idle timeout."""
    monkeypatch.setattr(bulk_reads, "TICKET_WAIT_S", 0.5)
    monkeypatch.setattr(bulk_reads, "FRAME_WAIT_S", 0.5)
    with socket.create_connection(("127.0.0.1", port.port), timeout=TIMEOUT_S) as slow:
        start = time.monotonic()
        for (
            byte
        ) in b"\1\2\3":  # a byte every 0.2 s: each recv would see data before a per-recv timeout
            slow.sendall(bytes([byte]))
            time.sleep(0.2)
        assert closed(slow) and time.monotonic() - start < 5.0
    with open_connection(port) as sock:
        sock.sendall(struct.pack("<II", KIND_READ, 100) + b"\0" * 10)  # a frame begun, then silence
        assert closed(sock)


def test_connections_over_the_cap_are_unavailable(monkeypatch):
    monkeypatch.setattr(bulk_reads, "MAX_CONNECTIONS", 1)
    reads = BulkReads(ShardStore(0), "127.0.0.1")
    try:
        with open_connection(reads) as first, open_connection(reads) as second:
            status, message = answer(second)
            assert code(status) == grpc.StatusCode.UNAVAILABLE and b"1 bulk connections" in message
            assert (
                code(ask(first, request())[0]) == grpc.StatusCode.NOT_FOUND
            )  # the first one still answers
    finally:
        reads.close()


def test_close_breaks_off_open_connections_and_waits_for_their_threads(port):
    sock = open_connection(port)
    assert ask(sock, request())[0] == 0
    start = time.monotonic()
    port.close()
    assert time.monotonic() - start < 5.0
    assert closed(sock)
    assert port.serving_threads == 0
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port.bound_port), timeout=TIMEOUT_S)
    sock.close()


def test_tickets_expire_and_are_bounded():
    clock = FakeClock()
    tickets = Tickets(ttl_s=0.05, capacity=2, clock=clock)
    first = tickets.issue("ipv4:127.0.0.1:1")
    tickets.issue("ipv4:127.0.0.1:1")
    with pytest.raises(RankError) as err:
        tickets.issue("ipv4:127.0.0.1:1")
    assert error_status(err.value).code == grpc.StatusCode.RESOURCE_EXHAUSTED
    clock.advance(0.05)
    with pytest.raises(RankError, match="expired") as err:
        tickets.redeem(first, "127.0.0.1")
    assert error_status(err.value).code == grpc.StatusCode.PERMISSION_DENIED
    tickets.issue("ipv4:127.0.0.1:1")  # the expired ones made room


@pytest.mark.parametrize(
    "peer,expected",
    [
        ("ipv4:127.0.0.1:5000", "127.0.0.1"),
        ("ipv6:[::1]:5000", "::1"),
        ("ipv6:%5B::1%5D:44134", "::1"),
        ("ipv6:%5Bfe80::1%25eth0%5D:5", "fe80::1%eth0"),
        ("::ffff:10.1.2.3", "10.1.2.3"),
        ("10.0.0.7", "10.0.0.7"),
        ("unix:/tmp/sock", None),
        ("", None),
    ],
)
def test_peer_ip(peer, expected):
    ip = peer_ip(peer)
    assert (str(ip) if ip is not None else None) == expected


def test_send_parts_sends_every_byte_in_order_through_partial_sends():
    """Parts (bytes, memoryviews of tensors, empty ones) arrive joined, also when sendmsg sends them in pieces
    (a small send buffer and a slow reader)."""
    data = torch.randint(
        0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)
    )
    parts = [b"head", b"", memoryview(data.numpy()), memoryview(b"tail")[1:]]
    expected = b"".join(bytes(part) for part in parts)
    sender, receiver = socket.socketpair()
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)
    sender.settimeout(30)
    got = bytearray(len(expected))
    reader = threading.Thread(
        target=bulk_wire.recv_exactly, args=(receiver, memoryview(got), time.monotonic() + 30)
    )
    reader.start()
    try:
        send_parts(sender, parts)
    finally:
        reader.join(timeout=30)
        sender.close()
        receiver.close()
    assert not reader.is_alive(), "the reader hung"
    assert bytes(got) == expected
