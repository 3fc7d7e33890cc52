"""gRPC plumbing for the client: channels with auth and TLS, chunked reads and writes.

Bulk data never travels in one message: reads are server-streamed TensorChunks
written straight into a preallocated byte buffer, writes are client-streamed
chunks of about 1 MiB. Parts of one read run in parallel on a thread pool.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

import grpc
import numpy as np
import torch

from protos.chunk_codec import decode_chunk, encode_write_chunk
from client.errors import ShardServeError, error_from_rpc
from protos import shardserve_pb2 as pb
from protos import shardserve_pb2_grpc as pb_grpc

CHUNK_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 64 << 20
MAX_CHUNK_BYTES = MAX_MESSAGE_BYTES - (1 << 10)  # room for the message's own fields
# Data calls get the control deadline plus time for their bytes at this pessimistic rate.
_SLOWEST_BYTES_PER_S = 20e6
T = TypeVar("T")
SHARD_SERVICE = "/" + pb.DESCRIPTOR.services_by_name["ShardServer"].full_name
_CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)


@dataclass(frozen=True)
class Credentials:
    """What every channel of one client needs: bearer token and TLS files."""

    token: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together (mutual TLS)")
        if self.token is not None and (not isinstance(self.token, str) or not self.token):
            raise ValueError("token must be a non-empty string or None")
        if self.token is not None and not (self.token.isascii() and self.token.isprintable()):
            raise ValueError("token must be printable ASCII (it travels in an HTTP/2 header)")

    @property
    def uses_tls(self) -> bool:
        return self.tls_ca is not None or self.tls_cert is not None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read_file(self.tls_ca, "tls_ca"),
            private_key=_read_file(self.tls_key, "tls_key"),
            certificate_chain=_read_file(self.tls_cert, "tls_cert"))


def _read_file(path: str | None, field: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"{field}: cannot read {path!r}: {err.strerror}") from None


def check_address(address: str, field: str = "address") -> str:
    """`address` if it looks like HOST:PORT, else ValueError naming `field`."""
    if not isinstance(address, str):
        raise TypeError(f"{field} must be a 'HOST:PORT' string, got {type(address).__name__}")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{field} {address!r} is not of the form HOST:PORT")
    return address


class Transport:
    """Channels to the coordinator and the ranks, and the chunked data calls over them."""

    def __init__(self, credentials: Credentials, timeout: float, max_workers: int = 16) -> None:
        self.credentials = credentials
        self.timeout = timeout
        self._metadata = credentials.metadata()
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="shardserve-client")
        self._closed = False

    # ------------------------------------------------------------ channels

    def channel(self, address: str) -> grpc.Channel:
        """The (cached) channel to `address`."""
        with self._lock:
            self.check_open()
            channel = self._channels.get(address)
            if channel is None:
                if self.credentials.uses_tls:
                    channel = grpc.secure_channel(address, self.credentials.channel_credentials(),
                                                  options=_CHANNEL_OPTIONS)
                else:
                    channel = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
                self._channels[address] = channel
            return channel

    def check_open(self) -> None:
        """ShardServeError once close() ran: every call of a closed client fails alike, mapped reads included."""
        if self._closed:
            raise ShardServeError("the client is closed")

    def coordinator(self, address: str) -> pb_grpc.CoordinatorStub:
        return pb_grpc.CoordinatorStub(self.channel(address))

    def shard_server(self, address: str) -> pb_grpc.ShardServerStub:
        return pb_grpc.ShardServerStub(self.channel(address))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels, self._channels = list(self._channels.values()), {}
        self._pool.shutdown(wait=False, cancel_futures=True)
        for channel in channels:
            channel.close()

    # ------------------------------------------------------------ calls

    def data_timeout(self, nbytes: int) -> float:
        """Deadline of a call moving `nbytes`: the control timeout plus time for the bytes."""
        return self.timeout + nbytes / _SLOWEST_BYTES_PER_S

    def unary(self, method, request, where: str, timeout: float | None = None):
        """Call a unary RPC with deadline and auth; raise the matching ShardServeError on failure."""
        self.check_open()
        try:
            return method(request, timeout=self.timeout if timeout is None else timeout,
                          metadata=self._metadata)
        except grpc.RpcError as err:
            raise error_from_rpc(err, where) from None

    def read_region(self, address: str, request: pb.ReadRegionRequest, dest: torch.Tensor) -> None:
        """Stream one ReadRegion into `dest`, a flat uint8 tensor exactly the part's size."""
        expected = dest.numel()
        target = dest.numpy() if expected else np.empty(0, dtype=np.uint8)
        read = self.channel(address).unary_stream(
            f"{SHARD_SERVICE}/ReadRegion", request_serializer=pb.ReadRegionRequest.SerializeToString,
            response_deserializer=decode_chunk)  # chunks as memoryviews of the received messages
        call = read(request, timeout=self.data_timeout(expected), metadata=self._metadata)
        received = 0
        try:
            for offset, data in call:
                end = offset + len(data)
                if offset < 0 or end > expected:
                    raise ShardServeError(
                        f"rank at {address} sent a chunk at bytes [{offset}, {end}) of a {expected}-byte region")
                if len(data):
                    target[offset:end] = np.frombuffer(data, dtype=np.uint8)
                received += len(data)
        except grpc.RpcError as err:
            raise error_from_rpc(err, f"rank at {address}") from None
        finally:
            call.cancel()
        if received != expected:
            raise ShardServeError(f"rank at {address} sent {received} bytes for a {expected}-byte region")

    def write_shard(self, address: str, header: pb.WriteShardHeader, data: memoryview,
                    chunk_bytes: int = CHUNK_BYTES) -> int:
        """Stream one whole shard (`data`, its C-contiguous bytes) to its owner; returns bytes written."""
        def requests() -> Iterator[bytes]:
            yield pb.WriteShardRequest(header=header).SerializeToString()
            for start in range(0, len(data), chunk_bytes):
                yield encode_write_chunk(start, data[start:start + chunk_bytes])

        write = self.channel(address).stream_unary(
            f"{SHARD_SERVICE}/WriteShard", request_serializer=None,  # requests come serialized
            response_deserializer=pb.WriteShardResponse.FromString)
        reply = self.unary(write, requests(), f"rank at {address}", timeout=self.data_timeout(len(data)))
        return reply.bytes_written

    def submit(self, job) -> Future:  # type: ignore[no-untyped-def]
        """Run `job` on the client's pool without waiting (e.g. releasing a shared-memory lease)."""
        self.check_open()
        return self._pool.submit(job)

    def run_all(self, jobs: Sequence[Callable[[], T]]) -> list[T]:
        """run_here_and_on(jobs, the client's pool)."""
        self.check_open()
        return run_here_and_on(jobs, self._pool.submit)


def run_here_and_on(jobs: Sequence[Callable[[], T]], submit: Callable[[Callable[[], T]], "Future[T]"]) -> list[T]:
    """Run the callables in `jobs`, the first on this thread and the rest through `submit` (one thread hand-off
    fewer per call), wait for all, raise the first failure in job order once every job has ended."""
    futures = [submit(job) for job in jobs[1:]]
    results, first_error = [], None
    for run in [jobs[0], *(future.result for future in futures)] if jobs else []:
        try:
            results.append(run())
        except BaseException as err:  # noqa: BLE001 - re-raised below after every job finished
            results.append(None)
            first_error = first_error or err
    if first_error is not None:
        raise first_error
    return results
