"""The client's gRPC channels (auth metadata, TLS, deadlines) and the one place their stubs are made.

`Channel` caches one grpc.Channel per address, makes the coordinator and rank
stubs, and the rank methods whose messages go through the custom chunk codec
(protos.chunk_codec: bytes stay views of the received message). Writes are
client-streamed chunks of about 1 MiB; parts of one read run on its pool.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import grpc

from shardserve.client.errors import ShardServeError, error_from_rpc
from shardserve.core.channel_options import MAX_MESSAGE_BYTES, MESSAGE_OPTIONS, RECONNECT_OPTIONS
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.protos.chunk_codec import (
    decode_chunk,
    decode_lookup_chunk,
    decode_lookup_reply,
    encode_write_chunk,
)

CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = MAX_MESSAGE_BYTES - (1 << 10)  # room for the message's own fields
# Data calls get the control deadline plus time for their bytes at this pessimistic rate.
_SLOWEST_BYTES_PER_S = 20e6
T = TypeVar("T")
SHARD_SERVICE = "/" + pb.DESCRIPTOR.services_by_name["ShardServer"].full_name
# Every channel of a client, blocking or asyncio: the largest message, and a try to connect again within a
# second of a failed one (shardcore.channel_options).
CHANNEL_OPTIONS = MESSAGE_OPTIONS + RECONNECT_OPTIONS


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

    def ssl_context(self) -> ssl.SSLContext:
        """The bulk port's TLS context from the same files as the gRPC channels: the rank's certificate verified
        against tls_ca (the system's CAs without it) and its host name, ours presented for mTLS."""
        _read_file(
            self.tls_ca, "tls_ca"
        )  # the same ValueError naming the field as channel_credentials
        context = ssl.create_default_context(cafile=self.tls_ca)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.tls_cert is not None:
            context.load_cert_chain(self.tls_cert, self.tls_key)
        return context

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read_file(self.tls_ca, "tls_ca"),
            private_key=_read_file(self.tls_key, "tls_key"),
            certificate_chain=_read_file(self.tls_cert, "tls_cert"),
        )


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


class ShardMethods(NamedTuple):
    """A rank's ShardServer methods that carry bulk bytes, their chunks encoded and decoded by
    protos.chunk_codec (where protobuf would copy the bytes twice): made once per address, since making them
    per call costs as much as a small lookup."""

    read_region: Any  # ReadRegion -> iterator of (offset, memoryview)
    read_region_small: Any  # ReadRegionSmall -> (offset, memoryview)
    write_shard: Any  # WriteShard <- pre-serialized requests
    lookup_small: Any  # LookupSmall -> list[RawLookupChunk]
    lookup: Any  # Lookup -> iterator of RawLookupChunk
    write_shards: Any  # WriteShards (whole shards, their bytes inline or in a same-host memfd)
    read_regions: Any  # ReadRegions (many small boxes, their bytes in one reply)


class Channel:
    """gRPC channels to the coordinator and the ranks, with this client's credentials, deadline and pool."""

    def __init__(
        self,
        credentials: Credentials,
        timeout: float,
        max_workers: int = 16,
        interceptor: Any = None,
    ) -> None:
        self.credentials = credentials
        self.interceptor = interceptor  # wraps every channel (client.tracing), or None
        self.timeout = timeout
        self._metadata = credentials.metadata()
        self._channels: dict[str, grpc.Channel] = {}
        self._shard_methods: dict[str, ShardMethods] = {}
        self._shard_servers: dict[str, pb_grpc.ShardServerStub] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="shardserve-client"
        )
        self._closed = False

    # ------------------------------------------------------------ channels

    def channel(self, address: str) -> grpc.Channel:
        """The (cached) channel to `address`, made with CHANNEL_OPTIONS."""
        with self._lock:
            self.check_open()
            channel = self._channels.get(address)
            if channel is None:
                if self.credentials.uses_tls:
                    channel = grpc.secure_channel(
                        address, self.credentials.channel_credentials(), options=CHANNEL_OPTIONS
                    )
                else:
                    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
                if self.interceptor is not None:
                    channel = grpc.intercept_channel(channel, self.interceptor)
                self._channels[address] = channel
            return channel

    def check_open(self) -> None:
        """ShardServeError once close() ran: every call of a closed client fails alike, mapped reads included."""
        if self._closed:
            raise ShardServeError("the client is closed")

    def coordinator(self, address: str) -> pb_grpc.CoordinatorStub:
        return pb_grpc.CoordinatorStub(self.channel(address))

    def shard_server(self, address: str) -> pb_grpc.ShardServerStub:
        """The (cached) stub of the rank at `address`: making one registers every method of the service, about
        1 ms, which a read's OpenShard and ReleaseShard paid each time."""
        stub = self._shard_servers.get(address)
        if stub is None:
            stub = self._shard_servers[address] = pb_grpc.ShardServerStub(self.channel(address))
        return stub

    def shard_methods(self, address: str) -> ShardMethods:
        """The (cached) bulk-byte methods of the rank at `address`."""
        methods = self._shard_methods.get(address)
        if methods is None:
            channel = self.channel(address)
            methods = self._shard_methods[address] = ShardMethods(
                channel.unary_stream(
                    f"{SHARD_SERVICE}/ReadRegion",
                    request_serializer=_serialize,
                    response_deserializer=decode_chunk,
                ),
                channel.unary_unary(
                    f"{SHARD_SERVICE}/ReadRegionSmall",
                    request_serializer=_serialize,
                    response_deserializer=decode_chunk,
                ),
                channel.stream_unary(
                    f"{SHARD_SERVICE}/WriteShard",
                    request_serializer=None,  # come serialized
                    response_deserializer=pb.WriteShardResponse.FromString,
                ),
                channel.unary_unary(
                    f"{SHARD_SERVICE}/LookupSmall",
                    request_serializer=_serialize,
                    response_deserializer=decode_lookup_reply,
                ),
                channel.unary_stream(
                    f"{SHARD_SERVICE}/Lookup",
                    request_serializer=_serialize,
                    response_deserializer=decode_lookup_chunk,
                ),
                channel.unary_unary(
                    f"{SHARD_SERVICE}/WriteShards",
                    request_serializer=_serialize,
                    response_deserializer=pb.WriteShardsResponse.FromString,
                ),
                channel.unary_unary(
                    f"{SHARD_SERVICE}/ReadRegions",
                    request_serializer=_serialize,
                    response_deserializer=pb.ReadRegionsReply.FromString,
                ),
            )
        return methods

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata every call carries (the bearer token, when there is one)."""
        return self._metadata

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels, self._channels = list(self._channels.values()), {}
            self._shard_methods, self._shard_servers = {}, {}
        self._pool.shutdown(wait=False, cancel_futures=True)
        for channel in channels:
            channel.close()

    # ------------------------------------------------------------ calls

    def data_timeout(self, nbytes: int) -> float:
        """Deadline of a call moving `nbytes`: the control timeout plus time for the bytes."""
        return self.timeout + nbytes / _SLOWEST_BYTES_PER_S

    def unary(
        self, method: Callable[..., Any], request: Any, where: str, timeout: float | None = None
    ) -> Any:
        """Call a unary RPC with deadline and auth; raise the matching ShardServeError on failure."""
        self.check_open()
        try:
            return method(
                request,
                timeout=self.timeout if timeout is None else timeout,
                metadata=self._metadata,
            )
        except grpc.RpcError as err:
            raise error_from_rpc(err, where) from None

    def write_shard(
        self,
        address: str,
        header: pb.WriteShardHeader,
        data: memoryview,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> int:
        """Stream one whole shard (`data`, its C-contiguous bytes) to its owner; returns bytes written."""

        def requests() -> Iterator[bytes]:
            yield pb.WriteShardRequest(header=header).SerializeToString()
            for start in range(0, len(data), chunk_bytes):
                yield encode_write_chunk(start, data[start : start + chunk_bytes])

        reply = self.unary(
            self.shard_methods(address).write_shard,
            requests(),
            f"rank at {address}",
            timeout=self.data_timeout(len(data)),
        )
        return reply.bytes_written

    def submit(self, job: Callable[[], T]) -> Future[T]:
        """Run `job` on the client's pool without waiting (e.g. releasing a shared-memory lease)."""
        self.check_open()
        return self._pool.submit(job)

    def run_all(self, jobs: Sequence[Callable[[], T]]) -> list[T]:
        """run_here_and_on(jobs, the client's pool)."""
        self.check_open()
        return run_here_and_on(jobs, self._pool.submit)


def _serialize(message: Any) -> bytes:
    return message.SerializeToString()


def run_here_and_on(
    jobs: Sequence[Callable[[], T]], submit: Callable[[Callable[[], T]], Future[T]]
) -> list[T]:
    """Run the callables in `jobs`, the first on this thread and the rest through `submit` (one thread hand-off
    fewer per call), wait for all, raise the first failure in job order once every job has ended."""
    futures = [submit(job) for job in jobs[1:]]
    results: list[Any] = []
    first_error: BaseException | None = None
    for run in [jobs[0], *(future.result for future in futures)] if jobs else []:
        try:
            results.append(run())
        except BaseException as err:  # noqa: BLE001 - re-raised below after every job finished
            results.append(None)
            first_error = first_error or err
    if first_error is not None:
        raise first_error
    return results
