"""What the coordinator keeps: tensor versions and snapshots as frozen dataclasses, apart from the wire types.

The catalog stores these records in its own schema (server/coordinator/catalog/sqlite.py) and the coordinator's
logic works on them; protobuf messages are made from them only at the edges: the servicer's answers
(server/coordinator/answers.py, with the fields that describe live state) and the calls to ranks
(server/coordinator/ranks/calls.py).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from shardserve.core.checksums import UNKNOWN
from shardserve.core.metadata import Box, ShardedTensorMetadata
from shardserve.core.tensor_options import TensorOptions

# What ranks answer a promote with: the checksum of each shard, by (name, version) then shard index.
ShardChecksums = dict[tuple[str, int], dict[int, int]]


class TensorState(enum.Enum):
    """A version's state: PENDING (allocated, being written, invisible to readers) or READY (served)."""

    PENDING = "pending"
    READY = "ready"


_STATES = {state.value: state for state in TensorState}


def state_of(value: str) -> TensorState:
    """The state a row names (a dict lookup: TensorState(value) costs several times as much, and listing or
    reconciling ten thousand rows asks it ten thousand times); ValueError for a value that is no state."""
    state = _STATES.get(value)
    if state is None:
        raise ValueError(f"{value!r} is not a TensorState")
    return state


class Versioned:
    """What a row's name, version and state say of it (TensorRecord and PlacedVersion have them)."""

    name: str
    version: int
    state: TensorState

    @property
    def key(self) -> tuple[str, int]:
        """(name, version): the version's key in promote answers (ShardChecksums)."""
        return (self.name, self.version)

    @property
    def ready(self) -> bool:
        """Whether the version is READY (committed and served)."""
        return self.state is TensorState.READY


@dataclass(frozen=True, slots=True)
class PlacedVersion(Versioned):
    """A row's name, version and state, without its record: what the reconcile of a rank reads of every
    version placed on it (decoding each record would cost ~10 times as much)."""

    name: str
    version: int
    state: TensorState


class Init(enum.Enum):
    """How a new version's shards are filled on the ranks: written by the client (NONE), a constant or
    generated fill, or a copy of the READY version (COPY: row updates)."""

    NONE = "none"
    ZEROS = "zeros"
    ONES = "ones"
    NORMAL = "normal"
    ARANGE = "arange"
    COPY = "copy"


@dataclass(frozen=True)
class TensorRecord(Versioned):
    """One version of a tensor as the catalog keeps it.

    `promoting`: READY in the catalog, not yet promoted on every rank (a reshard's commit in flight).
    `lost_shards`: indices of the shards whose copy a rank lost (it registered again without them).
    `owner`: the principal whose bytes quota the version counts against.
    `checksums`: the xxh3-64 of each shard's bytes by shard index, as its rank reported it when promoting
    (shardserve.core.checksums); empty, or UNKNOWN for one shard, where not known.
    `reserved`: made PENDING as a reservation of its writer's next put (CreateTensorRequest.reserve): while
    pending, any create of the name drops it, and it holds no other create back (the flag means nothing once the
    version is committed).
    `creator`: for a snapshot's tensor (named PREFIX@NUMBER/KEY), the id of the coordinator that created it (a
    random id per CoordinatorServer: one per process and term led); empty for any other tensor. A pending
    snapshot lives in the memory of that coordinator, which alone can commit it: another one aborts such a
    PENDING version at once instead of after the pending timeout.
    """

    name: str
    version: int
    metadata: ShardedTensorMetadata
    state: TensorState = TensorState.PENDING
    options: TensorOptions = field(default_factory=TensorOptions)
    created_unix: float = 0.0
    put_token: str = ""
    owner: str = ""
    promoting: bool = False
    lost_shards: tuple[int, ...] = ()
    checksums: tuple[int, ...] = ()
    reserved: bool = False
    creator: str = ""

    @property
    def nbytes(self) -> int:
        """The bytes of one copy of the tensor."""
        return self.metadata.nbytes

    @property
    def held_bytes(self) -> int:
        """The bytes the version holds over all its ranks (replicas counted each)."""
        return self.metadata.shards_nbytes()

    def ranks(self) -> list[int]:
        """Distinct ranks holding shards of the version."""
        return list(self.metadata.ranks())

    def holding_ranks(self) -> list[int]:
        """Distinct ranks holding a copy that is not lost (those that allocate and promote it)."""
        if not self.lost_shards:
            return list(self.metadata.ranks())
        lost = set(self.lost_shards)
        shards = self.metadata.shards_metadata
        return sorted({s.rank for i, s in enumerate(shards) if i not in lost})

    def with_checksums(self, found: Mapping[int, int], *, ready: bool = False) -> TensorRecord:
        """This version with the checksums its ranks reported (by shard index) added to those it had (and
        READY, with `ready`: the record a commit writes, made in one step)."""
        state = TensorState.READY if ready else self.state
        if not found:
            return self if state is self.state else replace(self, state=state)
        count = len(self.metadata.shards_metadata)
        known = list(self.checksums) or [UNKNOWN] * count
        for index, value in found.items():
            if 0 <= index < count:
                known[index] = value
        return replace(self, checksums=tuple(known), state=state)

    def with_lost(self, shards: Iterable[int]) -> TensorRecord:
        """This version with `shards` added to its lost copies."""
        return replace(self, lost_shards=tuple(sorted(set(self.lost_shards) | set(shards))))


@dataclass(frozen=True)
class SnapshotEntry:
    """One tensor of a snapshot: its key in the state dict and its version (named PREFIX@NUMBER/KEY)."""

    key: str
    tensor: TensorRecord


@dataclass(frozen=True)
class SnapshotRecord:
    """Many tensors of one prefix committed together; `keep` snapshots of the prefix are kept."""

    prefix: str
    number: int
    keep: int
    entries: tuple[SnapshotEntry, ...]
    state: TensorState = TensorState.PENDING
    created_unix: float = 0.0
    # The state dict's tree besides its tensors (typed JSON; shardserve.core.state_tree), "" for tensors only.
    skeleton: str = ""
    delta_of: int = 0  # a delta put's: the snapshot whose tensors it copied
    # a delta put's: bytes of one copy of its tensors still shared with `delta_of`'s when it was committed
    shared_nbytes: int = 0

    @property
    def nbytes(self) -> int:
        """The bytes of one copy of every tensor."""
        return sum(entry.tensor.nbytes for entry in self.entries)

    def tensors(self) -> list[TensorRecord]:
        """The snapshot's tensor versions, in entry order."""
        return [entry.tensor for entry in self.entries]

    def sharing(self, shared: Mapping[tuple[str, int], Mapping[int, int]]) -> SnapshotRecord:
        """This snapshot with `shared_nbytes` from what the ranks' promote answered (the bytes each local shard
        of a copy still shares, by (name, version) then shard index): each box counted once, whatever its
        replicas."""
        total = 0
        for tensor in self.tensors():
            by_shard = shared.get(tensor.key, {})
            by_box: dict[Box, int] = {}
            for index, shard in enumerate(tensor.metadata.shards_metadata):
                by_box[shard.box] = max(by_box.get(shard.box, 0), by_shard.get(index, 0))
            total += sum(by_box.values())
        return replace(self, shared_nbytes=total)

    def committed(self, checksums: ShardChecksums) -> SnapshotRecord:
        """This snapshot READY, each tensor READY with the shard checksums found for it in `checksums`."""
        entries = tuple(
            SnapshotEntry(
                e.key, e.tensor.with_checksums(checksums.get(e.tensor.key, {}), ready=True)
            )
            for e in self.entries
        )
        return replace(self, state=TensorState.READY, entries=entries)


@dataclass(frozen=True)
class CatalogContents:
    """Everything a catalog keeps, as `shardserve catalog copy` moves it from one store to another: every
    tensor row (PENDING ones too), every committed snapshot, and the version counter (the highest version
    number handed out or reserved)."""

    tensors: tuple[TensorRecord, ...]
    snapshots: tuple[SnapshotRecord, ...]
    version_counter: int
