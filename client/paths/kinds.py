"""The one interface of the client's data paths: PathKind names a path, DataPath is what every path does.

A path reads one part of a shard into a destination tensor, writes a batch of whole shards to a rank, says
whether it may serve a rank at all (`supports`), closes what it keeps open, and declares what else it can do
as its Capabilities: each capability comes with the methods of one small protocol below (RowReads,
InPlaceWrites, RankCalls, PipelinedCalls), so the policy (client.paths.policy) asks for a path by what it
can do and never by which path it is. The shared-memory (client.paths.shm), bulk-port (client.paths.bulk)
and gRPC (client.paths.grpc) paths implement it, built by client.paths.factory; client.paths.chain tries them
in order. `transport=` strings ("auto", "shm", "bulk", "grpc") are parsed into a PathKind once, at the API
edge: PathKind names a path to users (transport=, last_transport, counters), it decides no behaviour. The
bulk path (over a rank's bulk port) was named "tcp" at the API: transport="tcp" is still accepted, deprecated.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from shardserve.client.errors import ShardServeError
from shardserve.client.info import RankStatus, TensorSummary
from shardserve.core.metadata import Box
from shardserve.protos.errors import Reason

if TYPE_CHECKING:
    from shardserve.client.paths.device_mapping import DeviceMapping
    from shardserve.client.paths.hedging import Cancellation
    from shardserve.client.paths.segments import HostMapping
    from shardserve.client.paths.writes import ShardWrite
    from shardserve.protos import shardserve_pb2 as pb

TRANSPORTS = ("auto", "grpc", "shm", "bulk")
DEPRECATED_TRANSPORTS = {"tcp": "bulk"}  # old transport= names, still accepted
# The reasons that say a path cannot serve us (not that the request is wrong): the chain tries the next path.
PATH_REFUSALS = frozenset({Reason.PATH_UNAVAILABLE, Reason.OVERLOADED})


class PathKind(str, enum.Enum):
    """A data path, valued by its user-facing name (transport=..., last_transport, counters)."""

    SHARED_MEMORY = "shm"
    BULK = "bulk"
    GRPC = "grpc"

    def __str__(self) -> str:
        return self.value


def parse_transport(transport: object) -> PathKind | None:
    """The forced PathKind of a `transport=` string, None for "auto"; ValueError naming the parameter otherwise.
    A deprecated name ("tcp") is taken for its new one with a DeprecationWarning."""
    if isinstance(transport, str) and transport in DEPRECATED_TRANSPORTS:
        renamed = DEPRECATED_TRANSPORTS[transport]
        warnings.warn(
            f"transport={transport!r} is deprecated; use transport={renamed!r}",
            DeprecationWarning,
            stacklevel=3,
        )
        transport = renamed
    if transport not in TRANSPORTS:
        raise ValueError(
            f"transport must be one of {', '.join(map(repr, TRANSPORTS))}, got {transport!r}"
        )
    return None if transport == "auto" else PathKind(transport)


def path_refused(err: BaseException) -> bool:
    """Whether `err` says the path that raised it cannot serve (fall back to the next one), by its reason."""
    return isinstance(err, ShardServeError) and err.reason in PATH_REFUSALS


@dataclass(frozen=True)
class PartRead:
    """One part of a read: global box `part` of shard `index` of `summary`, landing in `region` (its place in the
    output, any strides or device, of the tensor's dtype or, for a cast in flight, another floating one);
    `only_part` when it is the read's only part (a large one may then be read as parallel bands). `checksums`
    (a verified read's): where a path that hashes the bytes as it copies them keeps the checksum of the bytes
    that landed for a part that is its whole shard, by shard index (client.verify then need not read them
    again); a path that does not hash leaves it alone."""

    summary: TensorSummary
    index: int
    part: Box
    region: torch.Tensor
    only_part: bool = False
    checksums: dict[int, int] | None = None

    @property
    def nbytes(self) -> int:
        """The bytes the part moves (of the tensor's dtype, whatever the region's)."""
        return self.part.numel() * self.summary.metadata.tensor_properties.itemsize


CPU_ONLY = frozenset({"cpu"})
CPU_AND_CUDA = frozenset({"cpu", "cuda"})


@dataclass(frozen=True)
class Capabilities:
    """What a path can do beyond reading parts and writing shards; each flag promises one protocol's methods.

    `devices`: the device types of the shards it reaches ("cpu", "cuda"). `maps_memory`: it reads a rank's
    shard memory in place, with no request per byte (same host: a read plan treats such parts as free).
    `row_reads`: rows of a 2-D shard and the shard's mappings (RowReads). `in_place_writes`: writes straight
    into shard memory a rank opens for this client's host id (InPlaceWrites). `rank_calls`: the rank answers
    its Lookup and ReadRegions calls on it (RankCalls). `pipelined`: a call is sent now and its answer taken
    later, so requests to several ranks go out before any answer is awaited (PipelinedCalls). `streamed`: a
    call is made whole on the calling thread, an answer of any size streaming in (StreamedCalls)."""

    devices: frozenset[str] = CPU_ONLY
    maps_memory: bool = False
    row_reads: bool = False
    in_place_writes: bool = False
    rank_calls: bool = False
    pipelined: bool = False
    streamed: bool = False

    def reaches(self, device_type: str) -> bool:
        """Whether shards on devices of `device_type` ("cpu", "cuda") are read by this path."""
        return device_type in self.devices


class DataPath(Protocol):
    """What every data path does: say whether it may serve a rank, read a part, write whole shards, close; and
    declare its Capabilities."""

    @property
    def kind(self) -> PathKind: ...

    @property
    def capabilities(self) -> Capabilities: ...

    def supports(self, rank: RankStatus, summary: TensorSummary | None = None) -> bool:
        """Whether this path may serve `rank` (for `summary`'s tensor when given) at all."""
        ...

    def refusal(self, rank: RankStatus) -> ShardServeError:
        """The error of a call to `rank` that this path, forced, cannot serve (why `supports` says no)."""
        ...

    def read(self, address: str, read: PartRead, cancel: Cancellation | None = None) -> None:
        """Copy the part from the rank at `address` into its region; `cancel` can stop it from another
        thread."""
        ...

    def write_shards(self, address: str, writes: Sequence[ShardWrite]) -> int:
        """Write whole shards to the rank at `address`; returns the bytes written."""
        ...

    def close(self) -> None:
        """Let go of what the path keeps (connections, mappings, staging files): its client is closing."""
        ...


class RowReads(DataPath, Protocol):
    """A path with `row_reads`: rows of a 2-D shard, and the shard itself mapped for gathers in place."""

    def read_rows(
        self, address: str, summary: TensorSummary, index: int, local_rows: torch.Tensor
    ) -> torch.Tensor:
        """Rows `local_rows` of shard `index` of a 2-D table, as a CPU tensor [len(local_rows), columns]."""
        ...

    def host_mapping(self, address: str, summary: TensorSummary, index: int) -> HostMapping | None:
        """Shard `index` mapped from host memory (None: not a host shard, or empty)."""
        ...

    def device_mapping(
        self, address: str, summary: TensorSummary, index: int
    ) -> DeviceMapping | None:
        """Shard `index` mapped on its CUDA device (None: not a CUDA shard, or empty)."""
        ...

    def limit(self, address: str) -> int:
        """The rank's max_request_bytes as it last said (0: no limit, or not known yet)."""
        ...


class InPlaceWrites(DataPath, Protocol):
    """A path with `in_place_writes`: ranks open shards for writes in place by the writer's host id."""

    @property
    def in_place_host_id(self) -> str: ...

    def write_bytes(
        self, address: str, request: pb.WriteBytesRequest, pieces: Sequence[torch.Tensor]
    ) -> int:
        """WriteBytes of `request`'s ranges with their bytes (`pieces`: flat uint8 CPU tensors, one per range)
        passed through memory the rank reads; returns the bytes written. A path refusal (PATH_UNAVAILABLE) when
        the rank cannot read it."""
        ...


class RankCalls(DataPath, Protocol):
    """A path with `rank_calls`: the rank answers ReadRegions (and Lookup) calls on it."""

    def read_regions(
        self, address: str, request: pb.ReadRegionsRequest, reply_bytes: int
    ) -> pb.ReadRegionsReply:
        """ReadRegions' answer to `request` (at most `reply_bytes` serialized)."""
        ...


class StreamedCalls(RankCalls, Protocol):
    """A path with `streamed` calls: made whole on the calling thread, an answer of any size streaming in."""

    def lookup(
        self,
        address: str,
        request: pb.LookupRequest,
        answer_bytes: int,
        take: Callable[[Any], None],
        where: str,
        cancel: Cancellation | None = None,
    ) -> None:
        """The Lookup call of `request`: `take(chunk)` gets every RawLookupChunk of its answer."""
        ...


class PipelinedCalls(RankCalls, Protocol):
    """A path with `pipelined` calls: sent now, each answer taken later by the call returned."""

    def send_read(
        self,
        address: str,
        request: pb.ReadRegionRequest,
        dest: torch.Tensor,
        cancel: Cancellation | None = None,
    ) -> Callable[[], None]:
        """Send the read of `request` now; the call returned takes its bytes into `dest` (flat uint8 CPU)."""
        ...

    def send_lookup(
        self,
        address: str,
        request: pb.LookupRequest,
        reply_bytes: int,
        cancel: Cancellation | None = None,
    ) -> Callable[[], bytearray]:
        """Send `request` now; the call returned takes its serialized LookupReply."""
        ...

    def send_read_regions(
        self,
        address: str,
        request: pb.ReadRegionsRequest,
        reply_bytes: int,
        cancel: Cancellation | None = None,
    ) -> Callable[[], pb.ReadRegionsReply]:
        """Send `request` now; the call returned takes its ReadRegions answer (at most `reply_bytes`
        serialized)."""
        ...


def row_reads(path: DataPath | None) -> RowReads | None:
    """`path` as a RowReads when it declares row reads, else None."""
    return cast(RowReads, path) if path is not None and path.capabilities.row_reads else None


def in_place_writes(path: DataPath) -> InPlaceWrites | None:
    """`path` as an InPlaceWrites when it declares writes in place, else None."""
    return cast(InPlaceWrites, path) if path.capabilities.in_place_writes else None


def rank_calls(path: DataPath) -> RankCalls:
    """`path` as RankCalls; ValueError when it does not declare them (a chain of calls holds only such)."""
    if not path.capabilities.rank_calls:
        raise ValueError(f"the {path.kind} path does not take rank calls")
    return cast(RankCalls, path)


def streamed(path: DataPath) -> StreamedCalls | None:
    """`path` as StreamedCalls when it declares streamed calls, else None."""
    if not (path.capabilities.streamed and path.capabilities.rank_calls):
        return None
    return cast(StreamedCalls, path)


def pipelined(path: DataPath | None) -> PipelinedCalls | None:
    """`path` as PipelinedCalls when it declares pipelined calls, else None."""
    if path is None or not (path.capabilities.pipelined and path.capabilities.rank_calls):
        return None
    return cast(PipelinedCalls, path)
