"""The cross-host bulk path: boxes' bytes over plain TCP connections, each opened by a ticket.

The port also takes writes: a WriteShardsRequest frame followed by its shards'
bytes (server/rank/writes/bulk.py), allowed when the principal the ticket was
issued to may write those tensors.

Python gRPC moves about 1.1-1.4 GB/s on the 2-core host; `sendall` from the
shard's memory moves about 4 GB/s. So gRPC stays the control plane:
OpenBulkSession (authenticated like every call) answers a one-time ticket (16
random bytes, bound to the asking peer's IP, expiring) that opens one
connection to the bulk port. On it the client asks for boxes, each a
ReadRegionRequest, ReadRegionsRequest or LookupRequest checked as ReadRegion,
ReadRegions and LookupSmall check them, and receives a status header and the
box's bytes or the serialized ReadRegionsReply or LookupReply (protocol in
protos/shardserve.proto, BulkSession). The version stays leased while its
bytes are sent. Every request kind goes through the rank's ReadPath or
WritePath, the same code its gRPC method runs (server/rank/reads/path.py,
server/rank/writes/path.py), and errors answer as gRPC's do
(server/rank/error_status.py). A rank with TLS serves the port over TLS with
the same certificates (and, with a CA, requires client certificates as gRPC
does); the handshake runs on the connection's own thread
within TICKET_WAIT_S, so a peer that never finishes it holds no more than a
connection slot for that long.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import unquote

import grpc
from google.protobuf.message import DecodeError, Message

from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.bulk_wire import (
    FRAME,
    HEADER,
    KIND_LOOKUP,
    KIND_READ,
    KIND_READS,
    KIND_WRITE,
    MAX_REQUEST_BYTES,
    STATUS_BODY,
    TICKET_BYTES,
    recv_exactly,
    send_parts,
)
from shardserve.protos.chunk_codec import lookup_reply_pieces
from shardserve.protos.errors import status_proto
from shardserve.server.common.access import caller, check_tensor
from shardserve.server.common.errors import ServiceError, bounded_message
from shardserve.server.common.principals import READ, Principal
from shardserve.server.rank.error_status import error_status, rank_rpc
from shardserve.server.rank.errors import (
    InvalidArgument,
    Overloaded,
    PathUnavailable,
    PermissionDenied,
    RankError,
    RankUnavailable,
)
from shardserve.server.rank.metrics import BULK
from shardserve.server.rank.reads.path import ReadPath
from shardserve.server.rank.store import ShardStore
from shardserve.server.rank.writes.path import WritePath

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

TICKET_TTL_S = 30.0
MAX_TICKETS = 4096  # unredeemed tickets one rank keeps; more is RESOURCE_EXHAUSTED
IDLE_TIMEOUT_S = 300.0  # a connection idle (or a peer stalled mid-transfer) this long is closed
TICKET_WAIT_S = (
    10.0  # a new connection must present its whole ticket within this (no slot held idle)
)
FRAME_WAIT_S = 30.0  # a request frame whose header arrived must arrive whole within this
MAX_CONNECTIONS = (
    64  # open at once, each on its own thread; more are refused UNAVAILABLE (the client
)
# then reads over gRPC)


@dataclass(frozen=True)
class _Ticket:
    peer: ipaddress.IPv4Address | ipaddress.IPv6Address | None
    deadline: float
    principal: (
        Principal | None
    )  # who asked for it (None without client auth): what its connection may write


def peer_ip(peer: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP of a gRPC peer string ("ipv4:1.2.3.4:5", "ipv6:[::1]:5", or as grpcio reports IPv6 peers,
    "ipv6:%5B::1%5D:5") or a socket address; None if not IP."""
    host = peer
    if peer.startswith(("ipv4:", "ipv6:")):
        host = unquote(peer.split(":", 1)[1]).rpartition(":")[0]
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


class Tickets:
    """One-time tickets: issued by OpenBulkSession, each redeemed by one connection to the bulk port."""

    def __init__(
        self,
        ttl_s: float = TICKET_TTL_S,
        capacity: int = MAX_TICKETS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock`: what tickets expire by (seconds, monotonic; tests pass a fake one)."""
        self._clock = clock
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._tickets: dict[bytes, _Ticket] = {}
        self._lock = threading.Lock()

    def issue(self, peer: str, principal: Principal | None = None) -> bytes:
        """A fresh ticket for `principal`, valid once from `peer`'s IP for ttl_s seconds."""
        now = self._clock()
        with self._lock:
            for key in [k for k, t in self._tickets.items() if t.deadline <= now]:
                del self._tickets[key]
            if len(self._tickets) >= self.capacity:
                raise Overloaded(
                    f"this rank holds {self.capacity} unredeemed bulk-read tickets; "
                    f"retry later or read over ReadRegion"
                )
            ticket = secrets.token_bytes(TICKET_BYTES)
            self._tickets[ticket] = _Ticket(peer_ip(peer), now + self.ttl_s, principal)
        return ticket

    def redeem(self, ticket: bytes, peer: str) -> Principal | None:
        """Use up `ticket` and return the principal it was issued to; PERMISSION_DENIED if it is unknown, used,
        expired or presented from another IP."""
        with self._lock:
            entry = self._tickets.pop(ticket, None)
        if entry is None or entry.deadline <= self._clock():
            raise PermissionDenied(
                "ticket: unknown, already used or expired", metadata={"field": "ticket"}
            )
        if entry.peer is not None and entry.peer != peer_ip(peer):
            raise PermissionDenied(
                f"ticket: issued to {entry.peer}, presented from {peer}",
                metadata={"field": "ticket"},
            )
        return entry.principal


class BulkReads:
    """OpenBulkSession and the bulk TCP port of one rank (host None = no port: OpenBulkSession is UNIMPLEMENTED)."""

    def __init__(
        self,
        store: ShardStore,
        host: str | None,
        port: int = 0,
        off_reason: str = "",
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.store = store
        self.tls = tls
        self.reads = ReadPath(store)
        self.writes = WritePath(store)
        self.tickets = Tickets()
        self.off_reason = off_reason or "bulk reads are turned off (--no-bulk-reads)"
        self._listener: socket.socket | None = None
        self._connections = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._open: set[socket.socket] = set()  # connections being served, shut down by close()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._port = 0
        if host is not None:
            family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
            self._listener = socket.create_server(
                (host.strip("[]"), port), family=family, backlog=128
            )
            self._port = self._listener.getsockname()[1]
            self._start_thread(self._accept_loop, (self._listener,), "bulk-accept")

    @property
    def port(self) -> int | None:
        return self._port if self._listener is not None else None

    @property
    def bound_port(self) -> int:
        """The port this listened on, also after close() (port is then None); 0 without a listener."""
        return self._port

    @property
    def serving_threads(self) -> int:
        """How many of this port's threads (accepting, serving connections) are still running."""
        with self._lock:
            return sum(thread.is_alive() for thread in self._threads)

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, break off open connections and wait (bounded) for their threads: a thread still
        blocked in a socket call while the interpreter exits aborts the process."""
        with self._lock:
            listener, self._listener = self._listener, None
            socks = list(self._open)
        for sock in ([listener] if listener is not None else []) + socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept, recv or send
        if listener is not None:
            listener.close()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _start_thread(self, target: Callable[..., None], args: tuple, name: str) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    @rank_rpc
    def OpenBulkSession(
        self, request: pb.BulkSessionRequest, context: grpc.ServicerContext
    ) -> pb.BulkSession:
        port = self.port
        if port is None:
            raise PathUnavailable(
                f"rank {self.store.rank} serves no bulk port: {self.off_reason}",
                metadata={"rank": self.store.rank},
            )
        return pb.BulkSession(
            port=port,
            ticket=self.tickets.issue(context.peer(), caller()),
            expires_s=self.tickets.ttl_s,
            tls=self.tls is not None,
        )

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, address = listener.accept()
            except OSError:
                return  # closed
            if not self._connections.acquire(blocking=False):
                if (
                    self.tls is None
                ):  # a TLS client would read the plain answer as a broken handshake
                    _send_error(
                        conn,
                        address[0],
                        RankUnavailable(
                            f"this rank serves {MAX_CONNECTIONS} bulk connections already; read over gRPC"
                        ),
                    )
                conn.close()
                continue
            with self._lock:
                if self._listener is None:  # closing
                    conn.close()
                    self._connections.release()
                    return
                self._open.add(conn)
            self._start_thread(self._serve, (conn, address[0]), "bulk-conn")

    def _serve(self, raw: socket.socket, peer: str) -> None:
        """One connection: the TLS handshake when on, the ticket, then boxes asked for until the peer closes or
        idles out."""
        conn: socket.socket | None = raw
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = self._secure(raw, peer)
            if conn is None:
                return
            with conn:
                try:
                    principal = self.tickets.redeem(
                        _recv_bytes(conn, TICKET_BYTES, TICKET_WAIT_S), peer
                    )
                except (RankError, ServiceError) as err:
                    _send_error(conn, peer, err)
                    return
                conn.settimeout(IDLE_TIMEOUT_S)
                while (request := _read_request(conn, peer)) is not None:
                    self._answer(conn, peer, *request, principal)
        except OSError as err:
            log.debug("bulk connection from %s ended: %s", peer, err)
        finally:
            raw.close()
            with self._lock:
                self._open.discard(raw)
                self._open.discard(conn)
            self._connections.release()

    def _secure(self, raw: socket.socket, peer: str) -> socket.socket | None:
        """`raw` itself without TLS, else the TLS socket over it once the handshake succeeded within
        TICKET_WAIT_S (None: refused, e.g. no client certificate where mTLS is on, or a plaintext peer)."""
        if self.tls is None:
            return raw
        raw.settimeout(TICKET_WAIT_S)
        conn = self.tls.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
        with self._lock:
            self._open.discard(raw)
            self._open.add(conn)  # close() shuts the TLS socket down (the raw one is detached now)
        try:
            conn.do_handshake()
        except (ssl.SSLError, OSError) as err:
            log.info("bulk connection from %s refused: TLS handshake failed: %s", peer, err)
            conn.close()
            return None
        return conn

    def _answer(
        self,
        conn: socket.socket,
        peer: str,
        kind: int,
        message: bytes,
        principal: Principal | None = None,
    ) -> None:
        """Send the answer to one request, or its error (the connection stays usable after an error)."""
        try:
            if kind == KIND_WRITE:
                written = self.writes.receive(conn, _write_request(conn, peer, message), principal)
                body = written.SerializeToString()
                send_parts(conn, [HEADER.pack(0, 0, len(body)), body])
                return
            if kind == KIND_READS:
                batch = _parse(pb.ReadRegionsRequest, message)
                _may_read(principal, "ReadRegions", [region.name for region in batch.regions])
                body = self.reads.regions(batch, BULK).SerializeToString()
                send_parts(conn, [HEADER.pack(0, 0, len(body)), body])
                return
            if kind == KIND_LOOKUP:
                lookup = _parse(pb.LookupRequest, message)
                _may_read(principal, "Lookup", [item.name for item in lookup.items])
                pieces = lookup_reply_pieces(self.reads.lookup_small(lookup, BULK))
                send_parts(conn, [HEADER.pack(0, 0, sum(len(piece) for piece in pieces)), *pieces])
                return
            region = _parse(pb.ReadRegionRequest, message)
            _may_read(principal, "ReadRegion", [region.name])
            with self.reads.region(region, BULK) as data:
                send_parts(conn, [HEADER.pack(0, 0, len(data)), data])
        except OSError:
            raise
        except Exception as err:  # noqa: BLE001 - answered to the peer, as rpc_errors does for gRPC
            _send_error(conn, peer, err)


def _may_read(principal: Principal | None, method: str, names: list[str]) -> None:
    """PERMISSION_DENIED when the ticket's principal's tensor patterns do not cover every tensor read, as
    the access interceptor checks a gRPC read (no principal: a server without client auth)."""
    if principal is not None:
        check_tensor(principal, method, sorted(set(names)), right=READ)


def _read_request(conn: socket.socket, peer: str) -> tuple[int, bytes] | None:
    """The next request frame as (kind, message bytes), or None when the peer closed between frames; a frame
    of unknown kind or over MAX_REQUEST_BYTES is answered INVALID_ARGUMENT and ends the connection
    (ConnectionAbortedError: the stream cannot be trusted to be in step any more)."""
    frame = bytearray(FRAME.size)
    first = conn.recv_into(frame)
    if not first:
        return None
    conn.settimeout(FRAME_WAIT_S)
    deadline = time.monotonic() + FRAME_WAIT_S
    recv_exactly(conn, memoryview(frame)[first:], deadline)
    kind, length = FRAME.unpack(frame)
    if kind not in (KIND_READ, KIND_LOOKUP, KIND_WRITE, KIND_READS) or length > MAX_REQUEST_BYTES:
        what = (
            f"kind {kind} is none of {KIND_READ} (read), {KIND_LOOKUP} (lookup), {KIND_WRITE} (write), "
            f"{KIND_READS} (reads)"
            if length <= MAX_REQUEST_BYTES
            else f"a frame of {length} bytes is over the bulk port's {MAX_REQUEST_BYTES}-byte limit"
        )
        _send_error(conn, peer, InvalidArgument(f"request: {what}"))
        raise ConnectionAbortedError(what)
    message = _recv_bytes(conn, length, max(deadline - time.monotonic(), 1e-3))
    conn.settimeout(IDLE_TIMEOUT_S)
    return kind, message


def _write_request(conn: socket.socket, peer: str, message: bytes) -> pb.WriteShardsRequest:
    """The WriteShardsRequest of a write frame; one that does not parse is answered and ends the connection
    (ConnectionAbortedError: its shards' bytes follow, of a length nobody can tell now)."""
    try:
        return _parse(pb.WriteShardsRequest, message)
    except InvalidArgument as err:
        _send_error(conn, peer, err)
        raise ConnectionAbortedError(err.message) from None


def _parse(message_type: type[M], data: bytes) -> M:
    """`data` parsed as `message_type`; INVALID_ARGUMENT naming the type when it is not one."""
    try:
        return message_type.FromString(data)
    except DecodeError:
        raise InvalidArgument(f"request: not a serialized {message_type.DESCRIPTOR.name}") from None


def _send_error(conn: socket.socket, peer: str, err: Exception) -> None:
    """Answer `err` as a status header and message (what rpc_errors does for a gRPC call)."""
    status = error_status(err)
    if status.code == grpc.StatusCode.INTERNAL:
        log.error("bulk read for %s failed: %s", peer, status.message, exc_info=err)
    else:
        log.info("bulk read for %s -> %s: %s", peer, status.code.name, status.message)
    message = bounded_message(status.message)
    body = status_proto(status.code, message, status.reason, status.metadata).SerializeToString()
    with contextlib.suppress(OSError):
        send_parts(conn, [HEADER.pack(status.code.value[0], STATUS_BODY, len(body)), body])


def _recv_bytes(conn: socket.socket, nbytes: int, within_s: float) -> bytes:
    """`nbytes` from `conn` within `within_s` seconds in all (TimeoutError after: a trickling peer does not keep
    a connection slot), not only per recv."""
    conn.settimeout(within_s)
    data = bytearray(nbytes)
    recv_exactly(conn, memoryview(data), time.monotonic() + within_s)
    return bytes(data)


def handlers(reads: BulkReads) -> dict[str, grpc.RpcMethodHandler]:
    """The ShardServer method handler of OpenBulkSession."""
    return {
        "OpenBulkSession": grpc.unary_unary_rpc_method_handler(
            reads.OpenBulkSession,
            request_deserializer=pb.BulkSessionRequest.FromString,
            response_serializer=pb.BulkSession.SerializeToString,
        )
    }
