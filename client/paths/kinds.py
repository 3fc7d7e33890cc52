"""The one interface of the client's data paths: PathKind names a path, DataPath is what every path does.

A path reads one part of a shard into a destination tensor, writes a batch of whole shards to a rank, and says
whether it may serve a rank at all (`supports`). The shared-memory (client.paths.shm), bulk-port
(client.paths.bulk) and gRPC (client.paths.grpc) paths implement it; client.paths.chain tries them in order.
`transport=` strings ("auto", "shm", "tcp", "grpc") are parsed into a PathKind once, at the API edge.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from shardserve.client.errors import ShardServeError
from shardserve.client.info import RankStatus, TensorSummary
from shardserve.core.metadata import Box
from shardserve.protos.errors import Reason

if TYPE_CHECKING:
    from shardserve.client.paths.hedging import Cancellation
    from shardserve.client.paths.writes import ShardWrite

TRANSPORTS = ("auto", "grpc", "shm", "tcp")
# The reasons that say a path cannot serve us (not that the request is wrong): the chain tries the next path.
PATH_REFUSALS = frozenset({Reason.PATH_UNAVAILABLE, Reason.OVERLOADED})


class PathKind(str, enum.Enum):
    """A data path, valued by its user-facing name (transport=..., last_transport, counters)."""

    SHARED_MEMORY = "shm"
    BULK = "tcp"
    GRPC = "grpc"

    def __str__(self) -> str:
        return self.value


def parse_transport(transport: object) -> PathKind | None:
    """The forced PathKind of a `transport=` string, None for "auto"; ValueError naming the parameter otherwise."""
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
    output, any strides or device); `only_part` when it is the read's only part (a large one may then be read
    as parallel bands)."""

    summary: TensorSummary
    index: int
    part: Box
    region: torch.Tensor
    only_part: bool = False

    @property
    def nbytes(self) -> int:
        return self.part.numel() * self.region.element_size()


class DataPath(Protocol):
    """What every data path does: say whether it may serve a rank, read a part, write whole shards."""

    @property
    def kind(self) -> PathKind: ...

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
