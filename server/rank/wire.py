"""Conversions between the wire's messages and the rank's own types (initial fill, checksums; tensor options
convert in shardcore.wire): the servicers and the persisted manifests speak protobuf, the store does not."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.rank.shard_fill import InitFill
from shardserve.server.rank.version_table import VersionState

_INIT_FILLS: dict[int, InitFill] = {
    pb.INIT_NONE: InitFill.NONE,
    pb.INIT_ZEROS: InitFill.ZEROS,
    pb.INIT_ONES: InitFill.ONES,
    pb.INIT_NORMAL: InitFill.NORMAL,
    pb.INIT_ARANGE: InitFill.ARANGE,
}


def init_fill(init: int) -> InitFill:
    """The fill of a checked InitKind other than INIT_COPY (which is a copy, not a fill)."""
    return _INIT_FILLS[init]


def held_messages(held: Iterable[tuple[str, int, VersionState]]) -> list[pb.HeldVersion]:
    """The versions a rank holds, as its registration and GetStats tell the coordinator: each marked `served`
    when the rank serves it (the coordinator promotes again only the others)."""
    return [
        pb.HeldVersion(name=name, version=version, served=state is VersionState.SERVED)
        for name, version, state in held
    ]


ByShard = Mapping[
    tuple[str, int], Mapping[int, int]
]  # (name, version) -> local shard index -> a number


def checksum_messages(checksums: ByShard) -> list[pb.ShardChecksum]:
    """A promote's answer: the checksum of every local shard of every version, by (name, version)."""
    return [
        pb.ShardChecksum(name=name, version=version, shard_index=index, checksum=value)
        for name, version, index, value in _each_shard(checksums)
    ]


def shared_messages(shared: ByShard) -> list[pb.SharedShardBytes]:
    """A promote's answer: the bytes each local shard of a copy still shares with other versions."""
    return [
        pb.SharedShardBytes(name=name, version=version, shard_index=index, nbytes=value)
        for name, version, index, value in _each_shard(shared)
    ]


def _each_shard(values: ByShard) -> Iterator[tuple[str, int, int, int]]:
    """(name, version, shard index, value) of every shard, versions in order given, shards by index."""
    for (name, version), by_shard in values.items():
        for index, value in sorted(by_shard.items()):
            yield name, version, index, value
