"""The versions one rank holds and the one state machine of a version's life.

    RESERVED --FILL--> PENDING --PROMOTE--> SERVED --REPLACE--> GRACED
        \\                \\                   \\                  |
         +-------DROP------+-------DROP--------+------DROP--------+--> DROPPED --FREE--> FREED

RESERVED: accounted against the memory budget, its shards to come whole from a collective job (a reshard, a
checkpoint load). PENDING: its shards are in place and being written; only then may it change. SERVED:
promoted, readable, never written again (promoting again changes nothing). GRACED: served, but a newer served
version replaced it and it was dropped; still readable until its grace period ends (or its memory is
needed). DROPPED: unreadable; its memory stays while a lease (a read in flight) holds it. FREED: its memory
is given back and it is out of the table. Every change of state goes through `VersionEvent`s and the one
`TRANSITIONS` table; any other change raises InvalidState.

Two things are counters rather than states, because they overlap freely: the leases on a version (reads and
changes in flight, any number at once, in any live state) and, per local shard of a pending version, its
writes (`ShardProgress`: complete, being changed by N writers, torn by a change that failed).
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.tensor_options import TensorOptions
from shardserve.server.rank.errors import (
    InvalidArgument,
    InvalidState,
    StaleVersion,
    TensorBusy,
    TensorNotFound,
    WriteIncomplete,
)

DROPPED_KEPT = (
    4096  # (name, version) pairs remembered as dropped, so a late allocation of one is refused
)


class VersionState(enum.Enum):
    RESERVED = "reserved"
    PENDING = "pending"
    SERVED = "served"
    GRACED = "graced"
    DROPPED = "dropped"
    FREED = "freed"

    @property
    def is_pending(self) -> bool:
        """Not served yet: it may still change (once its shards are in place)."""
        return self in (VersionState.RESERVED, VersionState.PENDING)

    @property
    def is_served(self) -> bool:
        """Readable: served, or replaced and in its grace period."""
        return self in (VersionState.SERVED, VersionState.GRACED)

    @property
    def is_live(self) -> bool:
        """Not dropped: held for readers or writers."""
        return self not in (VersionState.DROPPED, VersionState.FREED)


class VersionEvent(enum.Enum):
    FILL = "fill"  # a collective job put a reservation's shards in place
    PROMOTE = "promote"  # every local shard written: serve it
    REPLACE = "replace"  # dropped while a newer version is served: readable for the grace period
    DROP = "drop"  # unreadable from now on
    FREE = "free"  # dropped and no lease left: its memory goes back


_S, _E = VersionState, VersionEvent
TRANSITIONS: dict[tuple[VersionState, VersionEvent], VersionState] = {
    (_S.RESERVED, _E.FILL): _S.PENDING,
    (_S.RESERVED, _E.DROP): _S.DROPPED,
    (_S.PENDING, _E.PROMOTE): _S.SERVED,
    (_S.PENDING, _E.DROP): _S.DROPPED,
    (_S.SERVED, _E.PROMOTE): _S.SERVED,
    (_S.SERVED, _E.REPLACE): _S.GRACED,
    (_S.SERVED, _E.DROP): _S.DROPPED,
    (_S.GRACED, _E.PROMOTE): _S.GRACED,
    (_S.GRACED, _E.REPLACE): _S.GRACED,
    (_S.GRACED, _E.DROP): _S.DROPPED,
    (_S.DROPPED, _E.DROP): _S.DROPPED,
    (_S.DROPPED, _E.FREE): _S.FREED,
}


def next_state(state: VersionState, event: VersionEvent) -> VersionState:
    """The state `event` leads to from `state`; InvalidState when the table has no such step."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise InvalidState(
            f"a {state.value} version cannot {event.value}", metadata={"state": state.value}
        ) from None


@dataclass
class ShardProgress:
    """Which local shards of a pending version are fully written. A promote waits for every change of every
    shard to end, and refuses a shard that a change left half done (torn) until a later change that starts
    with the shard idle completes it: one writer finishing a shard must not promote it while, or after,
    another one wrote part of it and failed."""

    complete: set[int] = field(default_factory=set)
    changing: Counter[int] = field(
        default_factory=Counter
    )  # shard -> open writes or rewrites of it
    torn: set[int] = field(default_factory=set)
    in_place: set[int] = field(
        default_factory=set
    )  # handed to a same-host writer that fills them itself

    def is_changing(self, index: int) -> bool:
        return self.changing[index] > 0

    def open_change(self, index: int) -> bool:
        """Count one more change of shard `index` (not complete meanwhile); whether it was complete."""
        if not self.changing[index]:  # a fresh round of changes: earlier failures are overwritten
            self.torn.discard(index)
        self.in_place.discard(index)  # bytes sent now win over an in-place writer's
        was_complete = index in self.complete
        self.complete.discard(index)
        self.changing[index] += 1
        return was_complete

    def close_change(self, index: int, outcome: bool | None) -> None:
        """End one change of shard `index`: None (it failed) leaves the shard torn, True makes it complete,
        False leaves it as incomplete as it was."""
        self.changing[index] -= 1
        if outcome is None:
            self.torn.add(index)
            self.complete.discard(index)
        elif outcome:
            self.complete.add(index)

    def open_in_place(self, index: int) -> None:
        """Hand shard `index` to a writer that fills its memory directly: torn (never promoted) until that
        writer says it is done (`finish_in_place`), so nothing a writer that dies half way wrote is promoted."""
        self.complete.discard(index)
        self.torn.add(index)
        self.in_place.add(index)

    def finish_in_place(self, index: int) -> bool:
        """Count shard `index`, handed to an in-place writer, as fully written; False when it was not handed
        to one (or bytes sent since then took it back)."""
        if index not in self.in_place:
            return False
        self.in_place.discard(index)
        self.torn.discard(index)
        self.complete.add(index)
        return True

    def mark_filled(self, indexes: Iterable[int]) -> None:
        """Count shards an allocation filled as complete, unless a change of them is open or failed meanwhile."""
        self.complete.update(i for i in indexes if not self.changing[i] and i not in self.torn)

    def unfinished(self, local: Iterable[int]) -> list[int]:
        """The shards of `local` not fully written, being changed or torn."""
        changing = {index for index, writes in self.changing.items() if writes}
        return sorted((set(local) - self.complete) | changing | self.torn)


@dataclass
class StoredVersion:
    """One (name, version) on a rank: its local shards, its state and its leases."""

    name: str
    version: int
    metadata: ShardedTensorMetadata
    options: TensorOptions
    nbytes: int  # bytes the budget holds for it (shared blocks are accounted apart)
    shards: dict[int, torch.Tensor] = field(default_factory=dict)
    progress: ShardProgress = field(default_factory=ShardProgress)
    state: VersionState = VersionState.PENDING
    leases: int = 0
    grace_until: float | None = None  # GRACED until then (monotonic seconds)
    checksums: dict[int, int] = field(
        default_factory=dict
    )  # local shard -> xxh3-64, set when promoted
    # local shard of a copy -> its bytes still shared with the version it was copied from, set when promoted
    shared: dict[int, int] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, int]:
        return (self.name, self.version)

    def apply(self, event: VersionEvent) -> None:
        """Move to the state `event` leads to (InvalidState when none)."""
        self.state = next_state(self.state, event)

    def local_shard(self, shard_index: int, rank: int) -> torch.Tensor:
        """The tensor of local shard `shard_index`: InvalidArgument when the tensor has no such shard or another
        rank holds it, InvalidState when a collective job brings it."""
        count = len(self.metadata.shards_metadata)
        if not 0 <= shard_index < count:
            raise InvalidArgument(
                f"shard_index {shard_index} is out of range: tensor {self.name!r} has {count} shards",
                metadata={"tensor": self.name, "field": "shard_index"},
            )
        if shard_index not in self.shards:
            if shard_index in self.metadata.shards_on(rank):
                raise InvalidState(
                    f"shard_index {shard_index} of tensor {self.name!r} version {self.version} is "
                    f"reserved for a reshard or checkpoint load on rank {rank}; its data arrives with "
                    f"that job, not by a write",
                    metadata={"tensor": self.name, "rank": rank},
                )
            raise InvalidArgument(
                f"shard_index {shard_index} of tensor {self.name!r} is not held by rank {rank} "
                f"(local shards: {sorted(self.shards)})",
                metadata={"tensor": self.name, "rank": rank, "field": "shard_index"},
            )
        return self.shards[shard_index]


class VersionTable:
    """Every version a rank holds, by (name, version), and the ones dropped lately; which one a call means and
    whether it may have it. Not thread-safe: the store calls it under its lock."""

    def __init__(self, rank: int, dropped_kept: int = DROPPED_KEPT) -> None:
        self.rank = rank
        self._records: dict[tuple[str, int], StoredVersion] = {}
        self._by_name: dict[str, dict[int, StoredVersion]] = {}  # the same records, found by name
        self._dropped: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._dropped_kept = dropped_kept

    def add(self, record: StoredVersion) -> None:
        """Hold a new version: InvalidState when it is held, TensorBusy when it was dropped (an allocation
        that lost a race with its abort: versions never come back)."""
        if record.key in self._records:
            raise InvalidState(
                f"tensor {record.name!r} version {record.version} is already allocated on rank "
                f"{self.rank}",
                metadata={"tensor": record.name, "rank": self.rank},
            )
        if record.key in self._dropped:
            raise TensorBusy(
                f"tensor {record.name!r} version {record.version} was dropped on rank {self.rank} "
                f"before this allocation arrived (aborted)",
                metadata={"tensor": record.name, "rank": self.rank},
            )
        self._records[record.key] = record
        self._by_name.setdefault(record.name, {})[record.version] = record

    def discard(self, record: StoredVersion) -> bool:
        """Forget `record` (an allocation that failed, or a freed version); whether it was held."""
        if self._records.get(record.key) is not record:
            return False
        del self._records[record.key]
        versions = self._by_name[record.name]
        del versions[record.version]
        if not versions:
            del self._by_name[record.name]
        return True

    def remember_dropped(self, name: str, version: int) -> None:
        """Keep (name, version) as dropped, the latest `dropped_kept` of them, so a late allocation of it (an
        AllocateShards overtaken by its abort's DropVersion) is refused instead of held for nobody."""
        self._dropped[(name, version)] = None
        while len(self._dropped) > self._dropped_kept:
            self._dropped.popitem(last=False)

    def matching(self, name: str, version: int) -> list[StoredVersion]:
        """Every held record of `name` (dropped ones still leased included), or of one version (0 = all)."""
        versions = self._by_name.get(name, {})
        if version == 0:
            return list(versions.values())
        return [versions[version]] if version in versions else []

    def records(self) -> list[StoredVersion]:
        return list(self._records.values())

    def live(self) -> list[StoredVersion]:
        """The records not dropped."""
        return [r for r in self._records.values() if r.state.is_live]

    def get(self, name: str, version: int) -> StoredVersion:
        """The live (name, version): TensorNotFound when no version of `name` is held, else StaleVersion."""
        record = self._records.get((name, version))
        if record is not None and record.state.is_live:
            return record
        if not any(r.state.is_live for r in self._by_name.get(name, {}).values()):
            raise TensorNotFound(
                f"tensor {name!r} not found on rank {self.rank}",
                metadata={"tensor": name, "rank": self.rank},
            )
        raise StaleVersion(
            f"tensor {name!r} version {version} is not held on rank {self.rank}; "
            f"{self._served_phrase(name)}",
            metadata={"tensor": name, "rank": self.rank},
        )

    def pending(self, name: str, version: int) -> StoredVersion:
        """The pending (name, version): InvalidState once it is served, as served versions never change."""
        record = self.get(name, version)
        if not record.state.is_pending:
            raise InvalidState(
                f"tensor {name!r} version {version} is already committed; "
                f"create a new version to change it",
                metadata={"tensor": name},
            )
        return record

    def served(self, name: str, version: int) -> StoredVersion:
        """The served (name, version), version 0 meaning the newest served one; StaleVersion otherwise."""
        if version == 0:
            newest = self._newest_served(name)
            if newest is not None:
                return newest
        record = self.get(name, version)
        if not record.state.is_served:
            raise StaleVersion(
                f"tensor {name!r} version {version} is not served here; {self._served_phrase(name)}",
                metadata={"tensor": name, "rank": self.rank},
            )
        return record

    def promotable(self, name: str, version: int) -> StoredVersion:
        """The live (name, version) with every local shard fully written and no change open (WriteIncomplete
        naming the others)."""
        record = self.get(name, version)
        missing = record.progress.unfinished(record.metadata.shards_on(self.rank))
        if missing:
            raise WriteIncomplete(
                f"tensor {name!r} version {version}: shards {missing} on rank {self.rank} "
                f"are not fully written",
                metadata={"tensor": name, "rank": self.rank},
            )
        return record

    def replaced(self, record: StoredVersion) -> bool:
        """Whether `record` is served and a newer version of its tensor is served too."""
        newest = self._newest_served(record.name)
        return record.state.is_served and newest is not None and newest.version > record.version

    def lease(self, record: StoredVersion) -> None:
        """One more lease (a read or change in flight) holds `record`."""
        record.leases += 1

    def unlease(self, record: StoredVersion) -> bool:
        """One lease less; True when that was the last one of a dropped version, which is freed now (out of
        the table: the caller gives its memory back)."""
        record.leases -= 1
        return self.free_if_unleased(record)

    def free_if_unleased(self, record: StoredVersion) -> bool:
        """Free a dropped version no lease holds (out of the table); whether it was."""
        if record.state is not VersionState.DROPPED or record.leases or not self.discard(record):
            return False
        record.apply(VersionEvent.FREE)
        return True

    def _newest_served(self, name: str) -> StoredVersion | None:
        served = [r for r in self._by_name.get(name, {}).values() if r.state.is_served]
        return max(served, key=lambda r: r.version) if served else None

    def _served_phrase(self, name: str) -> str:
        newest = self._newest_served(name)
        return f"served version is {newest.version}" if newest else "no version is served yet"
