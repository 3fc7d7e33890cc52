"""State dicts from and into SPMD jobs: every rank of a torchrun job calls put_state_dict / get_state_dict.

Both are collective over the job's process group (the default one, or
`group=`); plain single-process code is a world of one. A put writes each
rank's own local shards straight to the shard servers (no gather, nothing
through one process) and commits every tensor as one snapshot of the prefix;
a get fills each rank's local shards in place with exactly its box, whatever
the server layout, every tensor from one snapshot.

    from shardserve.client import connect, spmd
    cluster = connect(address)
    number = spmd.put_state_dict(cluster, model.state_dict(), "policy")        # on every trainer rank
    spmd.get_state_dict(cluster, "policy", into=engine_model.state_dict())     # on every inference rank
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from shardserve.client import arguments
from shardserve.client.casts import put_dtype
from shardserve.client.cluster import Cluster
from shardserve.client.collector import collector_paused
from shardserve.client.delta_writes import Hashes
from shardserve.client.errors import InvalidArgumentError, RankUnavailableError
from shardserve.client.ops.snapshots import (
    abort_snapshot,
    commit_snapshot,
    create_snapshot,
    take_reserved_snapshot,
)
from shardserve.client.reservations import Reservation, reserve_mode
from shardserve.client.spmd_delta import (
    DeltaBase,
    PreviousPut,
    ShardKey,
    create_delta,
    hash_shards,
    my_shards,
    previous_puts,
    snapshot_layouts,
    start_hashing,
    write_changed,
    write_whole,
)
from shardserve.client.spmd_get import (
    get_state_dict as get_state_dict,  # the public name, re-exported
)
from shardserve.client.spmd_group import JobGroup, SpmdError, attempt_step
from shardserve.client.spmd_layouts import balanced, from_spec
from shardserve.client.spmd_packs import PackedState, pack_state
from shardserve.client.spmd_pieces import Piece, report_pieces, resolved_sizes, split_tensors
from shardserve.client.stamps import delta_mode
from shardserve.core.snapshots import JobTensor, job_tensors
from shardserve.protos import shardserve_pb2 as pb

log = logging.getLogger(__name__)

DEFAULT_KEEP = 2


# ---------------------------------------------------------------- put


@collector_paused
def put_state_dict(
    cluster: Cluster,
    state_dict: Mapping[str, Any],
    prefix: str,
    spec: Any = None,
    *,
    replicas: int = 1,
    keep: int = DEFAULT_KEEP,
    group: Any = None,
    plain_writer: int = 0,
    durable: bool = True,
    reserve_next: bool | str = True,
    dtype: torch.dtype | str | None = None,
    delta: bool | str = False,
    pack: bool = False,
) -> int:
    """Collective: write every rank's local shards of `state_dict` and commit them as one snapshot of `prefix`.

    DTensors (1-D or 2-D meshes, Shard/Replicate, uneven), ShardedTensors, LocalShardsWrappers and plain
    tensors (written once, by job rank `plain_writer`); nested dicts flatten to dotted keys. The server layout
    is the job's own boxes placed over the live ranks, balanced by bytes; or `spec` (one spec for every tensor,
    or {key: spec}), whose shards are cut by the job's boxes so that every rank writes only what it holds.
    `keep`: snapshots of the prefix kept once this one commits (older ones are dropped). `durable` False keeps
    the snapshot off the ranks' persist dirs (weights republished every step: a rank's restart loses it).
    `reserve_next`: the commit also reserves the prefix's next snapshot with the same layouts (its memory held
    until then, or the coordinator's pending timeout, or this client's close), so that the next put of the
    same layouts skips creating one; a put whose layouts changed aborts the reservation and creates anew.
    `reserve_next="later"`: the commit answers first and the coordinator reserves after it, while this process
    goes on (its next put waits for the reservation only if it is not made yet): the put returns sooner where
    the host has cores to spare for the reservation, and whatever runs right after it competes with it where
    not. In a job of several processes job rank 0 alone holds a reservation, and sends it to the other ranks
    at the next put (one broadcast); with "later" the job goes on (its next training step) while it is made.
    `dtype` (a floating dtype) stores every floating tensor converted to it (bit for bit `.to(dtype)`, converted
    while copying); integer and bool tensors are stored as they are. `delta`: send and store only the blocks
    (about 1 MiB of rows each) whose bytes changed since this client's previous delta put of the prefix, the
    rest shared with that snapshot on the ranks (client/spmd_delta.py); in full when there is none, the layouts
    changed, or it is no longer the prefix's newest. `delta="version_counters"`: the same, except that a tensor
    whose torch version counter counted no write since the previous delta put is taken as unchanged without
    reading it (client/stamps.py: writes torch does not count, through `.data`, numpy, collectives or raw
    pointers, are then not sent). The commit of a delta put's snapshot reserves the next one as copies of
    it (after it answered), which the next delta put fills instead of creating one; a delta put aborts any
    other reservation of the prefix. `pack`: the plain tensors of at most 64 KiB (on their most
    common device) are stored in a few byte tensors, "packs" (client/spmd_packs.py): a state dict of hundreds
    of small tensors then costs the cluster a few tensors a step; get_state_dict and Snapshot read them as
    before (a put with `spec` packs nothing). Returns the snapshot number. On any failure nothing is visible
    and every rank raises SpmdError. The process's cyclic garbage collector is paused during the call
    (client/collector.py).
    """
    job = JobGroup(group)
    arguments.tensor_name(prefix, "prefix")
    plain_writer = arguments.count(plain_writer, "plain_writer")
    if plain_writer >= job.size:
        raise InvalidArgumentError(
            f"plain_writer {plain_writer} is not a rank of the job (size {job.size})"
        )
    if not isinstance(state_dict, Mapping):
        raise InvalidArgumentError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    reserve, later = reserve_mode(reserve_next)
    is_delta, trusted = delta_mode(delta)
    put = _StatePut(
        cluster,
        job,
        prefix,
        spec=spec,
        replicas=arguments.count(replicas, "replicas", minimum=1),
        keep=arguments.count(keep, "keep", minimum=1),
        plain_writer=plain_writer,
        durable=arguments.flag(durable, "durable"),
        reserve_next=reserve,
        reserve_later=later,
        cast=put_dtype(dtype),
        delta=is_delta,
        trusted=trusted,
        pack=arguments.flag(pack, "pack") and spec is None,
    )
    return put.run(state_dict)


class _StatePut:
    """One collective put of a state dict as a snapshot of `prefix`: describe, then fill the snapshot reserved
    by the last put when it was made for the same layouts on every rank, else create one and fill that."""

    def __init__(
        self,
        cluster: Cluster,
        job: JobGroup,
        prefix: str,
        *,
        spec: Any,
        replicas: int,
        keep: int,
        plain_writer: int,
        durable: bool,
        reserve_next: bool,
        cast: torch.dtype | None,
        delta: bool = False,
        trusted: bool = False,
        reserve_later: bool = False,
        pack: bool = False,
    ) -> None:
        self.cluster, self.session, self.job, self.prefix = cluster, cluster.session, job, prefix
        self.spec, self.replicas, self.keep, self.durable = spec, replicas, keep, durable
        self.plain_writer, self.reserve_next, self.cast = plain_writer, reserve_next, cast
        self.delta, self.trusted, self.reserve_later = delta, trusted, reserve_later
        self.pack = pack
        self.packed = PackedState({}, "")  # the packs this put filled, given back when it ends
        self.local: dict[str, list[Piece]] = {}  # this rank's pieces of each tensor
        self.tensors: dict[
            str, Any
        ] = {}  # the state dict's tensors by key (their version counters)
        self.mine: dict[str, Any] = {}  # this rank's report of them
        self.skeleton = ""  # this rank's non-tensor tree: job rank 0's is stored with the snapshot
        # job rank 0: the next snapshot its commit reserved
        self.reserved: pb.SnapshotInfo | None = None

    def run(self, state_dict: Mapping[str, Any]) -> int:
        try:
            return self._run(state_dict)
        finally:
            self.packed.done()

    def _run(self, state_dict: Mapping[str, Any]) -> int:
        _, error = attempt_step(lambda: self._describe(state_dict))
        reservation = self.session.reservations.take(self.prefix)
        basis = self._basis() if error is None else None
        if self.delta:
            return self._run_delta(reservation, error, basis)
        fits = reservation is not None and basis is not None and reservation.basis == basis
        all_fit = self.job.all_succeed(error, "describing the state dict", also=fits)
        reserved = self._reserved_snapshot(reservation) if all_fit else None
        if reserved is not None and reservation is not None:
            try:
                return self._fill(reserved, reservation.tensors, basis)
            except SpmdError as err:
                log.info("%r: the reserved snapshot failed (%s); creating one", self.prefix, err)
        else:
            self._abort_unused(reservation)
        reports = resolved_sizes(self.job.all_gather(self.mine))
        tensors, created = self.job.from_rank0(
            lambda: self._create(job_tensors(reports)),
            "checking the state dict and creating the snapshot",
        )
        return self._fill(pb.SnapshotInfo.FromString(created), tensors, basis)

    def _run_delta(self, reservation: Reservation | None, error: str | None, basis: Any) -> int:
        """A delta put: only the changed blocks written when every rank's previous put of the prefix had this
        basis and the coordinator copies that snapshot (the copies the previous delta put's commit reserved, when
        it did; else made now), else a put in full (its hashes kept for the next delta put). Any other
        reservation of the prefix is aborted."""
        previous = previous_puts(self.session).take(self.prefix)
        fits = previous is not None and previous.basis == basis
        if not (self.job.all_succeed(error, "describing the state dict", also=fits) and previous):
            self._abort_unused(reservation)
        else:
            delta = start_hashing(  # hashed while the snapshot is made
                previous, self.local, self.job.rank, counters=self.tensors, trusted=self.trusted
            )
            copies = self._reserved_snapshot(reservation)
            if copies is None or copies.delta_of != previous.number:
                self._abort_unused(reservation)
            else:
                try:
                    return self._fill(copies, previous.tensors, basis, delta=delta)
                except SpmdError as err:
                    log.info("%r: the reserved copies failed (%s); copying again", self.prefix, err)
            created = self.job.from_rank0(
                lambda: create_delta(
                    self.session,
                    previous,
                    self.prefix,
                    keep=self.keep,
                    skeleton=self.skeleton,
                    durable=self.durable,
                ),
                "creating the delta snapshot",
            )
            if created is not None:
                return self._fill(
                    pb.SnapshotInfo.FromString(created),
                    previous.tensors,
                    basis,
                    delta=delta,
                )
        reports = resolved_sizes(self.job.all_gather(self.mine))
        tensors, created = self.job.from_rank0(
            lambda: self._create(job_tensors(reports)),
            "checking the state dict and creating the snapshot",
        )
        return self._fill(pb.SnapshotInfo.FromString(created), tensors, basis)

    def _describe(self, state_dict: Mapping[str, Any]) -> None:
        split = split_tensors(state_dict)
        if not split.tensors:
            raise InvalidArgumentError("state_dict holds no tensor")
        self.skeleton, self.tensors = split.skeleton, split.tensors
        if self.pack:
            self.packed = pack_state(
                self.session,
                self.prefix,
                split.tensors,
                split.skeleton,
                cast=self.cast,
                writer=self.job.rank == self.plain_writer,
            )
            self.skeleton, self.tensors = self.packed.skeleton, self.packed.tensors
        self.mine, self.local = report_pieces(
            self.tensors, self.job.rank, self.plain_writer, cast=self.cast
        )

    def _basis(self) -> tuple[Any, ...]:
        """What this rank's part of the layouts is made from: a reservation made from the same serves this put.
        Job rank 0 places balanced layouts over the live ranks, so their list is part of its basis."""
        ranks: tuple[int, ...] = ()
        if self.job.rank == 0 and self.spec is None:
            ranks = tuple(r.rank for r in self.session.recent_ranks() if r.alive)
        return (
            self.mine,
            self.job.size,
            self.spec,
            self.replicas,
            self.keep,
            self.durable,
            self.plain_writer,
            ranks,
        )

    def _create(self, tensors: dict[str, JobTensor]) -> tuple[dict[str, JobTensor], bytes]:
        """Job rank 0: the snapshot created for the job's `tensors` (as bytes, for the broadcast)."""
        created = _create(
            self.cluster,
            self.prefix,
            tensors,
            self.spec,
            self.replicas,
            self.keep,
            skeleton=self.skeleton,
            durable=self.durable,
        )
        return tensors, created.SerializeToString()

    def _fill(
        self,
        snapshot: pb.SnapshotInfo,
        tensors: Mapping[str, JobTensor],
        basis: Any,
        *,
        delta: DeltaBase | None = None,
    ) -> int:
        """Write every rank's shards into the pending `snapshot` (for a delta snapshot, only their blocks changed
        since the `delta`'s previous put) and commit it, keeping the next one if the commit reserved it, and a
        delta put's block hashes; on failure it is aborted (nothing visible) and every rank raises SpmdError."""
        job = self.job
        written: list[Hashes[ShardKey]] = []
        try:
            job.all_done(
                lambda: written.append(self._write(snapshot, tensors, delta)),
                "writing shards",
            )
            number, reserved = job.from_rank0(lambda: self._commit(snapshot), "committing")
        except SpmdError:
            if job.rank == 0:
                abort_snapshot(self.session, self.prefix, snapshot.number)
            raise
        if reserved:
            self._keep(tensors, basis)
        elif self._reserves_later(snapshot):
            self._keep_later(number, tensors, basis)
        if self.delta:
            kept = PreviousPut(number, basis, snapshot_layouts(snapshot), tensors, written[0])
            previous_puts(self.session).keep(self.prefix, kept)
        return number

    def _write(
        self,
        snapshot: pb.SnapshotInfo,
        tensors: Mapping[str, JobTensor],
        delta: DeltaBase | None,
    ) -> Hashes[ShardKey]:
        """Write this rank's shards: into a delta snapshot's copies the blocks whose hashes changed since the
        `delta`'s previous put, else whole; a delta put's block hashes of them (none for another put)."""
        shards = list(my_shards(snapshot, tensors, self.local, self.job.rank))
        if delta is not None:
            hashes = delta.hashes()
            write_changed(self.session, shards, hashes.blocks, delta.previous.hashes.blocks)
            return hashes
        write_whole(self.session, shards)
        return hash_shards(shards, self.tensors) if self.delta else Hashes({}, {})

    def _commit(self, snapshot: pb.SnapshotInfo) -> tuple[int, bool]:
        """Job rank 0: commit with this put's non-tensor tree (sent only where it differs from the one the
        snapshot holds: a reservation's is the put before's); the number, and whether the commit reserved the
        next snapshot (kept in `self.reserved`)."""
        changed = self.skeleton if self.skeleton != snapshot.skeleton else None
        committed = commit_snapshot(
            self.session,
            snapshot,
            skeleton=changed,
            reserve_next=self._reserves(snapshot),
            reserve_later=self._reserves_later(snapshot),
        )
        self.reserved = committed.next
        return committed.number, committed.next is not None

    def _keep(self, tensors: Mapping[str, JobTensor], basis: Any) -> None:
        """Keep the snapshot the commit reserved for this prefix's next put: job rank 0 owns it, the other ranks
        keep what it is for (its snapshot comes from rank 0 at the next put)."""
        owned = self.job.rank == 0
        reservation = Reservation(basis, self.reserved if owned else None, tensors, owned=owned)
        self._abort_unused(self.session.reservations.keep(self.prefix, reservation))

    def _reserved_snapshot(self, reservation: Reservation | None) -> pb.SnapshotInfo | None:
        """The snapshot of this rank's `reservation` (None: none); in a larger job job rank 0's, sent to every
        rank (only rank 0 holds it), None on every rank when rank 0 has none. A collective in a larger job."""
        if self.job.size == 1:
            return reservation.snapshot if reservation is not None else None
        reserved = self.job.broadcast(
            reservation.snapshot.SerializeToString()
            if reservation is not None and reservation.snapshot is not None
            else None
        )
        return pb.SnapshotInfo.FromString(reserved) if reserved is not None else None

    def _reserves(self, snapshot: pb.SnapshotInfo) -> bool:
        """Whether the commit of `snapshot` reserves the prefix's next: a delta put's only when its snapshot is a
        delta one (the next is then made of copies of it, for the next delta put to fill)."""
        return self.reserve_next and (not self.delta or snapshot.delta_of != 0)

    def _reserves_later(self, snapshot: pb.SnapshotInfo) -> bool:
        """Whether the commit of `snapshot` reserves the next snapshot after it answered (reserve_next="later",
        and every delta put's: its copies are what its create would cost); job rank 0 takes it on the client's
        reservation thread meanwhile."""
        return self._reserves(snapshot) and (self.reserve_later or self.delta)

    def _keep_later(self, committed: int, tensors: Mapping[str, JobTensor], basis: Any) -> None:
        """Keep the snapshot the coordinator reserves after the commit of `committed` answered, for this prefix's
        next put: job rank 0 takes it on the client's reservation thread (which that put waits for), the other
        ranks keep what it is for (as `_keep` does)."""
        if self.job.rank != 0:
            self._keep(tensors, basis)
            return
        session, prefix = self.session, self.prefix
        self._abort_unused(
            session.reservations.keep_later(
                prefix, basis, tensors, lambda: take_reserved_snapshot(session, prefix, committed)
            )
        )

    def _abort_unused(self, reservation: Reservation | None) -> None:
        """Abort a reservation this process owns that goes unused (another put of the prefix replaced it, or
        this put cannot fill it)."""
        if reservation is not None and reservation.owned and reservation.snapshot is not None:
            abort_snapshot(self.session, self.prefix, reservation.snapshot.number)


def _create(
    cluster: Cluster,
    prefix: str,
    tensors: Mapping[str, JobTensor],
    spec: Any,
    replicas: int,
    keep: int,
    *,
    skeleton: str,
    durable: bool = True,
) -> pb.SnapshotInfo:
    """Job rank 0: the server layout of every tensor, recorded as a pending snapshot with the state dict's
    non-tensor tree."""
    session = cluster.session
    writer_host_id = session.paths.in_place_host()
    if spec is None:
        create = lambda ranks: create_snapshot(  # noqa: E731
            session,
            prefix,
            balanced(session, tensors, replicas, ranks),
            keep,
            skeleton=skeleton,
            durable=durable,
            writer_host_id=writer_host_id,
        )
        try:
            return create(session.recent_ranks())
        except RankUnavailableError:  # the kept rank list may be a second old: ask again, once
            return create(session.refresh_ranks())
    return create_snapshot(
        session,
        prefix,
        from_spec(session, tensors, spec, replicas),
        keep,
        skeleton=skeleton,
        durable=durable,
        writer_host_id=writer_host_id,
    )
