"""Snapshots of a prefix: many tensors committed in one catalog transaction, read at one snapshot.

The coordinator calls a writer makes (create, commit, abort), and the reader's
side: `Snapshot`, a committed snapshot whose tensors are proxies pinned to it,
so a reader of a snapshot sees every tensor of that snapshot and never a mix.
The collective put and get of SPMD jobs are in client/spmd.py.
"""
from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Mapping

import torch

from client import arguments
from client.embedding.lookup import Lookups
from client.errors import ShardServeError
from client.info import TensorSummary
from client.session import Session
from client.tensor import RemoteShardedTensor
from protos import shardserve_pb2 as pb
from shardcore.metadata import ShardedTensorMetadata
from shardcore.wire import metadata_to_proto

READ_THREADS = 8  # tensors of a snapshot read at once (each read fans out over its ranks on the client's pool)


@dataclass(frozen=True)
class SnapshotSummary:
    """A committed snapshot of a prefix: its number, tensors (key -> summary), bytes and creation time."""

    prefix: str
    number: int
    created_unix: float
    nbytes: int
    tensors: dict[str, TensorSummary] = field(repr=False)

    @property
    def age_s(self) -> float:
        return max(0.0, time.time() - self.created_unix)

    @classmethod
    def from_proto(cls, msg: pb.SnapshotInfo) -> "SnapshotSummary":
        return cls(prefix=msg.prefix, number=msg.number, created_unix=msg.created_unix, nbytes=msg.nbytes,
                   tensors={entry.key: TensorSummary.from_proto(entry.tensor) for entry in msg.entries})


class Snapshot:
    """One committed snapshot of a prefix, read as a whole: every tensor is a proxy pinned to this snapshot."""

    def __init__(self, session: Session, lookups: Lookups, summary: SnapshotSummary) -> None:
        self.summary = summary
        self.tensors = {key: RemoteShardedTensor(session, lookups, s) for key, s in summary.tensors.items()}

    @property
    def number(self) -> int:
        return self.summary.number

    def __getitem__(self, key: str) -> RemoteShardedTensor:
        return self.tensors[key]

    def keys(self) -> list[str]:
        return list(self.tensors)

    def read(self) -> dict[str, torch.Tensor]:
        """Every tensor of the snapshot, whole, as plain tensors (several read at once)."""
        with ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="shardserve-snapshot") as pool:
            tensors = {key: pool.submit(proxy.full_tensor) for key, proxy in self.tensors.items()}
            return {key: future.result() for key, future in tensors.items()}

    def __repr__(self) -> str:
        return f"Snapshot(prefix={self.summary.prefix!r}, number={self.number}, tensors={len(self.tensors)})"


def create_snapshot(session: Session, prefix: str, layouts: Mapping[str, ShardedTensorMetadata],
                    keep: int) -> pb.SnapshotInfo:
    """CreateSnapshot: every tensor PENDING under the snapshot's number, allocated on its ranks."""
    request = pb.CreateSnapshotRequest(prefix=arguments.tensor_name(prefix, "prefix"), keep=keep)
    for key, meta in layouts.items():
        request.tensors.add(key=key, metadata=metadata_to_proto(meta))
    return session.call("CreateSnapshot", request)


def commit_snapshot(session: Session, prefix: str, number: int) -> SnapshotSummary:
    """CommitSnapshot: every tensor READY at once; older snapshots beyond `keep` dropped."""
    committed = session.call("CommitSnapshot", pb.CommitSnapshotRequest(prefix=prefix, number=number))
    for entry in committed.entries:
        session.saw_version(entry.tensor.name, entry.tensor.version)
    return SnapshotSummary.from_proto(committed)


def abort_snapshot(session: Session, prefix: str, number: int) -> None:
    """Best-effort AbortSnapshot (a pending snapshot is also aborted after the coordinator's pending timeout)."""
    with contextlib.suppress(ShardServeError):
        session.call("AbortSnapshot", pb.AbortSnapshotRequest(prefix=prefix, number=number))


def get_snapshot(session: Session, prefix: str, number: int | None = None) -> SnapshotSummary:
    """Committed snapshot `number` of `prefix` (None: the newest); TensorNotFoundError when it is not kept."""
    number = 0 if number is None else arguments.count(number, "snapshot", minimum=1)
    reply = session.call("GetSnapshot", pb.GetSnapshotRequest(prefix=arguments.tensor_name(prefix, "prefix"),
                                                              number=number))
    return SnapshotSummary.from_proto(reply)


def list_snapshots(session: Session, prefix: str) -> list[SnapshotSummary]:
    """The committed snapshots of `prefix`, oldest first."""
    reply = session.call("ListSnapshots", pb.ListSnapshotsRequest(prefix=arguments.tensor_name(prefix, "prefix")))
    return [SnapshotSummary.from_proto(s) for s in reply.snapshots]
