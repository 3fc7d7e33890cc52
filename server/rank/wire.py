"""Conversions between the wire's messages and the rank's own types (tensor options, initial fill): the
servicers and the persisted manifests speak protobuf, the store does not."""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.rank.options import OovPolicy, TensorOptions
from shardserve.server.rank.shard_fill import InitFill

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


def tensor_options(message: pb.TensorOptions) -> TensorOptions:
    """The options of a checked TensorOptions message."""
    return TensorOptions(
        OovPolicy(message.oov), bytes(message.default_row), durable=not message.not_durable
    )


def options_message(options: TensorOptions) -> pb.TensorOptions:
    """The TensorOptions message of `options`."""
    oov = cast(pb.OovPolicy, options.oov.value)  # the wire enum's number
    return pb.TensorOptions(
        oov=oov, default_row=options.default_row, not_durable=not options.durable
    )


def checksum_messages(
    checksums: Mapping[tuple[str, int], Mapping[int, int]],
) -> list[pb.ShardChecksum]:
    """A promote's answer: the checksum of every local shard of every version, by (name, version)."""
    return [
        pb.ShardChecksum(name=name, version=version, shard_index=index, checksum=value)
        for (name, version), sums in checksums.items()
        for index, value in sorted(sums.items())
    ]
