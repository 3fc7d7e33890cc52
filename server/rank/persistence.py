"""A rank's persistence: its shards as safetensors files, its row updates as a per-table log, and restore.

Layout under the rank's persist dir, one folder per tensor, named by server.common.names.file_name (names
are data: a hash with a readable prefix, never the name itself, which lives in its tensor.json):

    <folder>/tensor.json              {"name": the tensor's name}, written when the folder is made
    <folder>/v<V>.json                manifest of version V: name, metadata, options, per shard its file and
                                      checksum (xxh3-64, the catalog's); written last, so a version
                                      without one was never whole on disk
    <folder>/v<V>.s<I>.safetensors    local shard I of version V
    <folder>/updates.log              row updates since the newest snapshot: "copy" (V from source S),
                                      "rows" (ids + values of V), "promote" V, "drop" V

What is durable when: a snapshot (every version made by a put, reshard or
checkpoint load) is fsynced before the rank answers PromoteVersion (or, for a
collective job, before it reports its part done), so the coordinator commits it
to the catalog only once every holding rank has it on disk. A row update is
logged (its rows, not its blocks: an update of k rows writes k rows, where
blocks would write k x 256 KiB) before WriteRows applies it; PromoteVersion
appends "promote" and, under --fsync always, fsyncs the log before answering;
under interval a background thread fsyncs every 100 ms; under none the kernel
decides. Once the log holds more than a table's size in rows, the served
version is snapshotted in the background and the log restarts. A PromoteMany
batch writes every file first and then syncs the filesystem once (twice: shard
files, then manifests and log records), one round per rank however many tensors.
A version whose options say not durable (put(..., durable=False)) writes no
file at all: no shards, no manifest, no log record; a restart loses it.

Restore (at rank start, before registering): every version with a manifest not
dropped since, and the newest promoted update version (its snapshot ancestor
plus the logged rows, replayed in order) and the one before it (the catalog may not have committed the newest),
is loaded as PENDING; the rank
registers holding them and the coordinator's reconcile re-promotes the ones the
catalog has READY and drops the rest. Every shard file is hashed as it is read
and checked against the checksum beside it in the manifest (the version's
checksum in the catalog); a file whose checksum or size is wrong is named in the
log and counted (shardserve_rank_corrupt_files_total), and nothing of its tensor
is loaded: the rank registers without it, the coordinator marks those copies
lost and repairs them from a replica, if any (else the box is reported lost).
"""

from __future__ import annotations

import enum
import logging
import os
import shutil
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np
import torch

from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.tensor_options import TensorOptions
from shardserve.server.common.names import file_name
from shardserve.server.rank.errors import InvalidArgument, StaleVersion, TensorNotFound
from shardserve.server.rank.persist_files import (
    LogRecord,
    PromoteItem,
    disk_error,
    sync_filesystem,
    tensor_memory,
    write_manifest,
    write_version_shards,
)
from shardserve.server.rank.persist_restore import (
    LOG_NAME,
    RestoreCount,
    RestoredVersion,
    restore_dir,
)
from shardserve.server.rank.persist_table import PersistTable

log = logging.getLogger(__name__)

FSYNC_INTERVAL_S = 0.1  # --fsync interval: the most a crash can lose of acknowledged updates


class FsyncPolicy(enum.Enum):
    ALWAYS = "always"
    INTERVAL = "interval"
    NONE = "none"


class Persistence:
    """The persist dir of one rank: writes snapshots and the update log, and restores them."""

    def __init__(
        self,
        rank: int,
        root: str | Path,
        policy: FsyncPolicy = FsyncPolicy.ALWAYS,
        interval: float = FSYNC_INTERVAL_S,
    ) -> None:
        self.rank = rank
        self.root = Path(root)
        self.policy = policy
        self.interval = interval
        self._lock = threading.RLock()
        self._tables: dict[str, PersistTable] = {}
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        self._snapshot_source: Callable[[str, int], AbstractContextManager[tuple]] | None = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise disk_error(rank, self.root, err) from None
        if policy is FsyncPolicy.INTERVAL:
            self._flusher = threading.Thread(
                target=self._flush_loop, name="persist-fsync", daemon=True
            )
            self._flusher.start()

    @property
    def sync_snapshots(self) -> bool:
        return self.policy is not FsyncPolicy.NONE

    # ------------------------------------------------------------ tables

    def _table(self, name: str) -> PersistTable:
        with self._lock:
            table = self._tables.get(name)
            if table is None:
                table = self._tables[name] = PersistTable(self.root / file_name(name), self._lock)
            return table

    def _append(self, name: str, record: LogRecord, sync: bool = False) -> None:
        """Append one record to the table's log; fsync it now when `sync` and the policy is always."""
        table = self._table(name)
        with self._lock:
            try:
                fsync = sync and self.policy is FsyncPolicy.ALWAYS
                table.append(name, record, fsync=fsync, sync_folder=self.sync_snapshots)
            except OSError as err:
                raise disk_error(self.rank, table.path / LOG_NAME, err) from None

    def _flush_loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.flush()

    def flush(self) -> None:
        """fsync every log written since the last flush (the interval policy's thread calls this)."""
        with self._lock:
            dirty = [(t, t.log_file) for t in self._tables.values() if t.dirty and t.log_file]
            for table, log_file in dirty:
                try:
                    os.fsync(log_file.fileno())
                    table.dirty = False
                except OSError as err:
                    log.error(
                        "rank %d: fsync of %s failed: %s", self.rank, table.path / LOG_NAME, err
                    )

    # ------------------------------------------------------------ what the store calls

    def is_update(self, name: str, version: int) -> bool:
        """Whether (name, version) is a row update's copy (persisted by the log, not by a snapshot)."""
        with self._lock:
            return version in self._table(name).copies

    def note_copy(self, name: str, version: int, source_version: int) -> None:
        """Log that `version` starts as a copy of `source_version` (an update's new version)."""
        self._append(
            name, LogRecord({"kind": "copy", "version": version, "source": source_version})
        )
        with self._lock:
            self._table(name).copies[version] = source_version

    def log_rows(
        self, name: str, version: int, shard_index: int, rows: np.ndarray, values: torch.Tensor
    ) -> None:
        """Log rows (local row indices of shard `shard_index`) and their new values before they are written."""
        data = np.ascontiguousarray(rows, dtype="<i8").tobytes() + bytes(
            tensor_memory(values.contiguous())
        )
        self._append(
            name,
            LogRecord(
                {"kind": "rows", "version": version, "shard": shard_index, "count": int(rows.size)},
                data,
            ),
        )

    def promote(
        self,
        name: str,
        version: int,
        meta: ShardedTensorMetadata,
        options: TensorOptions,
        shards: dict[int, torch.Tensor],
        checksums: dict[int, int] | None = None,
    ) -> None:
        """Make (name, version) durable before it is served: "promote" in the log for an update, else a
        snapshot (when it has none yet) with the shards' `checksums`; nothing for a version that is not
        durable."""
        if not options.durable:
            return
        if self.is_update(name, version):
            self._append(name, LogRecord({"kind": "promote", "version": version}), sync=True)
            return
        self.snapshot(name, version, meta, options, shards, checksums)

    def snapshot(
        self,
        name: str,
        version: int,
        meta: ShardedTensorMetadata,
        options: TensorOptions,
        shards: dict[int, torch.Tensor],
        checksums: dict[int, int] | None = None,
    ) -> None:
        """Write every local shard of a whole version and then its manifest (the commit point on disk), each
        shard with its checksum (hashed here where `checksums` lacks it); nothing for a version that is not
        durable."""
        table = self._table(name)
        with self._lock:
            if version in table.snapshots or not options.durable:
                return
        try:
            table.make_folder(name, sync=self.sync_snapshots)
            files = write_version_shards(
                table.path,
                self.rank,
                name,
                version,
                shards,
                sync=self.sync_snapshots,
                checksums=checksums,
            )
            write_manifest(
                table.path,
                name,
                version,
                files,
                meta=meta,
                options=options,
                sync=self.sync_snapshots,
            )
        except OSError as err:
            raise disk_error(self.rank, Path(err.filename or table.path), err) from None
        self._snapshotted(table, name, version, len(shards))

    def _snapshotted(self, table: PersistTable, name: str, version: int, shards: int) -> None:
        with self._lock:
            table.snapshots.add(version)
        log.info(
            "rank %d persisted %r version %d (%d shards) in %s",
            self.rank,
            name,
            version,
            shards,
            table.path,
        )

    def promote_many(self, items: Sequence[PromoteItem]) -> None:
        """Make a batch of versions durable before any is served, with one sync round for the batch, not one
        per file: every shard file written, one sync of the filesystem, then every manifest and "promote"
        record, one sync more (the manifest stays the commit point). Not-durable versions write nothing."""
        durable = [item for item in items if item.options.durable]
        if len(durable) <= 1:
            for item in durable:
                self.promote(
                    item.name, item.version, item.meta, item.options, item.shards, item.checksums
                )
            return
        updates = [item for item in durable if self.is_update(item.name, item.version)]
        fresh: dict[tuple[str, int], PromoteItem] = {}
        for item in durable:
            table = self._table(item.name)
            with self._lock:
                if item.version not in table.snapshots and item.version not in table.copies:
                    fresh[(item.name, item.version)] = item
        try:
            written = []
            for item in fresh.values():
                table = self._table(item.name)
                table.make_folder(item.name, sync=False)
                files = write_version_shards(
                    table.path,
                    self.rank,
                    item.name,
                    item.version,
                    item.shards,
                    sync=False,
                    checksums=item.checksums,
                )
                written.append((table, item, files))
            self._sync_batch()
            for table, item, files in written:
                write_manifest(
                    table.path,
                    item.name,
                    item.version,
                    files,
                    meta=item.meta,
                    options=item.options,
                    sync=False,
                )
            for item in updates:
                self._append(item.name, LogRecord({"kind": "promote", "version": item.version}))
            self._sync_batch()
        except OSError as err:
            raise disk_error(self.rank, Path(err.filename or self.root), err) from None
        for table, item, _ in written:
            self._snapshotted(table, item.name, item.version, len(item.shards))

    def _sync_batch(self) -> None:
        """One sync of every file written so far (not under --fsync none)."""
        if self.sync_snapshots:
            sync_filesystem(self.root)

    def drop(self, name: str, version: int) -> None:
        """Forget a dropped version on disk (0: the whole tensor). A snapshot an update's log still builds on
        stays until the next compaction."""
        table = self._table(name)
        try:
            if version == 0:
                with self._lock:
                    if table.log_file is not None:
                        table.log_file.close()
                    self._tables.pop(name, None)
                shutil.rmtree(table.path, ignore_errors=True)
                return
            with self._lock:
                known = version in table.snapshots or version in table.copies
                based_on = version in table.copies.values()
            if version in table.copies or based_on:
                self._append(name, LogRecord({"kind": "drop", "version": version}))
            if known and not based_on and version in table.snapshots:
                table.remove_snapshot(version)
        except OSError as err:
            log.warning(
                "rank %d: forgetting %r version %d on disk failed: %s",
                self.rank,
                name,
                version,
                err,
            )

    # ------------------------------------------------------------ compaction

    def set_snapshot_source(
        self, source: Callable[[str, int], AbstractContextManager[tuple]]
    ) -> None:
        """`source(name, version)`: a context that holds a served version (leased) and yields its (metadata,
        options, shards): what compaction snapshots."""
        self._snapshot_source = source

    def served(self, name: str, version: int, meta: ShardedTensorMetadata) -> None:
        """(name, version) is served now: compact its log in the background once it outgrew the table."""
        if not self.is_update(name, version):
            return
        table = self._table(name)
        threshold = max(sum(meta.shard_nbytes(i) for i in meta.shards_on(self.rank)), 1 << 20)
        with self._lock:
            table.newest_served = max(table.newest_served, version)
            if table.compacting or table.log_bytes <= threshold:
                return
            table.compacting = True
        threading.Thread(
            target=self._compact, args=(name, threshold), name="persist-compact", daemon=True
        ).start()

    def compacting(self, name: str) -> bool:
        """Whether a compaction of `name`'s log is running now."""
        with self._lock:
            return self._table(name).compacting

    def _compact(self, name: str, threshold: int) -> None:
        """Snapshot the newest served update version, then start the log afresh and remove older snapshots;
        again while the log is still over `threshold` (updates went on meanwhile)."""
        table = self._table(name)
        done = 0
        try:
            while True:
                with self._lock:
                    version = table.newest_served
                    if (
                        version <= done
                        or table.log_bytes <= threshold
                        or self._snapshot_source is None
                    ):
                        return
                try:
                    with self._snapshot_source(name, version) as (meta, options, shards):
                        self.snapshot(name, version, meta, options, shards)
                except (StaleVersion, TensorNotFound):  # replaced or deleted meanwhile
                    done = version
                    continue
                self._table(name).restart_log(version)
                done = version
                log.info(
                    "rank %d compacted the update log of %r into version %d",
                    self.rank,
                    name,
                    version,
                )
        except Exception as err:  # noqa: BLE001 - a background task must log, not vanish
            log.error("rank %d: compacting %r failed: %s", self.rank, name, err)
        finally:
            with self._lock:
                table.compacting = False

    def close(self) -> None:
        self._stop.set()
        if self._flusher is not None:
            self._flusher.join(timeout=2.0)
        self.flush()
        with self._lock:
            for table in self._tables.values():
                if table.log_file is not None:
                    table.log_file.close()
                    table.log_file = None

    # ------------------------------------------------------------ restore

    def restore(
        self,
        empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor],
        device: torch.device,
        progress: Callable[[RestoreCount], None] | None = None,
        corrupt: Callable[[str, str], None] | None = None,
    ) -> list[RestoredVersion]:
        """Every version to hold again, read from disk and checked against its checksums
        (server/rank/persist_restore.py; `corrupt` hears of each tensor left out); the tables learn which
        snapshots and update copies their folders hold."""
        out: list[RestoredVersion] = []
        for restored in restore_dir(self.root, self.rank, empty, device, progress, corrupt):
            with self._lock:
                table = self._tables.setdefault(
                    restored.name, PersistTable(restored.folder, self._lock)
                )
                table.snapshots = set(restored.snapshots)
                table.copies = dict(restored.copies)
            out.extend(restored.versions)
        return out


def parse_policy(text: str) -> FsyncPolicy:
    try:
        return FsyncPolicy(text)
    except ValueError:
        raise InvalidArgument(f"--fsync {text!r} is not one of always, interval, none") from None
