"""The bulk TCP data path (server/rank/reads/bulk.py answers it): boxes' bytes straight into their output.

A connection to a rank's bulk port is opened with a ticket from
OpenBulkSession, which goes over gRPC (token, TLS, deadline), after a TLS
handshake with the client's certificate files when the rank says its port
speaks TLS (it does whenever its gRPC does), and kept for
later calls (client.paths.bulk_connections: at most IDLE_KEPT per rank, each for at most IDLE_KEEP_S). A read
sends one framed ReadRegionRequest, reads the 16-byte header and `recv_into`s
the bytes into the preallocated output: no protobuf around the data, no
intermediate buffer. A lookup sends a LookupRequest and gets LookupSmall's
answer. Failures of the path itself (no bulk port, ticket refused, connection
broken) raise BulkReadError so client.paths.policy can fall back to gRPC; errors
about the request (stale version, bad box) are the exceptions a gRPC read
raises, and leave the connection usable. A rank that sends nothing back within
the call's deadline (a cut link, a hung rank) is DeadlineExceededError, as over
gRPC, raised at the deadline: neither retried nor sent again over gRPC.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import grpc
import torch
from google.protobuf.message import DecodeError
from google.rpc import status_pb2

from shardserve.client.channel import Channel
from shardserve.client.errors import (
    DeadlineExceededError,
    ShardServeError,
    error_from_rpc,
    error_from_status,
)
from shardserve.client.info import RankStatus
from shardserve.client.paths.bulk_connections import Connection, IdleConnections
from shardserve.client.paths.grpc import unary
from shardserve.client.paths.hedging import Cancellation
from shardserve.client.paths.kinds import CPU_AND_CUDA, Capabilities, PathKind
from shardserve.client.paths.network import NetworkPath
from shardserve.client.paths.writes import (
    DIRECT_BATCH_BYTES,
    ShardWrite,
    batched,
    write_request,
)
from shardserve.core.wire import tensor_bytes
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
    recv_exactly,
    send_parts,
)
from shardserve.protos.errors import Reason, detail_of_status

MAX_ERROR_BYTES = 64 << 10
T = TypeVar("T")
_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}
# Reasons of an answer on the port that say the path cannot serve us (not that the request is wrong): the port
# is off, the ticket's rights refused, the rank going away; the fallback chain goes on to gRPC.
_PATH_FAILURES = frozenset(
    {Reason.PATH_UNAVAILABLE, Reason.PERMISSION_DENIED, Reason.RANK_UNAVAILABLE}
)


@dataclass(frozen=True)
class _ErrorAnswer:
    """The header of an error answer: its gRPC code, the kind of body that follows and its length."""

    status: int
    body_kind: int
    length: int


def _error_of(code: grpc.StatusCode, body_kind: int, body: bytes, where: str) -> ShardServeError:
    """The client exception for an error answer's body: a google.rpc.Status (STATUS_BODY) or plain text."""
    if body_kind == STATUS_BODY:
        try:
            status = status_pb2.Status.FromString(body)
        except DecodeError:
            return error_from_status(code, "undecodable error status", where)
        return error_from_status(code, status.message, where, detail=detail_of_status(status))
    return error_from_status(code, body.decode("utf-8", "replace"), where)


class BulkReadError(ShardServeError):
    """The bulk TCP path cannot serve this read (no bulk port, ticket refused, connection broken):
    PATH_UNAVAILABLE, so the fallback chain tries the next path."""

    reason = Reason.PATH_UNAVAILABLE


class BulkPath(NetworkPath):
    """Reads, lookups and writes over the ranks' bulk ports (a DataPath: client.paths.kinds); connections
    opened on demand and kept for reuse."""

    kind = PathKind.BULK
    # the rank copies CUDA shards out itself; answers bounded in size, requests sent before answers are taken
    capabilities = Capabilities(devices=CPU_AND_CUDA, rank_calls=True, pipelined=True)

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.idle = IdleConnections()
        self._lock = threading.Lock()  # guards the TLS context made once
        self._tls: ssl.SSLContext | None = None  # made on the first TLS connection

    def refusal(self, rank: RankStatus) -> ShardServeError:
        return BulkReadError(f"rank {rank.rank} has no address")

    def read_box(
        self,
        address: str,
        request: pb.ReadRegionRequest,
        dest: torch.Tensor,
        cancel: Cancellation | None = None,
    ) -> None:
        """The box of `request` into `dest` (a flat contiguous uint8 CPU tensor of its size) over the bulk port;
        `cancel` can stop it from another thread (its connection shut down)."""
        self.send_read(address, request, dest, cancel)()

    def send_read(
        self,
        address: str,
        request: pb.ReadRegionRequest,
        dest: torch.Tensor,
        cancel: Cancellation | None = None,
    ) -> Callable[[], None]:
        """Send the read of `request` now and return the call that takes its bytes into `dest` (as
        send_lookup does for lookups); the returned call must be made, or the connection is not reused."""

        def into_dest(sock: socket.socket, length: int, deadline: float) -> None:
            if length != dest.numel():
                raise ShardServeError(
                    f"rank at {address} sends {length} bytes for a {dest.numel()}-byte region"
                )
            if length:
                recv_exactly(sock, memoryview(dest.numpy()), deadline)  # type: ignore[arg-type]

        return self._send(
            address, KIND_READ, request.SerializeToString(), dest.numel(), into_dest, cancel=cancel
        )

    def send_lookup(
        self,
        address: str,
        request: pb.LookupRequest,
        reply_bytes: int,
        cancel: Cancellation | None = None,
    ) -> Callable[[], bytearray]:
        """Send `request` now and return the call that takes its serialized LookupReply (at most `reply_bytes`,
        the caller's bound for this request), so requests to several ranks go out before any answer is awaited
        (one thread overlaps the ranks' work). The returned call must be made, or the connection is not
        reused."""
        return self._send(
            address,
            KIND_LOOKUP,
            request.SerializeToString(),
            reply_bytes,
            _bounded_answer(address, "lookup answer", reply_bytes),
            cancel=cancel,
        )

    def read_regions(
        self, address: str, request: pb.ReadRegionsRequest, reply_bytes: int
    ) -> pb.ReadRegionsReply:
        """ReadRegions' answer to `request` (at most `reply_bytes` serialized) as one KIND_READS frame."""
        return self.send_read_regions(address, request, reply_bytes)()

    def send_read_regions(
        self,
        address: str,
        request: pb.ReadRegionsRequest,
        reply_bytes: int,
        cancel: Cancellation | None = None,
    ) -> Callable[[], pb.ReadRegionsReply]:
        """Send `request` now as one KIND_READS frame and return the call that takes its answer (as
        send_lookup does for lookups); the returned call must be made, or the connection is not reused."""
        answer = self._send(
            address,
            KIND_READS,
            request.SerializeToString(),
            reply_bytes,
            _bounded_answer(address, "ReadRegions answer", reply_bytes),
            cancel=cancel,
        )
        return lambda: pb.ReadRegionsReply.FromString(bytes(answer()))

    def write_shards(self, address: str, writes: Sequence[ShardWrite]) -> int:
        """Write whole shards to the rank at `address`: per batch of at most DIRECT_BATCH_BYTES, one
        WriteShardsRequest frame, then their bytes straight from each tensor (a contiguous copy only of those
        that are not); returns the bytes written."""
        return sum(
            self._write_batch(address, batch) for batch in batched(writes, DIRECT_BATCH_BYTES)
        )

    def _write_batch(self, address: str, writes: Sequence[ShardWrite]) -> int:
        payload = [tensor_bytes(write.stored()) for write in writes]
        answer = self._send(
            address,
            KIND_WRITE,
            write_request(writes).SerializeToString(),
            sum(len(part) for part in payload),
            _bounded_answer(address, "WriteShards answer", MAX_ERROR_BYTES),
            payload=payload,
        )()
        return pb.WriteShardsResponse.FromString(bytes(answer)).bytes_written

    def _send(
        self,
        address: str,
        kind: int,
        message: bytes,
        nbytes: int,
        receive: Callable[..., T],
        *,
        cancel: Cancellation | None = None,
        payload: Sequence[memoryview] = (),
    ) -> Callable[[], T]:
        """Send one request on a kept connection or a new one; the returned call takes the answer, with
        `receive(sock, length, deadline)` for an OK answer's bytes; `payload` follows the request (a write's
        bytes). A kept connection the rank closed meanwhile is replaced once, transparently, and the request
        sent again."""
        if len(message) > MAX_REQUEST_BYTES:
            raise BulkReadError(
                f"a {len(message)}-byte request is over the bulk port's {MAX_REQUEST_BYTES}"
            )
        frame = FRAME.pack(kind, len(message)) + message
        deadline = time.monotonic() + self.channel.data_timeout(nbytes)
        connection = self.idle.take(address)
        if connection is not None and not self._send_frame(connection, frame, cancel, payload):
            connection = None
        if connection is None:
            connection = self._open_and_send(address, frame, cancel, payload)

        def answer() -> T:
            current = connection
            while True:  # at most twice: a new connection is never `kept`
                try:
                    return self._answer(current, address, receive, deadline)
                except _NothingReceived as err:
                    current.sock.close()
                    if not current.kept or (cancel is not None and cancel.cancelled):
                        raise BulkReadError(f"rank at {address}, bulk port: {err}") from None
                current = self._open_and_send(address, frame, cancel, payload)

        return answer

    def _send_frame(
        self,
        connection: Connection,
        frame: bytes,
        cancel: Cancellation | None = None,
        payload: Sequence[memoryview] = (),
    ) -> bool:
        """Send `frame` on `connection`; False (the connection closed) when the socket fails. A cancel shuts the
        connection down, which ends a send or a receive blocked on it (the rank does not answer)."""
        if cancel is not None:
            cancel.on_cancel(partial(_shut_down, connection.sock))
        try:
            connection.sock.settimeout(self.channel.timeout)
            send_parts(connection.sock, [frame, *payload])
            return True
        except OSError:
            connection.sock.close()
            return False

    def _open_and_send(
        self,
        address: str,
        frame: bytes,
        cancel: Cancellation | None = None,
        payload: Sequence[memoryview] = (),
    ) -> Connection:
        connection = self._open(address, cancel)
        if not self._send_frame(connection, frame, cancel, payload):
            raise BulkReadError(
                f"rank at {address}, bulk port: the connection failed while sending the request"
            )
        return connection

    def close(self) -> None:
        """Close every kept connection."""
        self.idle.close()

    def _open(self, address: str, cancel: Cancellation | None = None) -> Connection:
        """A new connection to the bulk port of the rank at `address`, its ticket sent."""
        where = f"rank at {address}"
        try:
            session = self._open_session(address, cancel)
        except ShardServeError as err:
            if err.reason in (Reason.PATH_UNAVAILABLE, Reason.OVERLOADED):  # none, or busy
                raise BulkReadError(
                    f"{where}: {err.message}", err.code, reason=err.reason, metadata=err.metadata
                ) from None
            raise
        host = address.rpartition(":")[0].strip("[]")
        try:
            sock = socket.create_connection((host, session.port), timeout=self.channel.timeout)
        except OSError as err:
            raise BulkReadError(f"{where}, bulk port {session.port}: {err}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock = self._secure(sock, host, session.tls)
            sock.sendall(session.ticket)
        except OSError as err:  # ssl.SSLError too: a certificate refused either way
            sock.close()
            raise BulkReadError(f"{where}, bulk port {session.port}: {err}") from None
        return Connection(sock)

    def _secure(self, sock: socket.socket, host: str, tls: bool) -> socket.socket:
        """`sock` itself for a plaintext port, else a TLS socket over it once the rank's certificate is verified
        for `host`. A client that speaks TLS never uses a plaintext port (no downgrade), and a client without TLS
        files cannot verify a TLS one: both BulkReadError, so the read goes over gRPC."""
        uses_tls = self.channel.credentials.uses_tls
        if tls != uses_tls:
            sock.close()
            raise BulkReadError(
                "the rank's bulk port is plaintext while this client uses TLS"
                if uses_tls
                else "the rank's bulk port speaks TLS; pass tls_ca to read from it"
            )
        if not tls:
            return sock
        with self._lock:
            if self._tls is None:
                self._tls = self.channel.credentials.ssl_context()
            context = self._tls
        return context.wrap_socket(sock, server_hostname=host)

    def _open_session(self, address: str, cancel: Cancellation | None) -> pb.BulkSession:
        """OpenBulkSession of the rank at `address` (a call `cancel` can cancel when given)."""
        where, method = f"rank at {address}", self.channel.shard_server(address).OpenBulkSession
        if cancel is None:
            return self.channel.unary(method, pb.BulkSessionRequest(), where)
        self.channel.check_open()
        try:
            return unary(
                method, pb.BulkSessionRequest(), self.channel.timeout, self.channel.metadata, cancel
            )
        except grpc.RpcError as err:
            raise error_from_rpc(err, where) from None

    def _answer(
        self, connection: Connection, address: str, receive: Callable[..., T], deadline: float
    ) -> T:
        """Take the answer of the request sent on `connection`; the connection is kept if still in step."""
        where = f"rank at {address}"
        sock = connection.sock
        header = bytearray(HEADER.size)
        try:
            sock.settimeout(
                max(0.001, deadline - time.monotonic())
            )  # the call's deadline bounds the wait
            first = sock.recv_into(header)
            if not first:
                raise ConnectionError("the rank closed the connection")
        except (
            TimeoutError
        ):  # silent, not closed: a partition or a hung rank; gRPC would not do better
            sock.close()
            raise DeadlineExceededError(
                f"{where}, bulk port: no answer within the call's deadline (the rank or "
                f"the network to it is down, or the rank is hung)"
            ) from None
        except OSError as err:
            raise _NothingReceived(str(err)) from None
        try:
            recv_exactly(sock, memoryview(header)[first:], deadline)
            status, body_kind, length = HEADER.unpack(header)
            if status:
                answer = _ErrorAnswer(status, body_kind, length)
                self._raise_status(connection, address, answer, deadline)
            result = receive(sock, length, deadline)
        except OSError as err:
            sock.close()
            raise BulkReadError(f"{where}, bulk port: {err}") from None
        except ShardServeError as err:
            if isinstance(err, BulkReadError) or err.code is None:
                sock.close()
            raise
        self.idle.give_back(address, connection)
        return result

    def _raise_status(
        self, connection: Connection, address: str, answer: _ErrorAnswer, deadline: float
    ) -> None:
        """Read the error (a google.rpc.Status) that follows a non-OK header and raise it (the connection stays
        usable after an error about the request)."""
        where = f"rank at {address}"
        body = bytearray(min(answer.length, MAX_ERROR_BYTES))
        recv_exactly(connection.sock, memoryview(body), deadline)
        code = _STATUS_BY_VALUE.get(answer.status, grpc.StatusCode.UNKNOWN)
        error = _error_of(code, answer.body_kind, bytes(body), where)
        if error.reason in _PATH_FAILURES or answer.length > MAX_ERROR_BYTES:
            raise BulkReadError(f"{where}: {error.message}", code)
        self.idle.give_back(address, connection)
        raise error


def _bounded_answer(
    address: str, what: str, limit: int
) -> Callable[[socket.socket, int, float], bytearray]:
    """The `receive` of an answer that is a message of at most `limit` bytes (a longer one is a ShardServeError
    naming `what`): its bytes, to parse."""

    def receive(sock: socket.socket, length: int, deadline: float) -> bytearray:
        if length > limit:
            raise ShardServeError(
                f"rank at {address} sends a {length}-byte {what} to a request whose answer "
                f"takes at most {limit}"
            )
        answer = bytearray(length)
        recv_exactly(sock, memoryview(answer), deadline)
        return answer

    return receive


def _shut_down(sock: socket.socket) -> None:
    """Shut a connection down from another thread: a send or receive blocked on it returns at once."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # closed already


class _NothingReceived(Exception):
    """The connection failed before this read got any byte back (a kept one may have been closed by the rank
    meanwhile): retried once on a new connection."""
