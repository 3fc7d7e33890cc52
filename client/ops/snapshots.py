"""Snapshots of a prefix: many tensors committed in one catalog transaction, read at one snapshot.

The coordinator calls a writer makes (create, commit, abort) and a reader makes
(get, list). The reader's view of a snapshot is client/snapshots.py; the
collective put and get of SPMD jobs are in client/spmd.py.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from shardserve.client import arguments
from shardserve.client import catalog_requests as catalog
from shardserve.client.errors import ShardServeError
from shardserve.client.info import TensorSummary
from shardserve.client.session import Session
from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.wire import metadata_to_proto
from shardserve.protos import shardserve_pb2 as pb

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SnapshotSummary:
    """A committed snapshot of a prefix: its number, tensors (key -> summary), bytes and creation time."""

    prefix: str
    number: int
    created_unix: float
    nbytes: int
    tensors: dict[str, TensorSummary] = field(repr=False)
    skeleton: str = field(
        default="", repr=False
    )  # the state dict's non-tensor tree (core.state_tree)
    delta_of: int = 0  # a delta put's: the snapshot whose tensors it copied
    shared_nbytes: int = 0  # a delta put's: bytes of one copy it shares with `delta_of`'s tensors

    @property
    def age_s(self) -> float:
        return max(0.0, time.time() - self.created_unix)

    @classmethod
    def from_proto(cls, msg: pb.SnapshotInfo) -> SnapshotSummary:
        return cls(
            prefix=msg.prefix,
            number=msg.number,
            created_unix=msg.created_unix,
            nbytes=msg.nbytes,
            tensors={entry.key: TensorSummary.from_proto(entry.tensor) for entry in msg.entries},
            skeleton=msg.skeleton,
            delta_of=msg.delta_of,
            shared_nbytes=msg.shared_nbytes,
        )


def held_once(snapshots: Sequence[SnapshotSummary]) -> dict[int, int]:
    """{number: bytes} of the kept `snapshots` of one prefix with shared blocks counted once: a delta put's
    snapshot counts what it shares with the snapshot it copied there when that one is kept too (its blocks are
    held once on the ranks), else all its bytes."""
    kept = {snapshot.number for snapshot in snapshots}
    return {
        s.number: s.nbytes - s.shared_nbytes if s.delta_of in kept else s.nbytes for s in snapshots
    }


def create_snapshot(
    session: Session,
    prefix: str,
    layouts: Mapping[str, ShardedTensorMetadata],
    keep: int,
    *,
    skeleton: str = "",
    durable: bool = True,
    writer_host_id: str = "",
    delta_of: int = 0,
) -> pb.SnapshotInfo:
    """CreateSnapshot: every tensor PENDING under the snapshot's number, allocated on its ranks; `skeleton`
    keeps the state dict's non-tensor tree with it; kept off the ranks' disks unless `durable`. With
    `writer_host_id` (client.paths.policy.PathPolicy.in_place_host), ranks on that host open their shards
    for in-place writes and the answer's entries carry them (SnapshotEntry.writable). `delta_of`: the
    prefix's newest snapshot, whose keys and `layouts` these are: every tensor starts as a copy of its own
    there, sharing its blocks (FAILED_PRECONDITION when it is not the newest)."""
    request = pb.CreateSnapshotRequest(
        prefix=arguments.tensor_name(prefix, "prefix"),
        keep=keep,
        skeleton=skeleton,
        not_durable=not arguments.flag(durable, "durable"),
        writer_host_id=writer_host_id,
        delta_of=delta_of,
    )
    for key, meta in layouts.items():
        request.tensors.add(key=key, metadata=metadata_to_proto(meta))
    return session.call("CreateSnapshot", request)


@dataclass(frozen=True)
class CommittedSnapshot:
    """A commit's answer: the snapshot's number, and the prefix's next snapshot if the commit reserved it (as
    create_snapshot answers one)."""

    number: int
    next: pb.SnapshotInfo | None = None


def commit_snapshot(
    session: Session,
    created: pb.SnapshotInfo,
    *,
    skeleton: str | None = None,
    reserve_next: bool = False,
    reserve_later: bool = False,
) -> CommittedSnapshot:
    """CommitSnapshot of the snapshot `created` answered: every tensor READY at once, older snapshots beyond
    `keep` dropped. The shards `created` handed out for in-place writes count as written (call it only once
    every writer is done). `skeleton` replaces the non-tensor tree it was created with; `reserve_next` has the
    coordinator create the prefix's next snapshot with the same layouts, for the next put to fill: in the
    answer, or with `reserve_later` after it (take it with take_reserved_snapshot)."""
    request = pb.CommitSnapshotRequest(
        prefix=created.prefix,
        number=created.number,
        view=pb.SNAPSHOT_VIEW_BASIC,
        written_in_place=any(entry.writable for entry in created.entries),
        reserve_next=reserve_next,
        reserve_later=reserve_later,
    )
    if skeleton is not None:
        request.skeleton = skeleton
    committed = session.call("CommitSnapshot", request)
    for entry in created.entries:
        session.saw_version(entry.tensor.name, entry.tensor.version)
    return CommittedSnapshot(
        committed.committed.number, committed.next if committed.HasField("next") else None
    )


def take_reserved_snapshot(session: Session, prefix: str, committed: int) -> pb.SnapshotInfo | None:
    """TakeReservedSnapshot: the snapshot the commit of `committed` (with reserve_later) reserved, once made;
    None when there is none (not made, the coordinator restarted or another took the lead: logged)."""
    request = pb.TakeReservedSnapshotRequest(prefix=prefix, committed=committed)
    try:
        return session.call("TakeReservedSnapshot", request)
    except ShardServeError as err:
        log.info(
            "%r: no snapshot reserved after %d (%s); the next put creates one",
            prefix,
            committed,
            err,
        )
        return None


def abort_snapshot(session: Session, prefix: str, number: int) -> None:
    """Best-effort AbortSnapshot (a pending snapshot is also aborted after the coordinator's pending timeout)."""
    with contextlib.suppress(ShardServeError):
        session.call("AbortSnapshot", pb.AbortSnapshotRequest(prefix=prefix, number=number))


def get_snapshot(session: Session, prefix: str, number: int | None = None) -> SnapshotSummary:
    """Committed snapshot `number` of `prefix` (None: the newest); TensorNotFoundError when it is not kept."""
    return SnapshotSummary.from_proto(session.call("GetSnapshot", snapshot_request(prefix, number)))


def snapshot_request(prefix: str, number: int | None = None) -> pb.GetSnapshotRequest:
    """The validated GetSnapshot request of snapshot `number` of `prefix` (None: the newest)."""
    number = 0 if number is None else arguments.count(number, "snapshot", minimum=1)
    return pb.GetSnapshotRequest(prefix=arguments.tensor_name(prefix, "prefix"), number=number)


def list_snapshots(session: Session, prefix: str) -> list[SnapshotSummary]:
    """The committed snapshots of `prefix`, oldest first."""
    reply = session.call("ListSnapshots", catalog.list_snapshots_request(prefix))
    return snapshots_listed(reply)


def snapshots_listed(reply: pb.ListSnapshotsResponse) -> list[SnapshotSummary]:
    """The snapshots of a ListSnapshots answer, oldest first."""
    return [SnapshotSummary.from_proto(s) for s in reply.snapshots]
