"""DCP checkpoint loads and saves, driven by the coordinator as collective jobs over the whole world.

Load(path, [(name, layout)]): the coordinator checks the checkpoint's
`.metadata` (every name a tensor of it, same size), takes the names' locks,
records every new version PENDING (invisible), reserves its memory on the
ranks, and runs one "checkpoint_load" job on every rank of the world (DCP's
collectives run on the default process group): each rank reads its own shards
straight from the files. Only when every rank succeeded are the versions
promoted on the ranks and then committed in the catalog, all of them; on any
failure every new version is dropped, so a failed load leaves nothing visible.

Save(path, names): with the names' locks held (no update can replace a
version while it is written), one "checkpoint_save" job on every rank writes
the READY versions as one DCP checkpoint that torch.distributed.checkpoint.load
reads into plain tensors, DTensors or ShardedTensors of any layout. It is
written into a staging directory inside `path` and moved into place only once
every rank succeeded, so a failed save leaves the checkpoint that was there.

Jobs are numbered by the same CollectiveRunner as reshards (coordinator/collectives.py), so checkpoint
jobs and reshards enter collectives in one order on every rank.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Generator, Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Protocol

import torch

from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.server.common.access import caller
from shardserve.server.common.errors import (
    InvalidArgument,
    InvalidState,
    RankUnavailable,
    TensorBusy,
    TensorExists,
    TensorNotFound,
)
from shardserve.server.coordinator.catalog.records import TensorRecord
from shardserve.server.coordinator.drivers.collectives import CollectiveRunner, job_timeout
from shardserve.server.coordinator.drivers.context import DriverContext
from shardserve.server.coordinator.drivers.orders import LoadOrder, SaveOrder, check_path
from shardserve.server.coordinator.drivers.quotas import ByteQuotas
from shardserve.server.coordinator.ranks.calls import Allocation
from shardserve.server.coordinator.ranks.jobs import CheckpointJob, CheckpointKind

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
STAGING_PREFIX = ".saving-"  # a save is written into PATH/.saving-XXXX, then moved into PATH (replace_checkpoint)
_METADATA = ".metadata"
_DATA_SUFFIX = ".distcp"


@dataclass(frozen=True)
class CheckpointStep:
    """A load's or save's progress: bytes moved of the total over all ranks; once done, the tensors."""

    bytes_done: int
    bytes_total: int
    done: bool = False
    tensors: tuple[TensorRecord, ...] = ()


def checkpoint_contents(path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors of the DCP checkpoint at `path`: {name: (size, dtype)}."""
    from shardserve.server.common.dcp_metadata import (
        checkpoint_tensors,  # DCP is imported on first use, not at start-up
    )

    try:
        entries = checkpoint_tensors(check_path(path))
    except FileNotFoundError as err:
        raise TensorNotFound(str(err)) from None
    except (OSError, ValueError) as err:
        raise InvalidArgument(f"path {path!r}: {err}") from None
    return {key: (tuple(size), dtype) for key, (size, dtype) in sorted(entries.items())}


class VersionLifecycle(Protocol):
    """What a load needs of the tensor lifecycle: make room for new versions, and forget them again."""

    def make_room(self, name: str, overwrite: bool) -> None: ...

    def drop_version(self, record: TensorRecord) -> None: ...

    def drop_on_ranks(self, records: Iterable[TensorRecord]) -> None: ...


class CheckpointDriver:
    """LoadCheckpoint / SaveCheckpoint on the coordinator."""

    def __init__(
        self,
        context: DriverContext,
        *,
        collectives: CollectiveRunner,
        versions: VersionLifecycle,
        quotas: ByteQuotas,
        default_timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.catalog, self.registry, self.calls, self.locks = (
            context.catalog,
            context.registry,
            context.calls,
            context.locks,
        )
        self.quotas = quotas
        self.collectives = collectives
        self.versions = versions
        self.default_timeout_s = default_timeout_s

    def _world(self) -> list[int]:
        """Every rank of the torch.distributed world, all of which must be registered and alive."""
        ranks = self.registry.ranks()
        if not ranks:
            raise RankUnavailable("no rank is registered")
        world = ranks[0].world_size
        alive = {r.rank for r in ranks if r.alive}
        missing = sorted(set(range(world)) - alive)
        if missing:
            raise RankUnavailable(
                f"checkpoints need every rank of the world ({world}); ranks {missing} are "
                f"not registered or not alive"
            )
        return list(range(world))

    def _timeout(self, value: float) -> float:
        return job_timeout(value, self.default_timeout_s)

    def load(self, order: LoadOrder) -> Iterator[CheckpointStep]:
        """Load tensors as new versions: all READY at the end, or none visible after a failure."""
        path = order.path
        timeout_s = self._timeout(order.timeout_s)
        saved = checkpoint_contents(path)
        layouts = dict(order.layouts)
        for i, (name, meta) in enumerate(layouts.items()):
            if name not in saved:
                raise TensorNotFound(
                    f"tensors[{i}].name: tensor {name!r} is not in checkpoint {path} "
                    f"(it holds {sorted(saved)})"
                )
            if saved[name][0] != meta.size:
                raise InvalidArgument(
                    f"tensors[{i}].metadata: size {meta.size} but {name!r} is "
                    f"{saved[name][0]} in the checkpoint"
                )
            self.registry.check_placements(meta)
        world = self._world()
        with ExitStack() as locks:
            for name in sorted(layouts):
                locks.enter_context(self.locks.hold(name))
            for name in layouts:
                if self.catalog.ready(name) is not None and not order.overwrite:
                    raise TensorExists(
                        f"tensor {name!r} already exists; pass overwrite=True to replace it"
                    )
            for name in layouts:
                self.versions.make_room(name, order.overwrite)
            new = self._record(layouts)
            checksums = {}
            try:
                yield from self._run_load(path, new, world, timeout_s)
                for record in new:
                    checksums[record.key] = self.calls.promote(
                        record.ranks(),
                        record.name,
                        record.version,
                        f"promote {record.name!r} version {record.version}",
                    )
            except BaseException:
                for record in new:
                    self.versions.drop_version(record)
                log.warning(
                    "checkpoint load from %s failed; versions %s dropped",
                    path,
                    [(r.name, r.version) for r in new],
                )
                raise
            ready = []
            for committed, older in self.catalog.commit_all(
                [(r.name, r.version) for r in new], checksums=checksums
            ):
                ready.append(committed)  # every tensor READY in one transaction, or none
                self.versions.drop_on_ranks(older)
        log.info("loaded %s from %s", [(r.name, r.version) for r in ready], path)
        total = sum(r.nbytes for r in ready)
        yield CheckpointStep(total, total, done=True, tensors=tuple(ready))

    def _record(self, layouts: dict[str, ShardedTensorMetadata]) -> list[TensorRecord]:
        """Catalog rows (PENDING) and reserved memory on the ranks for every new version, once the caller's byte
        quota admits them all."""
        new: list[TensorRecord] = []
        principal = caller()
        owner = principal.name if principal is not None else ""
        try:
            for name, meta in layouts.items():
                record = TensorRecord(
                    name=name,
                    version=self.catalog.next_versions(1)[0],
                    metadata=meta,
                    created_unix=time.time(),
                    owner=owner,
                )
                with self.quotas.admit(
                    principal,
                    {
                        n: m.shards_nbytes()
                        for n, m in layouts.items()
                        if n not in {r.name for r in new}
                    },
                ):
                    self.catalog.add(record)
                new.append(record)
                self.calls.allocate(
                    meta.ranks(),
                    record,
                    Allocation(reserve_only=True),
                    f"reserve {name!r} version {record.version}",
                )
        except BaseException:
            for record in new:
                self.versions.drop_version(record)
            raise
        return new

    def _run_load(
        self, path: str, new: list[TensorRecord], world: list[int], timeout_s: float
    ) -> Iterator[CheckpointStep]:
        job = CheckpointJob(CheckpointKind.LOAD, path, tuple(new), timeout_s)
        yield from _progress(
            self.collectives.run(job, world, f"checkpoint load from {path}"), _job_bytes(new)
        )

    def save(self, order: SaveOrder) -> Iterator[CheckpointStep]:
        """Write READY tensors (all when no names are given) as one DCP checkpoint at `path`."""
        path = order.path
        timeout_s = self._timeout(order.timeout_s)
        names = list(order.names) or [record.name for record in self.catalog.list()]
        if not names:
            raise InvalidState("there is no tensor to save")
        known = {record.name for record in self.catalog.list()}
        unknown = next((name for name in names if name not in known), None)
        if (
            unknown is not None
        ):  # before any lock: asking for a million unknown names must cost no more than a scan
            raise TensorNotFound(f"tensor {unknown!r} not found")
        world = self._world()
        with ExitStack() as locks:
            for name in sorted(names):
                locks.enter_context(self.locks.hold(name))
            records = []
            for name in names:
                record = self.catalog.ready(name)
                if record is None:
                    raise TensorNotFound(f"tensor {name!r} not found")
                records.append(record)
            if any(record.promoting for record in records):
                raise TensorBusy(
                    f"tensor {next(r.name for r in records if r.promoting)!r}: its last "
                    f"reshard's promotion is unfinished on some rank; save once it is done"
                )
            try:
                os.makedirs(path, exist_ok=True)
                staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=path)
            except OSError as err:
                raise InvalidArgument(f"path {path!r}: {err.strerror}") from None
            job = CheckpointJob(CheckpointKind.SAVE, staging, tuple(records), timeout_s)
            try:
                yield from _progress(
                    self.collectives.run(job, world, f"checkpoint save to {path}"),
                    _job_bytes(records),
                )
                replace_checkpoint(staging, path)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        log.info("saved %s to %s", [(r.name, r.version) for r in records], path)
        total = sum(r.nbytes for r in records)
        yield CheckpointStep(total, total, done=True, tensors=tuple(records))


def replace_checkpoint(staging: str, path: str) -> None:
    """Move the finished DCP checkpoint in `staging` into `path`, replacing the checkpoint there.

    The old `.metadata` goes first and the new one comes last, so `path` never pairs one checkpoint's metadata
    with another's data files (a crash in between leaves no `.metadata`: not loadable, never mixed). The old
    checkpoint's data files that the new one does not overwrite are removed; other files in `path` stay."""
    new_files = set(os.listdir(staging)) - {_METADATA}
    old_metadata = os.path.join(path, _METADATA)
    if os.path.exists(old_metadata):
        os.remove(old_metadata)
    for name in os.listdir(path):
        if name.endswith(_DATA_SUFFIX) and name not in new_files:
            os.remove(os.path.join(path, name))
    for name in sorted(new_files):
        os.replace(os.path.join(staging, name), os.path.join(path, name))
    os.replace(os.path.join(staging, _METADATA), old_metadata)


def _job_bytes(records: list[TensorRecord]) -> int:
    """The bytes a checkpoint job moves over all ranks: every shard of every tensor (each rank reports its own;
    a rank still queued behind another job has not said yet)."""
    return sum(record.held_bytes for record in records)


def _progress(
    runner: Generator[tuple[int, int], None, object], total: int
) -> Iterator[CheckpointStep]:
    """Progress messages from a CollectiveRunner.run generator (its return value is dropped), out of the job's
    `total` bytes from the first message on."""
    try:
        while True:
            done, _ = next(runner)
            yield CheckpointStep(min(done, total), total)
    except StopIteration:
        return
