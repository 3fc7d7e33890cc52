"""Rank records <-> protobuf messages: RankInfo, RestoreProgress and the versions a registering rank holds.

Used at the service edge only (server/coordinator/service.py); the registry works on the records of
rank_info.py.
"""

from __future__ import annotations

from collections.abc import Iterable

from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.coordinator.ranks.info import RankInfo, RestoreProgress

_RESTORE_FIELDS = (
    "rank",
    "pid",
    "done_bytes",
    "total_bytes",
    "done_tensors",
    "total_tensors",
    "loaded",
    "hostname",
)
_RANK_FIELDS = (
    "rank",
    "address",
    "device",
    "hostname",
    "world_size",
    "pid",
    "memory_limit_bytes",
    "memory_limit_source",
    "memory_used_bytes",
    "host_id",
    "shared_memory",
    "metrics_address",
    "alive",
    "last_heartbeat_unix",
    "restarts",
)


def restore_from_proto(msg: pb.RestoreProgress) -> RestoreProgress:
    """The record of a ReportRestore request."""
    return RestoreProgress(**{name: getattr(msg, name) for name in _RESTORE_FIELDS})


def restore_to_proto(progress: RestoreProgress) -> pb.RestoreProgress:
    """The RestoreProgress message of a record."""
    return pb.RestoreProgress(**{name: getattr(progress, name) for name in _RESTORE_FIELDS})


def rank_from_proto(msg: pb.RankInfo) -> RankInfo:
    """The record of a registering rank's RankInfo (the fields the coordinator sets are taken as sent; the
    registry sets them)."""
    restore = restore_from_proto(msg.restore) if msg.HasField("restore") else None
    return RankInfo(**{name: getattr(msg, name) for name in _RANK_FIELDS}, restore=restore)


def rank_to_proto(info: RankInfo) -> pb.RankInfo:
    """The RankInfo message of a record, as ListRanks answers it."""
    msg = pb.RankInfo(**{name: getattr(info, name) for name in _RANK_FIELDS})
    if info.restore is not None:
        msg.restore.CopyFrom(restore_to_proto(info.restore))
    return msg


def held_from_proto(held: Iterable[pb.HeldVersion]) -> list[tuple[str, int]]:
    """The (name, version) pairs a rank says it holds, in its order (a registration's are checked by the
    registry)."""
    return [(version.name, version.version) for version in held]


def served_from_proto(held: Iterable[pb.HeldVersion]) -> frozenset[tuple[str, int]]:
    """The (name, version) pairs of those a rank says it serves already (HeldVersion.served: its registration's
    and its GetStats answer's)."""
    return frozenset((version.name, version.version) for version in held if version.served)
