"""ShardStore: the shards one rank holds, keyed by (name, version) and shard index.

A version is PENDING from allocation until every local shard is written and
it is promoted, then SERVED. Memory is accounted against a limit when
allocated and released when a version is dropped and no read or write still
holds a lease on it (a small reference count per version), so a dropped
version stays whole for the reads already in flight. A served version that a
newer one replaces stays served for `version_grace` seconds more (a grace
period), so reads that began on it finish there instead of failing; the
grace ends early when its memory is needed. No network, no threads
of its own: the servicer calls in from gRPC worker threads, so every method is
thread-safe.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from shardserve.core.dtypes import dtype_name
from shardserve.core.metadata import Box, ShardedTensorMetadata
from shardserve.core.regions import local_view
from shardserve.core.wire import byte_view
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.common.errors import (
    InvalidArgument,
    InvalidState,
    MemoryLimit,
    NotFound,
    RequestTooLarge,
    StaleVersion,
    TensorBusy,
    WriteIncomplete,
)
from shardserve.server.common.requests import check_init
from shardserve.server.rank.blocks import Blocks
from shardserve.server.rank.metrics import RankMetrics
from shardserve.server.rank.persistence import Persistence, RestoreCount
from shardserve.server.rank.recycling import DEFAULT_MAX_BYTES as DEFAULT_RECYCLE_BYTES
from shardserve.server.rank.recycling import RecycledBuffers
from shardserve.server.rank.shared_memory import Segment, SharedMemory, enabled_by_env

log = logging.getLogger(__name__)

DEFAULT_VERSION_GRACE_S = (
    2.0  # a replaced served version stays readable this long (rank flag --version-grace)
)
DROPPED_KEPT = (
    4096  # (name, version) pairs remembered as dropped, so a late allocation of one is refused
)


class VersionState(enum.Enum):
    PENDING = "pending"
    SERVED = "served"


@dataclass
class StoredVersion:
    """One (name, version) on this rank: its local shards and bookkeeping."""

    name: str
    version: int
    metadata: ShardedTensorMetadata
    options: pb.TensorOptions
    nbytes: int
    shards: dict[int, torch.Tensor] = field(default_factory=dict)
    complete: set[int] = field(default_factory=set)
    changing: Counter[int] = field(
        default_factory=Counter
    )  # local shard -> open writes/rewrites of it
    torn: set[int] = field(
        default_factory=set
    )  # local shards a change left half done since they were last idle
    state: VersionState = VersionState.PENDING
    leases: int = 0
    dropped: bool = False
    grace_until: float | None = None  # replaced but still served until then (monotonic seconds)


def _row_major_strides(size: tuple[int, ...]) -> list[int]:
    strides, step = [], 1
    for n in reversed(size):
        strides.append(step)
        step *= max(n, 1)
    return strides[::-1]


def arange_box(size: tuple[int, ...], box: Box, dtype: torch.dtype) -> torch.Tensor:
    """The global row-major linear index of every element of `box`, cast to `dtype`."""
    index = torch.zeros(box.sizes, dtype=torch.int64)
    for d, (offset, length, stride) in enumerate(
        zip(box.offsets, box.sizes, _row_major_strides(size))
    ):
        shape = [1] * len(box.sizes)
        shape[d] = length
        index += (torch.arange(offset, offset + length, dtype=torch.int64) * stride).view(shape)
    return index.to(dtype)


def _normal_seed_index(meta: ShardedTensorMetadata, index: int) -> int:
    """Index of the first shard with the same box, so replicas draw the same numbers."""
    box = meta.shards_metadata[index].box
    return next(i for i, s in enumerate(meta.shards_metadata) if s.box == box)


def make_shard(
    meta: ShardedTensorMetadata,
    index: int,
    init: int,
    seed: int,
    device: torch.device,
    empty: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """A new C-contiguous tensor for shard `index`, filled as `init` says (in `empty(sizes, dtype)` if given)."""
    shard = meta.shards_metadata[index]
    dtype, sizes = meta.dtype, shard.shard_sizes
    if empty is not None:
        tensor = empty(sizes, dtype)
        if init != pb.INIT_NONE and init != pb.INIT_ZEROS:  # `empty` zero-fills
            tensor.copy_(make_shard(meta, index, init, seed, device))
        return tensor
    if init == pb.INIT_ZEROS:
        return torch.zeros(sizes, dtype=dtype, device=device)
    if init == pb.INIT_ONES:
        return torch.ones(sizes, dtype=dtype, device=device)
    if init == pb.INIT_NORMAL:
        generator = torch.Generator().manual_seed(seed + _normal_seed_index(meta, index))
        return torch.randn(sizes, dtype=dtype, generator=generator).to(device)
    if init == pb.INIT_ARANGE:
        return arange_box(meta.size, shard.box, dtype).to(device)
    return torch.empty(sizes, dtype=dtype, device=device)


def device_capacity(device: torch.device) -> int:
    """Total memory of the device (physical RAM for cpu): no allocation may exceed it, limit or not."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


class ShardStore:
    """The shards of one rank under (name, version), with memory accounting and read leases."""

    def __init__(
        self,
        rank: int,
        device: str = "cpu",
        memory_limit: int = 0,
        max_request_bytes: int = 0,
        shared_memory: bool | None = None,
        recycle_bytes: int = DEFAULT_RECYCLE_BYTES,
        version_grace: float = DEFAULT_VERSION_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
        persistence: Persistence | None = None,
    ) -> None:
        if not version_grace >= 0:
            raise ValueError(f"version_grace must be >= 0 seconds, got {version_grace}")
        if memory_limit < 0:
            raise ValueError(f"memory_limit must be >= 0 (0 = unlimited), got {memory_limit}")
        if max_request_bytes < 0:
            raise ValueError(
                f"max_request_bytes must be >= 0 (0 = unlimited), got {max_request_bytes}"
            )
        self.rank = rank
        self.device = torch.device(device)
        self.memory_limit = memory_limit
        self._capacity = device_capacity(self.device)
        self.max_request_bytes = max_request_bytes
        self.version_grace = version_grace
        self._clock = clock
        self._lock = threading.Lock()
        self._versions: dict[tuple[str, int], StoredVersion] = {}
        self._dropped: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._memory_used = 0
        # CPU shards live in shared memory (same-host data plane) unless turned off; see server/rank/shared_memory.py
        use_shared = enabled_by_env() if shared_memory is None else shared_memory
        self.shared = SharedMemory(
            enabled=use_shared and self.device.type == "cpu",
            recycled=RecycledBuffers(recycle_bytes),
        )
        # CUDA shards are handed over as CUDA IPC handles instead (server/rank/reads/shm.py), under the same switch
        self.hands_over_by_reference = self.shared.enabled or (
            use_shared and self.device.type == "cuda"
        )
        # copy-on-write blocks of the versions row updates make (server/rank/blocks.py), one fd each within the
        # budget shared-memory segments get too
        self.blocks = Blocks(max_files=max(1, self.shared.max_segments))
        self.persistence = persistence  # None: memory only (server/rank/persistence.py)
        if persistence is not None:
            persistence.set_snapshot_source(self._served_shards)
        self.metrics = RankMetrics(rank)  # records nothing until enabled (--metrics-port)

    def empty_shard(
        self, sizes: tuple[int, ...], dtype: torch.dtype, overwrite: bool = False
    ) -> torch.Tensor:
        """The one allocation of shard memory: zero-filled (unless the caller will `overwrite` every byte), in
        shared memory for CPU shards when enabled, from a freed version's buffer when one fits."""
        if self.device.type == "cpu":
            return self.shared.empty(tuple(sizes), dtype, overwrite=overwrite)
        return torch.zeros(sizes, dtype=dtype, device=self.device)

    def recycled_shards(self, meta: ShardedTensorMetadata) -> dict[int, torch.Tensor]:
        """Freed buffers for the local shards of `meta` that a caller will overwrite whole (a reshard's
        destination): one per shard for which a buffer of its size is kept; the others are left out."""
        if self.device.type != "cpu":
            return {}
        out = {}
        for i in meta.shards_on(self.rank):
            tensor = self.shared.recycled_empty(meta.shards_metadata[i].shard_sizes, meta.dtype)
            if tensor is not None:
                out[i] = tensor
        return out

    @property
    def memory_used(self) -> int:
        return self._memory_used

    # ------------------------------------------------------------ lifecycle

    def allocate(
        self,
        name: str,
        version: int,
        meta: ShardedTensorMetadata,
        init: int = pb.INIT_NONE,
        seed: int = 0,
        options: pb.TensorOptions | None = None,
    ) -> int:
        """Allocate (and fill, for init != INIT_NONE) the shards of `meta` placed on this rank."""
        check_init(init, meta.dtype)
        local, entry = self._local_entry(name, version, meta, options)
        nbytes = entry.nbytes
        self._reserve(entry)
        try:
            for i in local:
                entry.shards[i] = make_shard(meta, i, init, seed, self.device, self.empty_shard)
        except (RuntimeError, MemoryError) as err:
            self._forget(entry)
            raise MemoryLimit(
                f"rank {self.rank} could not allocate {nbytes} bytes: {err}"
            ) from None
        if init != pb.INIT_NONE:
            self._mark_filled(entry, local)
        log.info(
            "rank %d allocated %r version %d: %d shards, %d bytes",
            self.rank,
            name,
            version,
            len(local),
            nbytes,
        )
        return nbytes

    def reserve(
        self,
        name: str,
        version: int,
        meta: ShardedTensorMetadata,
        options: pb.TensorOptions | None = None,
    ) -> int:
        """Account (name, version) against the memory limit, allocating nothing: `fill_reserved` fills it later."""
        _, entry = self._local_entry(name, version, meta, options)
        self._reserve(entry)
        log.info(
            "rank %d reserved %d bytes for %r version %d", self.rank, entry.nbytes, name, version
        )
        return entry.nbytes

    def _local_entry(
        self, name: str, version: int, meta: ShardedTensorMetadata, options: pb.TensorOptions | None
    ) -> tuple[list[int], StoredVersion]:
        """The shards of `meta` placed on this rank (checked against its device) and their empty entry."""
        local = meta.shards_on(self.rank)
        for i in local:
            if meta.shards_metadata[i].device != self.device:
                raise InvalidArgument(
                    f"shards_metadata[{i}].placement {meta.shards_metadata[i].placement} does not match "
                    f"rank {self.rank}'s device {self.device}"
                )
        nbytes = sum(meta.shard_nbytes(i) for i in local)
        return local, StoredVersion(name, version, meta, options or pb.TensorOptions(), nbytes)

    def fill_reserved(self, name: str, version: int, shards: dict[int, torch.Tensor]) -> None:
        """Put the finished local shards of a `reserve`d pending version in place (every local shard at once)."""
        with self._lock:
            entry = self._pending(name, version)
            expected = set(entry.metadata.shards_on(self.rank))
            if set(shards) != expected:
                raise InvalidArgument(
                    f"install of {name!r} version {version}: shards {sorted(shards)} given, "
                    f"rank {self.rank} holds {sorted(expected)}"
                )
            entry.shards = dict(shards)
            entry.complete = set(shards)
        if (
            self.persistence is not None
        ):  # durable before the job reports its part done (and the catalog commits)
            self.persistence.snapshot(name, version, entry.metadata, entry.options, entry.shards)

    def install(
        self,
        name: str,
        version: int,
        meta: ShardedTensorMetadata,
        shards: dict[int, torch.Tensor],
        options: pb.TensorOptions | None = None,
    ) -> int:
        """Add a PENDING version from shards built elsewhere, all written (in-process extensions and tests; the
        reshard and checkpoint jobs fill a reservation instead: reserve, then fill_reserved)."""
        local = set(meta.shards_on(self.rank))
        if set(shards) != local:
            raise InvalidArgument(
                f"shards {sorted(shards)} given for tensor {name!r} version {version}, but "
                f"rank {self.rank} holds shards {sorted(local)}"
            )
        for i, tensor in shards.items():
            shard = meta.shards_metadata[i]
            if (
                tuple(tensor.shape) != shard.shard_sizes
                or tensor.dtype != meta.dtype
                or tensor.device != self.device
                or not tensor.is_contiguous()
            ):
                raise InvalidArgument(
                    f"shard {i} of tensor {name!r}: expected a contiguous {shard.shard_sizes} "
                    f"{dtype_name(meta.dtype)} tensor on {self.device}"
                )
        entry = StoredVersion(
            name,
            version,
            meta,
            options or pb.TensorOptions(),
            sum(meta.shard_nbytes(i) for i in local),
            dict(shards),
            set(local),
        )
        self._reserve(entry)
        return entry.nbytes

    def _reserve(self, entry: StoredVersion) -> None:
        with self._lock:
            key = (entry.name, entry.version)
            if key in self._versions:
                raise InvalidState(
                    f"tensor {entry.name!r} version {entry.version} is already "
                    f"allocated on rank {self.rank}"
                )
            if (
                key in self._dropped
            ):  # versions never come back: this allocation lost a race with its abort
                raise TensorBusy(
                    f"tensor {entry.name!r} version {entry.version} was dropped on rank "
                    f"{self.rank} before this allocation arrived (aborted)"
                )
            self._make_room(entry.nbytes)
            if self.memory_limit and self._memory_used + entry.nbytes > self.memory_limit:
                raise MemoryLimit(
                    f"rank {self.rank} memory limit: {entry.nbytes} bytes requested, "
                    f"{self.memory_limit - self._memory_used} of {self.memory_limit} free"
                )
            if self._memory_used + entry.nbytes > self._capacity:
                raise MemoryLimit(
                    f"rank {self.rank} memory: {entry.nbytes} bytes requested, more than the "
                    f"{self._capacity - self._memory_used} bytes left of {self.device}'s {self._capacity}"
                )
            self._versions[key] = entry
            self._memory_used += entry.nbytes

    def _make_room(self, nbytes: int) -> None:
        """(lock held) Let go of recycled buffers, then of versions in their grace period (oldest first), that a
        reservation of `nbytes` needs room for (limit or device capacity)."""
        if self._room(nbytes) < 0:
            for entry in sorted(self._graced_locked(), key=lambda e: e.grace_until or 0.0):
                self._drop_locked(entry)
                if self._room(nbytes) >= 0:
                    break
        room = self._room(nbytes)
        if self.shared.recycled.nbytes > room:
            self.shared.recycled.trim(room)

    def _room(self, nbytes: int) -> int:
        room = self._capacity - self._memory_used - nbytes
        if self.memory_limit:
            room = min(room, self.memory_limit - self._memory_used - nbytes)
        return room

    def _graced_locked(self) -> list[StoredVersion]:
        return [e for e in self._versions.values() if e.grace_until is not None and not e.dropped]

    def end_graces(self) -> int:
        """Drop the replaced versions whose grace period is over (the rank's main loop calls this); how many."""
        now = self._clock()
        with self._lock:
            over = [
                e
                for e in self._graced_locked()
                if e.grace_until is not None and e.grace_until <= now
            ]
            for entry in over:
                self._drop_locked(entry)
        for entry in over:
            log.info(
                "rank %d dropped %r version %d (grace over)", self.rank, entry.name, entry.version
            )
        return len(over)

    def _forget(self, entry: StoredVersion) -> None:
        with self._lock:
            if self._versions.get((entry.name, entry.version)) is entry:
                del self._versions[(entry.name, entry.version)]
                self._memory_used -= entry.nbytes

    def promote(self, name: str, version: int) -> None:
        """Serve (name, version) once every local shard is fully written (and, with persistence, durable)."""
        with self._lock:
            entry = self._promotable(name, version)
            persist = self.persistence is not None and entry.state is not VersionState.SERVED
            if persist:
                entry.leases += 1
        if persist:
            assert self.persistence is not None
            with self._lease(entry):
                self.persistence.promote(
                    name, version, entry.metadata, entry.options, dict(entry.shards)
                )
        with self._lock:
            entry = self._promotable(name, version)
            entry.state = VersionState.SERVED
            for shard in entry.shards.values():
                self.blocks.publish(shard)
            self.shared.mark(entry.shards.values(), served=True)
        if persist:
            assert self.persistence is not None
            self.persistence.served(name, version, entry.metadata)
        log.info("rank %d serves %r version %d", self.rank, name, version)

    def _promotable(self, name: str, version: int) -> StoredVersion:
        """(lock held) The held (name, version) with every local shard fully written and no change open."""
        entry = self._get(name, version)
        changing = {index for index, writes in entry.changing.items() if writes}
        missing = sorted(
            (set(entry.metadata.shards_on(self.rank)) - entry.complete) | changing | entry.torn
        )
        if missing:
            raise WriteIncomplete(
                f"tensor {name!r} version {version}: shards {missing} on rank {self.rank} "
                f"are not fully written"
            )
        return entry

    def _remember_dropped(self, key: tuple[str, int]) -> None:
        """Keep (name, version) as dropped (lock held), the latest DROPPED_KEPT of them, so a late allocation of
        it (an AllocateShards overtaken by its abort's DropVersion) is refused instead of held for nobody."""
        self._dropped[key] = None
        while len(self._dropped) > DROPPED_KEPT:
            self._dropped.popitem(last=False)

    def drop(self, name: str, version: int = 0) -> int:
        """Drop one version (0 = all) of `name`; memory is freed once its leases end. Idempotent. A served
        version that a newer served one replaced stays served for the grace period first (end_graces drops
        it); dropping all versions (a delete) drops at once."""
        with self._lock:
            keys = [k for k in self._versions if k[0] == name and (version == 0 or k[1] == version)]
            if version:
                self._remember_dropped((name, version))
            graced = []
            for key in keys:
                entry = self._versions[key]
                if version and self._replaced(entry):
                    if entry.grace_until is None:
                        entry.grace_until = self._clock() + self.version_grace
                        self.shared.mark(entry.shards.values(), served=True, replaced=True)
                    graced.append(key[1])
                else:
                    self._drop_locked(entry)
        if self.persistence is not None and (keys or version == 0):
            self.persistence.drop(name, version)
        if keys:
            log.info(
                "rank %d dropped %r versions %s%s",
                self.rank,
                name,
                [k[1] for k in keys],
                f" (served {self.version_grace:g}s more: {graced})" if graced else "",
            )
        return len(keys)

    def _replaced(self, entry: StoredVersion) -> bool:
        """(lock held) Whether `entry` is a served version with a newer served one, and a grace applies."""
        if not self.version_grace or entry.dropped or entry.state is not VersionState.SERVED:
            return False
        return any(
            k[0] == entry.name
            and k[1] > entry.version
            and e.state is VersionState.SERVED
            and not e.dropped
            for k, e in self._versions.items()
        )

    def _drop_locked(self, entry: StoredVersion) -> None:
        entry.dropped = True
        entry.grace_until = None
        self.shared.mark(entry.shards.values(), served=False)
        if entry.leases == 0:
            self._free_locked(entry)

    def _free_locked(self, entry: StoredVersion) -> None:
        """Forget a dropped version no lease holds; its CPU buffers are kept for reuse (server/rank/recycling.py)."""
        del self._versions[(entry.name, entry.version)]
        self._memory_used -= entry.nbytes
        whole = []
        for shard in entry.shards.values():
            freed = self.blocks.release(shard)
            if freed is None:
                whole.append(shard)
            else:
                self._memory_used -= freed  # the blocks no other version uses
        self.shared.recycle(whole)
        entry.shards.clear()

    # ------------------------------------------------------------ lookups and leases

    def _get(self, name: str, version: int) -> StoredVersion:
        entry = self._versions.get((name, version))
        if entry is not None and not entry.dropped:
            return entry
        if not any(k[0] == name and not e.dropped for k, e in self._versions.items()):
            raise NotFound(f"tensor {name!r} not found on rank {self.rank}")
        raise StaleVersion(
            f"tensor {name!r} version {version} is not held on rank {self.rank}; "
            f"{self._served_phrase(name)}"
        )

    def _pending(self, name: str, version: int) -> StoredVersion:
        """(lock held) The pending (name, version): InvalidState once it is served, as served versions never
        change."""
        entry = self._get(name, version)
        if entry.state is VersionState.SERVED:
            raise InvalidState(
                f"tensor {name!r} version {version} is already committed; "
                f"create a new version to change it"
            )
        return entry

    def _open_for_change(
        self,
        name: str,
        version: int,
        shard_index: int,
        check: Callable[[StoredVersion], None] = lambda entry: None,
    ) -> tuple[StoredVersion, torch.Tensor, bool]:
        """Lease pending (name, version) for a change of local shard `shard_index`, after `check(entry)`, and
        count that shard as being changed, all in one step under the lock so no promote comes in between.

        A promote waits for every change of every shard to end, and refuses a shard that a change left half
        done (`torn`) until a later change that starts with the shard idle completes it: one stream finishing
        a shard must not publish it while, or after, another one wrote part of it and failed. Returns (the
        entry, whose lease and change the caller ends with _changing; the shard; whether it was complete)."""
        with self._lock:
            entry = self._pending(name, version)
            shard = self._local_shard(entry, shard_index)
            check(entry)
            if not entry.changing[
                shard_index
            ]:  # a fresh round of changes: earlier failures are overwritten
                entry.torn.discard(shard_index)
            was_complete = shard_index in entry.complete
            entry.complete.discard(shard_index)
            entry.changing[shard_index] += 1
            entry.leases += 1
        return entry, shard, was_complete

    @contextmanager
    def _changing(self, entry: StoredVersion, shard_index: int) -> Iterator[Callable[[bool], None]]:
        """The lease and change of one shard opened by _open_for_change, ended on exit; yields `done(complete)`,
        which the caller calls once its change is whole (`complete`: the shard then counts as fully written);
        a change that ends without it leaves the shard torn."""
        outcome: list[bool] = []
        with self._lease(entry):
            try:
                yield outcome.append
            finally:
                with self._lock:
                    entry.changing[shard_index] -= 1
                    if not outcome:
                        entry.torn.add(shard_index)
                        entry.complete.discard(shard_index)
                    elif outcome[0]:
                        entry.complete.add(shard_index)

    def _mark_filled(self, entry: StoredVersion, shards: list[int]) -> None:
        """Count shards an allocation filled as complete, unless a change of them is open or failed meanwhile."""
        with self._lock:
            entry.complete.update(
                i for i in shards if not entry.changing[i] and i not in entry.torn
            )

    def _served_phrase(self, name: str) -> str:
        served = [
            k[1]
            for k, e in self._versions.items()
            if k[0] == name and e.state is VersionState.SERVED and not e.dropped
        ]
        return f"served version is {max(served)}" if served else "no version is served yet"

    def _served(self, name: str, version: int) -> StoredVersion:
        if version == 0:
            served = [
                e
                for k, e in self._versions.items()
                if k[0] == name and e.state is VersionState.SERVED and not e.dropped
            ]
            if served:
                return max(served, key=lambda e: e.version)
        entry = self._get(name, version)
        if entry.state is not VersionState.SERVED:
            raise StaleVersion(
                f"tensor {name!r} version {version} is not served here; {self._served_phrase(name)}"
            )
        return entry

    @contextmanager
    def _lease(self, entry: StoredVersion) -> Iterator[StoredVersion]:
        try:
            yield entry
        finally:
            with self._lock:
                entry.leases -= 1
                if (
                    entry.dropped
                    and entry.leases == 0
                    and (entry.name, entry.version) in self._versions
                ):
                    self._free_locked(entry)

    def _local_shard(self, entry: StoredVersion, shard_index: int) -> torch.Tensor:
        count = len(entry.metadata.shards_metadata)
        if not 0 <= shard_index < count:
            raise InvalidArgument(
                f"shard_index {shard_index} is out of range: tensor {entry.name!r} "
                f"has {count} shards"
            )
        if shard_index not in entry.shards:
            if shard_index in entry.metadata.shards_on(
                self.rank
            ):  # reserved: a collective job brings its shards
                raise InvalidState(
                    f"shard_index {shard_index} of tensor {entry.name!r} version "
                    f"{entry.version} is reserved for a reshard or checkpoint load on rank "
                    f"{self.rank}; its data arrives with that job, not by a write"
                )
            raise InvalidArgument(
                f"shard_index {shard_index} of tensor {entry.name!r} is not held by "
                f"rank {self.rank} (local shards: {sorted(entry.shards)})"
            )
        return entry.shards[shard_index]

    @contextmanager
    def read(
        self,
        name: str,
        version: int,
        shard_index: int,
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
    ) -> Iterator[torch.Tensor]:
        """Lease a served version and yield the global box as a view of its local shard."""
        with self._lock:
            entry = self._served(name, version)
            entry.leases += 1
        with self._lease(entry):
            shard_tensor = self._local_shard(entry, shard_index)
            box = _checked_box(entry.metadata.shards_metadata[shard_index].box, offsets, sizes)
            nbytes = box.numel() * entry.metadata.tensor_properties.itemsize
            if self.max_request_bytes and nbytes > self.max_request_bytes:
                raise RequestTooLarge(
                    f"offsets/sizes: the box is {nbytes} bytes, over this rank's "
                    f"max_request_bytes {self.max_request_bytes}"
                )
            yield local_view(shard_tensor, entry.metadata.shards_metadata[shard_index].box, box)

    @contextmanager
    def write(
        self, name: str, version: int, shard_index: int, dtype: torch.dtype, nbytes: int
    ) -> Iterator[ShardWriter]:
        """Lease a pending version and yield a writer that fills shard `shard_index` in order."""

        def check(entry: StoredVersion) -> None:
            if dtype != entry.metadata.dtype:
                raise InvalidArgument(
                    f"header.dtype {dtype_name(dtype)} does not match tensor {name!r}'s "
                    f"dtype {dtype_name(entry.metadata.dtype)}"
                )
            if nbytes != entry.metadata.shard_nbytes(shard_index):
                raise InvalidArgument(
                    f"header.nbytes {nbytes} does not match shard {shard_index}'s size "
                    f"of {entry.metadata.shard_nbytes(shard_index)} bytes"
                )
            if self.blocks.is_composed(entry.shards.get(shard_index, torch.empty(0))):
                raise InvalidState(
                    f"shard_index {shard_index} of {name!r} version {version} is a row "
                    f"update's copy; change its rows with WriteRows"
                )
            if entry.changing[
                shard_index
            ]:  # two streams would interleave their bytes, each "complete"
                raise TensorBusy(
                    f"shard_index {shard_index} of {name!r} version {version} is being written by "
                    f"another stream on rank {self.rank}; write each shard once"
                )

        entry, shard_tensor, _ = self._open_for_change(name, version, shard_index, check)
        with self._changing(entry, shard_index) as done:
            writer = ShardWriter(shard_tensor, nbytes)
            yield writer
            if writer.written != nbytes:
                raise InvalidArgument(
                    f"the stream ended after {writer.written} of {nbytes} bytes of "
                    f"shard {shard_index}"
                )
            done(True)

    @contextmanager
    def lease(self, name: str, version: int, served: bool = True) -> Iterator[StoredVersion]:
        """Lease (name, version), served (or, with served=False, pending): reads that go on outside a stream
        (OpenShard, lookups, copies, checkpoint jobs)."""
        with self._lock:
            entry = self._served(name, version) if served else self._pending(name, version)
            entry.leases += 1
        with self._lease(entry):
            yield entry

    @contextmanager
    def rewrite(
        self, name: str, version: int, shard_index: int, rows: torch.Tensor | None = None
    ) -> Iterator[torch.Tensor]:
        """Lease a pending version and yield local shard `shard_index` to change in place; the shard counts as
        not fully written meanwhile, so a promote cannot publish it half changed. A version made by a row
        update shares its blocks with its source: only the blocks holding local `rows` (dim 0) of it may be
        changed, and they get copies of their own first."""
        entry, shard, was_complete = self._open_for_change(name, version, shard_index)
        with self._changing(entry, shard_index) as done:
            if self.blocks.is_composed(shard):
                self._own_rows(shard, rows)
            yield shard
            done(was_complete)

    def _own_rows(self, shard: torch.Tensor, rows: torch.Tensor | None) -> None:
        """Copy the blocks of composed `shard` that `rows` lie in (all rows when None), accounting their memory."""
        if rows is None:
            rows = torch.arange(shard.shape[0] if shard.dim() else 1)
        row_bytes = shard[0].numel() * shard.element_size() if shard.dim() else shard.element_size()
        starts = (rows.to(torch.int64).unique() * row_bytes).tolist()
        added, freed = self.blocks.make_own(shard, [(start, start + row_bytes) for start in starts])
        with self._lock:
            self._memory_used += added - freed

    def shard_of(self, entry: StoredVersion, shard_index: int) -> torch.Tensor:
        """The local tensor of shard `shard_index` of a leased version (InvalidArgument if not held here)."""
        return self._local_shard(entry, shard_index)

    def allocate_copy(
        self,
        name: str,
        version: int,
        meta: ShardedTensorMetadata,
        source_version: int,
        options: pb.TensorOptions | None = None,
    ) -> int:
        """Allocate (name, version) as a copy of the local shards of served version `source_version`: sharing
        their blocks (server/rank/blocks.py) where they are in shared memory, else a copy of each shard."""
        with self.lease(name, source_version) as source:
            if source.metadata != meta:
                raise InvalidArgument(
                    f"source_version {source_version} of {name!r} has another layout "
                    f"than the new version's metadata"
                )
            if self.persistence is not None:
                self.persistence.note_copy(name, version, source_version)
            shared = self._share_blocks(source)
            copied = sum(
                s.numel() * s.element_size() for i, s in source.shards.items() if i not in shared
            )
            entry = StoredVersion(
                name, version, meta, options or pb.TensorOptions(), copied, dict(shared)
            )
            try:
                self._reserve(entry)
            except BaseException:
                self._release_blocks(shared.values())
                raise
            try:
                for i, shard in source.shards.items():
                    if i not in shared:
                        entry.shards[i] = self.empty_shard(
                            tuple(shard.shape), shard.dtype, overwrite=True
                        ).copy_(shard)
            except (RuntimeError, MemoryError) as err:
                self._forget(entry)
                raise MemoryLimit(
                    f"rank {self.rank} could not copy {entry.nbytes} bytes: {err}"
                ) from None
        self._mark_filled(entry, list(entry.shards))
        log.info(
            "rank %d made %r version %d from version %d (%d shards sharing blocks, %d bytes copied)",
            self.rank,
            name,
            version,
            source_version,
            len(shared),
            copied,
        )
        return entry.nbytes

    def _release_blocks(self, tensors: Iterable[torch.Tensor]) -> None:
        freed = sum(self.blocks.release(t) or 0 for t in tensors)
        with self._lock:
            self._memory_used -= freed

    def _share_blocks(self, source: StoredVersion) -> dict[int, torch.Tensor]:
        """New tensors over the same blocks as the leased source's shards, for those in shared memory. A shard
        cut into blocks for the first time moves its bytes from the source's account to its blocks'; blocks
        copied out of a half-unused segment are accounted as they are made."""
        if not self.shared.enabled:
            return {}
        out = {}
        for i, shard in source.shards.items():
            adopted = self.blocks.table(shard) is None
            shared = self.blocks.share(shard, self.shared.segment_of(shard))
            if shared is None:
                continue
            out[i], copied = shared
            with self._lock:
                self._memory_used += copied  # blocks of a half-unused segment, copied to let it go
                if adopted:
                    source.nbytes -= shard.numel() * shard.element_size()
        return out

    def shared_segment(self, entry: StoredVersion, shard_index: int) -> Segment | None:
        """The shared-memory Segment of a leased served shard, moving the shard into shared memory first
        when it was built elsewhere (a reshard, a checkpoint load); None when shared memory is off."""
        shard = self._local_shard(entry, shard_index)
        segment = self.shared.segment_of(shard)
        if segment is not None or not self.shared.enabled or shard.device.type != "cpu":
            return segment
        if self.blocks.is_composed(shard):
            return None
        copy = self.shared.export(shard)  # same bytes; the served version is immutable
        with self._lock:
            if entry.shards.get(shard_index) is shard:
                entry.shards[shard_index] = copy
                self.shared.mark(
                    [copy], served=not entry.dropped, replaced=entry.grace_until is not None
                )
            current = entry.shards.get(shard_index)
        return self.shared.segment_of(current) if current is not None else None

    def state_header(self, entry: StoredVersion, shard_index: int) -> Segment:
        """The header-only segment whose state word tells same-host clients whether a leased served CUDA
        shard is still served (server/rank/shared_memory.py SharedMemory.attach_header)."""
        shard = self._local_shard(entry, shard_index)
        with self._lock:
            return self.shared.attach_header(
                shard, served=not entry.dropped, replaced=entry.grace_until is not None
            )

    # ------------------------------------------------------------ persistence

    def log_rows(
        self, name: str, version: int, shard_index: int, rows: np.ndarray, values: torch.Tensor
    ) -> None:
        """Log rows about to be written to a pending update version (no-op without persistence)."""
        if self.persistence is not None:
            self.persistence.log_rows(name, version, shard_index, rows, values)

    @contextmanager
    def _served_shards(self, name: str, version: int) -> Iterator[tuple]:
        with self.lease(name, version) as entry:
            yield entry.metadata, entry.options, dict(entry.shards)

    def restore(
        self, progress: Callable[[RestoreCount], None] | None = None
    ) -> list[tuple[str, int]]:
        """Load every version the persist dir holds as PENDING (the coordinator re-promotes those it has
        READY), `progress` seeing how far; returns (name, version) of each."""
        if self.persistence is None:
            return []
        restored = self.persistence.restore(
            lambda sizes, dtype: (
                self.empty_shard(tuple(sizes), dtype, True)
                if self.device.type == "cpu"
                else torch.empty(sizes, dtype=dtype)
            ),
            self.device,
            progress,
        )
        for item in restored:
            self.install(item.name, item.version, item.metadata, item.shards, item.options)
        return [(item.name, item.version) for item in restored]

    # ------------------------------------------------------------ introspection

    def metrics_snapshot(self) -> dict[str, Any]:
        """Memory and versions for the rank's gauges (server/rank/metrics.py), read at scrape time."""
        with self._lock:
            live = [e for e in self._versions.values() if not e.dropped]
            states = Counter("graced" if e.grace_until is not None else e.state.value for e in live)
            reserved = sum(e.nbytes for e in live if e.state is VersionState.PENDING)
            pinned = sum(1 for e in self._versions.values() if e.leases > 0)
        return {
            "memory_used": self._memory_used,
            "memory_limit": self.memory_limit,
            "memory_reserved": reserved,
            "memory_recycled": self.shared.recycled.nbytes,
            "versions": dict(states),
            "pinned": pinned,
        }

    def held(self) -> list[tuple[str, int, VersionState]]:
        """(name, version, state) of every version not dropped."""
        with self._lock:
            return sorted(
                (e.name, e.version, e.state) for e in self._versions.values() if not e.dropped
            )

    def local_shards(self, name: str, version: int) -> dict[int, torch.Tensor]:
        """Every local shard of a held version, by shard index (the source of a reshard or a save)."""
        with self._lock:
            return dict(self._get(name, version).shards)

    def local_tensor(self, name: str, version: int, shard_index: int) -> torch.Tensor:
        """The local tensor of one shard (for in-process extensions and tests)."""
        with self._lock:
            return self._local_shard(self._get(name, version), shard_index)


def _checked_box(shard_box: Box, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Box:
    """The requested box, or InvalidArgument naming offsets/sizes when it is not inside the shard."""
    if len(offsets) != shard_box.ndim:
        raise InvalidArgument(
            f"offsets has {len(offsets)} dims but the tensor has {shard_box.ndim}"
        )
    if len(sizes) != shard_box.ndim:
        raise InvalidArgument(f"sizes has {len(sizes)} dims but the tensor has {shard_box.ndim}")
    for d, (o, s) in enumerate(zip(offsets, sizes)):
        if o < 0:
            raise InvalidArgument(f"offsets[{d}]={o} is negative")
        if s < 0:
            raise InvalidArgument(f"sizes[{d}]={s} is negative")
    box = Box(offsets, sizes)
    if not shard_box.contains(box):
        raise InvalidArgument(
            f"offsets/sizes: box offsets={list(offsets)} sizes={list(sizes)} is not inside "
            f"the shard (offsets={list(shard_box.offsets)} sizes={list(shard_box.sizes)})"
        )
    return box


class ShardWriter:
    """Writes received chunks, in order, straight into a preallocated shard tensor."""

    def __init__(self, shard: torch.Tensor, nbytes: int) -> None:
        self.nbytes = nbytes
        self.written = 0
        self._bytes = byte_view(shard)
        self._host = shard.device.type == "cpu"
        self._view = memoryview(self._bytes.numpy()) if self._host and nbytes else None

    def write(self, offset: int, data: bytes) -> None:
        """Copy one chunk to its offset; chunks must arrive in order without gaps or overlap."""
        if offset != self.written:
            raise InvalidArgument(
                f"chunk.offset {offset} is not where the stream is: expected {self.written} "
                f"(chunks must arrive in order)"
            )
        end = offset + len(data)
        if end > self.nbytes:
            raise InvalidArgument(
                f"chunk.offset+len(chunk.data)={end} is past the end of the shard "
                f"({self.nbytes} bytes)"
            )
        if not data:
            return
        if self._view is not None:
            self._view[offset:end] = data
        else:
            self._bytes[offset:end].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.written = end

    def fill(self, receive: Callable[[memoryview], None]) -> None:
        """Write the whole shard at once: `receive(view)` fills a writable byte view of it (the shard's own memory
        when it is in host memory, else a host buffer copied to the device after)."""
        if self.written:
            raise InvalidArgument("the shard is being written in chunks; fill() writes it whole")
        if self._view is not None:
            receive(self._view)
        elif self.nbytes:
            staging = torch.empty(self.nbytes, dtype=torch.uint8)
            receive(memoryview(staging.numpy()))
            self._bytes.copy_(staging)
        self.written = self.nbytes
