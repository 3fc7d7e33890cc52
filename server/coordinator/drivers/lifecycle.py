"""The coordinator's tensor lifecycle: create, commit, abort and drop versions of tensors.

Operations on one tensor name are serialized by its name lock; different names proceed in parallel. A tensor
becomes visible only when every rank has promoted its shards and the catalog record turns READY in one
transaction. Row updates of one table are grouped into versions by server/coordinator/drivers/update_groups.py.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.server.common.access import caller
from shardserve.server.common.errors import (
    InvalidArgument,
    InvalidState,
    ServiceError,
    StaleVersion,
    TensorBusy,
    TensorExists,
    TensorNotFound,
)
from shardserve.server.common.requests import check_name, check_put_token, check_version
from shardserve.server.coordinator.catalog.records import (
    Init,
    TensorOptions,
    TensorRecord,
    TensorState,
)
from shardserve.server.coordinator.drivers.context import DriverContext
from shardserve.server.coordinator.drivers.quotas import ByteQuotas
from shardserve.server.coordinator.drivers.update_groups import Ordered, UpdateGroups
from shardserve.server.coordinator.ranks.calls import Allocation, versions_by_rank
from shardserve.server.coordinator.ranks.health import check_copies, unavailable_shards

if TYPE_CHECKING:
    from shardserve.protos import shardserve_pb2 as pb

log = logging.getLogger(__name__)

ABORTED_TOKENS_KEPT = (
    4096  # put tokens remembered as aborted, so their late CreateTensor is refused
)


@dataclass(frozen=True)
class NewTensor:
    """A CreateTensor call, checked: the version to make, how its shards are filled, and whether it may
    replace the READY version (`overwrite`). With Init.COPY, `source_version` is the READY version copied (0:
    whichever is READY, in its own layout: a row update, grouped with the table's other updates)."""

    name: str
    metadata: ShardedTensorMetadata
    init: Init = Init.NONE
    seed: int = 0
    options: TensorOptions = field(default_factory=TensorOptions)
    overwrite: bool = False
    source_version: int = 0
    put_token: str = ""
    # a same-host writer's: its ranks open a version it fills for in-place writes
    writer_host_id: str = ""
    # a reservation of the writer's next put: made only while no put is pending, dropped by any create
    reserve: bool = False


class ReplacedVersions(Protocol):
    """What the lifecycle needs of the reshard driver: dropping the version a committed reshard replaced."""

    def drop_replaced(self, name: str) -> None: ...


class TensorLifecycle:
    """Create/commit/abort/drop of tensor versions, in the catalog and on the ranks holding them.

    Removing is "drop" throughout: `drop` (DeleteTensor) a tensor's every version, `drop_version` /
    `drop_versions` some versions from the catalog and their ranks, `drop_on_ranks` versions already out of
    the catalog."""

    def __init__(
        self,
        context: DriverContext,
        *,
        quotas: ByteQuotas,
        replaced: ReplacedVersions,
    ) -> None:
        self.catalog, self.registry, self.calls, self.locks = (
            context.catalog,
            context.registry,
            context.calls,
            context.locks,
        )
        self.quotas = quotas
        self.replaced = replaced
        self.update_groups: UpdateGroups[TensorRecord] = UpdateGroups()
        self._aborted_tokens: OrderedDict[tuple[str, str], None] = OrderedDict()  # newest last

    def create(self, new: NewTensor) -> Ordered[TensorRecord]:
        """Record a PENDING version and allocate it on every holding rank; with a fill, commit it too. A row
        update joins the table's update group when one is collecting (its place is the answer's order)."""
        if new.init is not Init.COPY:
            self.registry.check_placements(new.metadata)
            made, writable = self._create(new)
            return Ordered(made, writable=writable)
        if new.source_version:  # a copy of one given version: an update group of its own
            return Ordered(self._make_update(new))
        joined = self.update_groups.enter(new.name, new.put_token, self._abort_stale_update)
        if joined is None:
            return Ordered(self._make_update(new, claimed=True))
        version, order = joined
        record = self.catalog.get(new.name, version)
        if record is None:
            raise TensorBusy(
                f"update version {version} of tensor {new.name!r} was aborted while joining it; ask again"
            )
        return Ordered(record, order)

    def _make_update(self, new: NewTensor, claimed: bool = False) -> TensorRecord:
        """Make the pending Init.COPY version of an update group (member 0), claiming the group unless
        `claimed`; later updates of the table join it (UpdateGroups)."""
        if not claimed:
            self.update_groups.enter(new.name, new.put_token, self._abort_stale_update, join=False)
        try:
            record, _ = self._create(new)
        except BaseException:
            self.update_groups.cancel(new.name)
            raise
        self.update_groups.bind(new.name, record.version)
        return record

    def _abort_stale_update(self, name: str, version: int) -> None:
        log.warning(
            "aborting update %r version %d: pending for more than the update timeout", name, version
        )
        try:
            self.abort(name, version)
        except ServiceError as err:
            log.info("aborting stale update %r version %d: %s", name, version, err.message)

    def _create(self, new: NewTensor) -> tuple[TensorRecord, list[pb.WritableShard]]:
        """The new version, recorded and allocated, and the shards its ranks opened for the writer's in-place
        writes (a version its writer fills, for a same-host writer)."""
        name, token = new.name, new.put_token
        with self.locks.hold(name):
            if token and (name, token) in self._aborted_tokens:
                raise TensorBusy(
                    f"put_token {token!r} of {name!r} was aborted (AbortTensor) before this "
                    f"CreateTensor ran"
                )
            meta, options, source_version = new.metadata, new.options, 0
            missing: list[int] = []
            principal = caller()
            owner = principal.name if principal is not None else ""
            if new.init is Init.COPY:
                source = self._copy_source(new)  # source_version 0: the READY version's own layout
                meta, options = source.metadata, source.options
                missing, source_version = self._missing_copies(source), source.version
                self.registry.check_placements(meta, skip=set(missing))
                principal, owner = None, source.owner  # an update keeps the table's owner and size
            self.make_room(name, new.overwrite, put_token=token, reserve=new.reserve)
            record = TensorRecord(
                name=name,
                version=self.catalog.next_versions(1)[0],
                metadata=meta,
                options=options,
                created_unix=time.time(),
                put_token=token,
                lost_shards=tuple(missing),
                owner=owner,
                reserved=new.reserve,
            )
            with self.quotas.admit(principal, {name: record.held_bytes}):
                self.catalog.add(record)
            allocation = Allocation(init=new.init, seed=new.seed, source_version=source_version)
            what = f"allocate {name!r} version {record.version}"
            writable: list[pb.WritableShard] = []
            try:
                if new.writer_host_id and new.init is Init.NONE:
                    writable = self.calls.allocate_many(
                        {rank: [record] for rank in record.holding_ranks()},
                        what,
                        writer_host_id=new.writer_host_id,
                    )
                else:
                    self.calls.allocate(record.holding_ranks(), record, allocation, what)
            except ServiceError:
                self.drop_version(record)
                raise
            log.info(
                "created %r version %d (%d bytes on ranks %s)",
                name,
                record.version,
                meta.nbytes,
                list(meta.ranks()),
            )
            if new.init in (Init.NONE, Init.COPY):
                return record, writable
            return self._commit_locked(name, record.version), writable

    def commit(
        self, name: str, version: int, *, written_in_place: bool = False
    ) -> Ordered[TensorRecord]:
        """Promote (name, version) on every holding rank, then mark it READY and drop older versions
        (`written_in_place`: the shards create opened for in-place writes were filled by their writer). An
        update group's version is promoted by its last member's commit (UpdateGroups.finish)."""
        check_name(name)
        check_version(version)
        return self.update_groups.finish(
            name,
            version,
            lambda: self._commit_named(name, version, written_in_place),
            self._abort_stale_update,
        )

    def _commit_named(self, name: str, version: int, written_in_place: bool) -> TensorRecord:
        with self.locks.hold(name):
            return self._commit_locked(name, version, written_in_place=written_in_place)

    def abort(self, name: str, version: int) -> None:
        """Forget a PENDING version and drop its shards on the ranks."""
        check_name(name)
        check_version(version)
        with self.locks.hold(name):
            self._abort_locked(name, version)

    def abort_put(self, name: str, token: str) -> int:
        """Abort the PENDING version of `name` made with put_token `token`, if any (a client whose CreateTensor
        answer was lost does not know its version), and refuse that token from now on: the version aborted,
        or 0."""
        check_name(name)
        if not check_put_token(token):
            raise InvalidArgument("put_token is empty; give version or put_token")
        joined = self.update_groups.version_of_token(name, token)
        if joined:  # a member of an update group: its version holds the other members' rows too
            with contextlib.suppress(TensorNotFound):
                self.abort(name, joined)
            return joined
        with self.locks.hold(name):
            self._aborted_tokens[(name, token)] = None
            while len(self._aborted_tokens) > ABORTED_TOKENS_KEPT:
                self._aborted_tokens.popitem(last=False)
            for record in self.catalog.versions(name):
                if record.put_token == token and not record.ready:
                    self._abort_locked(name, record.version)
                    return record.version
        return 0

    def _abort_locked(self, name: str, version: int) -> None:
        record = self.catalog.get(name, version)
        if record is None:
            raise TensorNotFound(f"tensor {name!r} version {version} not found")
        if record.ready:
            raise InvalidState(
                f"tensor {name!r} version {version} is committed; use DeleteTensor to remove it"
            )
        self.drop_version(record)
        log.info("aborted %r version %d", name, version)

    def get(self, name: str) -> TensorRecord:
        """The READY version of `name`."""
        check_name(name)
        record = self.catalog.ready(name)
        if record is None:
            raise TensorNotFound(f"tensor {name!r} not found")
        return record

    def drop(self, name: str) -> None:
        """Drop every version of `name` (DeleteTensor): out of the catalog, then freed on the ranks."""
        check_name(name)
        with self.locks.hold(name):
            if self.catalog.ready(name) is None:
                raise TensorNotFound(f"tensor {name!r} not found")
            removed = self.catalog.remove(name)
            self.update_groups.end(name)
            ranks = sorted({r for record in removed for r in record.ranks()})
            self.calls.drop_quietly(name, 0, ranks)
            self.replaced.drop_replaced(
                name
            )  # a reshard's replaced version, if its promotion was unfinished
        log.info("deleted %r (versions %s)", name, [r.version for r in removed])

    def _commit_locked(
        self, name: str, version: int, *, written_in_place: bool = False
    ) -> TensorRecord:
        record = self.catalog.get(name, version)
        if record is None:
            raise TensorNotFound(
                f"tensor {name!r} version {version} not found (never created, aborted or replaced)"
            )
        if record.ready:
            return record
        newer = [r.version for r in self.catalog.versions(name) if r.ready and r.version > version]
        if (
            newer
        ):  # committing below it would be acknowledged yet never served: the newer version wins
            self.drop_version(record)
            raise TensorBusy(
                f"tensor {name!r} version {version} was overtaken while pending: version {newer[-1]} "
                f"(a reshard or checkpoint load) was committed meanwhile; version {version} is aborted, "
                f"make the change again"
            )
        checksums = self._promote(record, written_in_place)
        ready, older = self.catalog.commit(
            name, version, durable=record.options.durable, checksums=checksums
        )
        self.drop_on_ranks(older)
        log.info(
            "committed %r version %d%s",
            name,
            version,
            f", replacing versions {[o.version for o in older]}" if older else "",
        )
        return ready

    def _promote(self, record: TensorRecord, written_in_place: bool) -> dict[int, int]:
        """Promote `record` on every holding rank (its in-place shards counted written first when its writer
        says it filled them); the checksum of each shard, by index."""
        name, version = record.name, record.version
        what = f"commit {name!r} version {version}"
        if not written_in_place:
            return self.calls.promote(record.holding_ranks(), name, version, what)
        promoted = self.calls.promote_many(
            {rank: [(name, version)] for rank in record.holding_ranks()},
            what,
            finish_in_place=True,
        )
        return dict(promoted.checksums.get((name, version), {}))

    def _copy_source(self, new: NewTensor) -> TensorRecord:
        """Init.COPY: the READY version `source_version` of the name, checked to have the same layout; with
        source_version 0, whatever version is READY now, in its own layout (the request's is not checked)."""
        name = new.name
        source = self.catalog.ready(name)
        if source is None:
            raise TensorNotFound(
                f"tensor {name!r} not found (init INIT_COPY copies a READY version)"
            )
        if not new.source_version:
            if not new.overwrite:
                raise InvalidArgument(
                    "overwrite must be set with init INIT_COPY (the copy replaces the READY "
                    "version)"
                )
            return source
        if new.source_version != source.version:
            raise StaleVersion(
                f"source_version {new.source_version} of {name!r} is not the READY "
                f"version; the READY version is {source.version}"
            )
        if source.metadata != new.metadata:
            raise InvalidArgument(
                f"metadata differs from the layout of {name!r} version {source.version}; "
                f"INIT_COPY keeps the layout"
            )
        if not new.overwrite:
            raise InvalidArgument(
                "overwrite must be set with init INIT_COPY (the copy replaces the READY version)"
            )
        return source

    def _missing_copies(self, source: TensorRecord) -> list[int]:
        """The copies of `source` an Init.COPY version starts without (lost, or on dead ranks: written to the
        live copies only, repaired later); DATA_LOSS or UNAVAILABLE when a box has no live copy to copy."""
        missing = unavailable_shards(source, self.registry.rank_unreadable)
        check_copies(source, missing, doing="updated")
        if missing:
            log.warning(
                "%r: the new version starts without copies %s (their ranks are down or lost them); the "
                "coordinator repairs them",
                source.name,
                missing,
            )
        return missing

    def make_room(
        self, name: str, overwrite: bool, *, put_token: str = "", reserve: bool = False
    ) -> None:
        """ALREADY_EXISTS unless `overwrite`; with it, abort any put of `name` still pending. A pending version
        made under `put_token` is the same put made again (its first answer was lost, as when the coordinator
        that made it died and the client asked the next leader): it is aborted, overwrite or not. A reservation
        of a writer's next put is dropped by any create and never refuses one; a new reservation (`reserve`)
        is refused (ABORTED) while another put of `name` is pending, which it must not abort."""
        records = self.catalog.versions(name)
        ready = [r.version for r in records if r.ready]
        pending = [r for r in records if r.state is TensorState.PENDING]
        others = [
            r for r in pending if not r.reserved and (not put_token or r.put_token != put_token)
        ]
        if reserve and others:
            raise TensorBusy(
                f"tensor {name!r} has a put in progress (version {others[-1].version}); "
                f"its next put is not reserved"
            )
        if ready and not overwrite:
            raise TensorExists(
                f"tensor {name!r} already exists (version {ready[-1]}); "
                f"pass overwrite=True to replace it"
            )
        if others and not overwrite:
            raise TensorExists(
                f"tensor {name!r} has a put in progress (version {others[-1].version}); "
                f"pass overwrite=True to abort it"
            )
        for record in pending:
            self.drop_version(record)

    def drop_version(self, record: TensorRecord) -> None:
        """Drop a version: out of the catalog, then freed on its ranks (and its update slot, if an update's)."""
        self.drop_versions([record])

    def drop_versions(self, records: list[TensorRecord]) -> None:
        """drop_version() of several versions, freed on their ranks with one call per rank."""
        for record in records:
            self.catalog.remove(record.name, record.version)
            self.update_groups.end(record.name, record.version)
        self.drop_on_ranks(records)

    def drop_on_ranks(self, records: Iterable[TensorRecord]) -> None:
        """Free versions just removed from the catalog on their ranks (one DropMany per rank); for a reshard's
        version whose promotion was unfinished, also the version it replaced (only the promotion would have
        dropped that one)."""
        records = list(records)
        self.calls.drop_many_quietly(versions_by_rank(records, TensorRecord.ranks))
        for record in records:
            if record.promoting:
                self.replaced.drop_replaced(record.name)

    # defined last: below it, `list` in this class body would name the method, not the builtin
    def list(self, include_pending: bool = False) -> list[TensorRecord]:
        """Every READY version (and PENDING ones when asked)."""
        return self.catalog.list(include_pending)
