"""ShardStore: the versions of one rank's shards, keyed by (name, version) and shard index.

A version goes through the states of server/rank/version_table.py: allocated PENDING (or RESERVED for a
collective job that brings its shards), SERVED once every local shard is written and it is promoted, GRACED
for `version_grace` seconds more when a newer one replaces it, then DROPPED, and FREED once no read or write
holds a lease on it; drops and grace periods go through `retirement` (server/rank/retirement.py). Memory is
accounted in a MemoryBudget (server/rank/memory_budget.py) when a version is allocated and given back when it is freed
(server/rank/shard_memory.py). Reads and changes go through `leases` (server/rank/leases.py), promotions
through `promotion` (server/rank/promotion.py: shards the writer left no checksum for are hashed on a shared
pool, durable versions persisted, then all served). No network, no threads of its
own: the servicers call in from gRPC worker threads, so every method is thread-safe. Errors are the rank's own
(server/rank/errors.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardserve.core.dtypes import dtype_name
from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.tensor_options import TensorOptions
from shardserve.server.rank.blocks import Blocks
from shardserve.server.rank.errors import InvalidArgument, MemoryLimit, RankError
from shardserve.server.rank.leases import VersionLeases
from shardserve.server.rank.memory_budget import MemoryBudget, device_capacity
from shardserve.server.rank.metrics import RankMetrics
from shardserve.server.rank.persistence import Persistence, RestoreCount
from shardserve.server.rank.promotion import ItemErrors, VersionPromotion
from shardserve.server.rank.recycling import DEFAULT_MAX_BYTES as DEFAULT_RECYCLE_BYTES
from shardserve.server.rank.recycling import RecycledBuffers
from shardserve.server.rank.retirement import DEFAULT_VERSION_GRACE_S, VersionRetirement
from shardserve.server.rank.shard_fill import InitFill, make_shard
from shardserve.server.rank.shard_memory import ShardMemory
from shardserve.server.rank.shared_memory import SharedMemory, enabled_by_env
from shardserve.server.rank.version_table import (
    StoredVersion,
    VersionEvent,
    VersionState,
    VersionTable,
)

log = logging.getLogger(__name__)


class ShardStore:
    """The versions of one rank: allocated, filled, promoted, dropped and restored, within a memory budget."""

    def __init__(
        self,
        rank: int,
        device: str = "cpu",
        memory_limit: int = 0,
        max_request_bytes: int = 0,
        *,
        shared_memory: bool | None = None,
        recycle_bytes: int = DEFAULT_RECYCLE_BYTES,
        version_grace: float = DEFAULT_VERSION_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
        persistence: Persistence | None = None,
    ) -> None:
        self.rank = rank
        self.device = torch.device(device)
        self.budget = MemoryBudget(
            memory_limit, device_capacity(self.device), rank=rank, device=str(self.device)
        )
        self._lock = threading.Lock()
        self.versions = VersionTable(rank)
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
        self.blocks = Blocks(
            max_files=max(1, self.shared.max_segments), spare=RecycledBuffers(recycle_bytes)
        )
        self.memory = ShardMemory(self.device, self.budget, self.shared, self.blocks)
        self.leases = VersionLeases(
            self._lock, self.versions, self.memory, max_request_bytes=max_request_bytes
        )
        self.retirement = VersionRetirement(
            self._lock,
            self.versions,
            self.memory,
            grace=version_grace,
            clock=clock,
            persistence=persistence,
        )
        self.promotion = VersionPromotion(
            self._lock, self.versions, self.memory, self.leases, persistence=persistence
        )
        self.persistence = persistence  # None: memory only (server/rank/persistence.py)
        if persistence is not None:
            persistence.set_snapshot_source(self.leases.served_shards)
        self.metrics = RankMetrics(rank)  # records nothing until enabled (--metrics-port)

    @property
    def memory_used(self) -> int:
        return self.budget.used

    @property
    def memory_limit(self) -> int:
        return self.budget.limit

    @property
    def version_grace(self) -> float:
        """Seconds a replaced served version stays served (server/rank/retirement.py)."""
        return self.retirement.grace

    @version_grace.setter
    def version_grace(self, seconds: float) -> None:
        self.retirement.grace = seconds

    # ------------------------------------------------------------ lifecycle

    def allocate(
        self,
        name: str,
        version: int,
        meta: ShardedTensorMetadata,
        fill: InitFill = InitFill.NONE,
        seed: int = 0,
        options: TensorOptions | None = None,
        *,
        log_level: int = logging.INFO,
    ) -> int:
        """Allocate (and fill, unless InitFill.NONE) the shards of `meta` placed on this rank (logged at
        `log_level`: a batch logs one line of its own instead)."""
        record = self._record(name, version, meta, options)
        self.retirement.end_graces_of(name)
        self._add(record)
        # NONE: every shard is written whole before it counts (ShardProgress), so reused memory need not be zeroed
        empty = functools.partial(self.memory.empty, overwrite=not fill.writes_all)
        try:
            for i in meta.shards_on(self.rank):
                record.shards[i] = make_shard(meta, i, fill, seed, self.device, empty)
        except (RuntimeError, MemoryError) as err:
            self.retirement.forget(record)
            raise MemoryLimit(
                f"rank {self.rank} could not allocate {record.nbytes} bytes: {err}",
                metadata={"tensor": name, "rank": self.rank},
            ) from None
        if fill.writes_all:
            with self._lock:
                record.progress.mark_filled(record.shards)
        log.log(
            log_level,
            "rank %d allocated %r version %d: %d shards, %d bytes",
            self.rank,
            name,
            version,
            len(record.shards),
            record.nbytes,
        )
        return record.nbytes

    def reserve(
        self,
        name: str,
        version: int,
        meta: ShardedTensorMetadata,
        options: TensorOptions | None = None,
    ) -> int:
        """Account (name, version) against the memory budget, allocating nothing: a collective job brings its
        shards (`fill_reserved`). A rank that holds none of its shards has nothing to wait for. As `allocate`,
        it ends the grace of the tensor's replaced versions, whose buffers the job then reuses."""
        record = self._record(name, version, meta, options)
        self.retirement.end_graces_of(name)
        if meta.shards_on(self.rank):
            record.state = VersionState.RESERVED
        self._add(record)
        log.info(
            "rank %d reserved %d bytes for %r version %d", self.rank, record.nbytes, name, version
        )
        return record.nbytes

    def fill_reserved(self, name: str, version: int, shards: dict[int, torch.Tensor]) -> None:
        """Put the finished local shards of a reserved version in place (every local shard at once)."""
        with self._lock:
            record = self.versions.pending(name, version)
            expected = set(record.metadata.shards_on(self.rank))
            if set(shards) != expected:
                raise InvalidArgument(
                    f"install of {name!r} version {version}: shards {sorted(shards)} given, "
                    f"rank {self.rank} holds {sorted(expected)}",
                    metadata={"tensor": name, "rank": self.rank},
                )
            record.apply(VersionEvent.FILL)
            record.shards = dict(shards)
            record.progress.complete = set(shards)
        if self.persistence is not None:  # durable before the job reports its part done
            self.persistence.snapshot(name, version, record.metadata, record.options, record.shards)

    def install(
        self,
        name: str,
        version: int,
        meta: ShardedTensorMetadata,
        shards: dict[int, torch.Tensor],
        options: TensorOptions | None = None,
        *,
        checksums: dict[int, int] | None = None,
    ) -> int:
        """Add a PENDING version from shards built elsewhere, all written (restore, in-process extensions and
        tests; the reshard and checkpoint jobs fill a reservation instead). `checksums`: those already known
        (a restore checked its files against them); the promote hashes the others."""
        local = set(meta.shards_on(self.rank))
        if set(shards) != local:
            raise InvalidArgument(
                f"shards {sorted(shards)} given for tensor {name!r} version {version}, but "
                f"rank {self.rank} holds shards {sorted(local)}",
                metadata={"tensor": name, "rank": self.rank},
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
                    f"{dtype_name(meta.dtype)} tensor on {self.device}",
                    metadata={"tensor": name},
                )
        record = self._record(name, version, meta, options)
        record.shards = dict(shards)
        record.checksums = {i: c for i, c in (checksums or {}).items() if i in local}
        record.progress.complete = set(local)
        self._add(record)
        return record.nbytes

    def allocate_copy(
        self,
        name: str,
        version: int,
        meta: ShardedTensorMetadata,
        source_version: int,
        options: TensorOptions | None = None,
        *,
        source_name: str | None = None,
    ) -> int:
        """Allocate (name, version) as a copy of the local shards of served version `source_version` of
        `source_name` (None: `name`): sharing their blocks (server/rank/blocks.py) where they are in shared
        memory, else a copy of each shard. A copy of another tensor (a delta put's) is persisted whole at its
        promote; one of its own name by the update log."""
        source_name = source_name or name
        with self.leases.lease(source_name, source_version) as source:
            if source.metadata != meta:
                raise InvalidArgument(
                    f"source_version {source_version} of {source_name!r} has another layout "
                    f"than the new version's metadata",
                    metadata={"tensor": name, "field": "source_version"},
                )
            own = source_name == name
            if own and self.persistence is not None and (options is None or options.durable):
                self.persistence.note_copy(name, version, source_version)
            shared = self.memory.share_blocks(source)
            copied = sum(
                s.numel() * s.element_size() for i, s in source.shards.items() if i not in shared
            )
            record = StoredVersion(name, version, meta, options or TensorOptions(), copied)
            record.shards = dict(shared)
            record.checksums = dict(
                source.checksums
            )  # the same bytes, until a change drops a shard's
            try:
                self._add(record)
            except BaseException:
                self.memory.release_blocks(shared.values())
                raise
            self._copy_shards(source, record)
        with self._lock:
            record.progress.mark_filled(record.shards)
        log.debug(
            "rank %d made %r version %d from version %d (%d shards sharing blocks, %d bytes copied)",
            self.rank,
            name,
            version,
            source_version,
            len(shared),
            copied,
        )
        return record.nbytes

    def _copy_shards(self, source: StoredVersion, record: StoredVersion) -> None:
        """Copy the source's shards that `record` does not share blocks of."""
        try:
            for i, shard in source.shards.items():
                if i not in record.shards:
                    empty = self.memory.empty(tuple(shard.shape), shard.dtype, overwrite=True)
                    record.shards[i] = empty.copy_(shard)
        except (RuntimeError, MemoryError) as err:
            self.retirement.forget(record)
            raise MemoryLimit(
                f"rank {self.rank} could not copy {record.nbytes} bytes: {err}",
                metadata={"tensor": record.name, "rank": self.rank},
            ) from None

    def promote(self, name: str, version: int) -> dict[int, int]:
        """Serve (name, version) once every local shard is fully written (and, with persistence, durable);
        returns the checksum of each local shard."""
        return self.promote_many([(name, version)])[(name, version)]

    def shared_bytes(
        self, versions: Sequence[tuple[str, int]]
    ) -> dict[tuple[str, int], dict[int, int]]:
        """For each served (name, version) that is a copy sharing blocks: the bytes each local shard shared
        with other versions when it was promoted."""
        out = {}
        with self._lock:
            for name, version in versions:
                with contextlib.suppress(RankError):  # dropped since: nothing to count
                    record = self.versions.get(name, version)
                    if record.shared:
                        out[record.key] = dict(record.shared)
        return out

    def promote_many(
        self,
        versions: Sequence[tuple[str, int]],
        *,
        item_errors: ItemErrors | None = None,
    ) -> dict[tuple[str, int], dict[int, int]]:
        """Promote every (name, version) (VersionPromotion.promote_many); each one's local shard checksums."""
        return self.promotion.promote_many(versions, item_errors=item_errors)

    def drop(self, name: str, version: int = 0, *, log_level: int = logging.INFO) -> int:
        """Drop one version (0 = all) of `name`, idempotently; a replaced served one stays served for its grace
        period first, a delete drops at once (VersionRetirement.drop). Returns how many versions it dropped."""
        return self.retirement.drop(name, version, log_level=log_level)

    def end_graces(self) -> int:
        """Drop the replaced versions whose grace period is over (the rank's main loop calls this); how many."""
        return self.retirement.end_graces()

    def restore(
        self, progress: Callable[[RestoreCount], None] | None = None
    ) -> list[tuple[str, int]]:
        """Load every version the persist dir holds as PENDING (the coordinator re-promotes those it has
        READY), `progress` seeing how far; returns (name, version) of each."""
        if self.persistence is None:
            return []
        restored = self.persistence.restore(
            lambda sizes, dtype: (
                self.memory.empty(tuple(sizes), dtype, True)
                if self.device.type == "cpu"
                else torch.empty(sizes, dtype=dtype)
            ),
            self.device,
            progress,
            corrupt=lambda name, what: self.metrics.corrupt_file(),
        )
        for item in restored:
            self.install(
                item.name,
                item.version,
                item.metadata,
                item.shards,
                item.options,
                checksums=item.checksums,
            )
        return [(item.name, item.version) for item in restored]

    # ------------------------------------------------------------ the table and the budget

    def _record(
        self, name: str, version: int, meta: ShardedTensorMetadata, options: TensorOptions | None
    ) -> StoredVersion:
        """A new, empty record of the shards of `meta` placed on this rank (checked against its device)."""
        local = meta.shards_on(self.rank)
        for i in local:
            if meta.shards_metadata[i].device != self.device:
                raise InvalidArgument(
                    f"shards_metadata[{i}].placement {meta.shards_metadata[i].placement} does not "
                    f"match rank {self.rank}'s device {self.device}",
                    metadata={"tensor": name, "rank": self.rank, "field": "metadata"},
                )
        nbytes = sum(meta.shard_nbytes(i) for i in local)
        return StoredVersion(name, version, meta, options or TensorOptions(), nbytes)

    def _add(self, record: StoredVersion) -> None:
        """Hold `record` in the table and its bytes in the budget, making room first when needed."""
        with self._lock:
            self.versions.add(record)
            try:
                self.retirement.make_room(record.nbytes)
                self.budget.reserve(record.nbytes)
            except BaseException:
                self.versions.discard(record)
                raise

    # ------------------------------------------------------------ introspection

    def metrics_snapshot(self) -> dict[str, Any]:
        """Memory and versions for the rank's gauges (server/rank/metrics.py), read at scrape time."""
        with self._lock:
            live = self.versions.live()
            states = Counter(r.state.value if not r.state.is_pending else "pending" for r in live)
            reserved = sum(r.nbytes for r in live if r.state.is_pending)
            pinned = sum(1 for r in self.versions.records() if r.leases > 0)
        return {
            "memory_used": self.budget.used,
            "memory_limit": self.budget.limit,
            "memory_reserved": reserved,
            "memory_recycled": self.memory.kept_bytes(),
            "versions": dict(states),
            "pinned": pinned,
        }

    def held(self) -> list[tuple[str, int, VersionState]]:
        """(name, version, state) of every version not dropped."""
        with self._lock:
            return sorted((r.name, r.version, r.state) for r in self.versions.live())

    def local_shards(self, name: str, version: int) -> dict[int, torch.Tensor]:
        """Every local shard of a held version, by shard index (the source of a reshard or a save)."""
        with self._lock:
            return dict(self.versions.get(name, version).shards)

    def local_tensor(self, name: str, version: int, shard_index: int) -> torch.Tensor:
        """The local tensor of one shard (for in-process extensions and tests)."""
        with self._lock:
            return self.versions.get(name, version).local_shard(shard_index, self.rank)
