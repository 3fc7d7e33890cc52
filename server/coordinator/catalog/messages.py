"""Records <-> protobuf messages: the one place that knows both the coordinator's records and their wire shapes.

Used at the edges only: the servicer's requests and answers (server/coordinator/service.py, answers.py), the
calls to ranks (ranks/calls.py), and the catalog's migration of TensorInfo blobs written by earlier versions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

from shardserve.core.wire import (
    metadata_from_proto,
    metadata_into,
    options_from_proto,
    options_to_proto,
)
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.coordinator.catalog.records import (
    Init,
    SnapshotEntry,
    SnapshotRecord,
    TensorOptions,
    TensorRecord,
    TensorState,
)

_STATES = {TensorState.PENDING: pb.PENDING, TensorState.READY: pb.READY}
_INITS = {
    Init.NONE: pb.INIT_NONE,
    Init.ZEROS: pb.INIT_ZEROS,
    Init.ONES: pb.INIT_ONES,
    Init.NORMAL: pb.INIT_NORMAL,
    Init.ARANGE: pb.INIT_ARANGE,
    Init.COPY: pb.INIT_COPY,
}


def state_to_proto(state: TensorState) -> pb.TensorState:
    """The TensorState value of a state."""
    return _STATES[state]


def state_from_proto(value: int) -> TensorState:
    """The state of a TensorState value; ValueError for TENSOR_STATE_UNSPECIFIED or an unknown one."""
    for state, number in _STATES.items():
        if number == value:
            return state
    raise ValueError(f"state {value} is neither PENDING nor READY")


def init_to_proto(init: Init) -> pb.InitKind:
    """The InitKind value of an Init."""
    return _INITS[init]


def init_from_proto(value: int) -> Init:
    """The Init of an InitKind value (checked before: server/common/requests.check_init)."""
    return next(init for init, number in _INITS.items() if number == value)


def tensor_to_proto(record: TensorRecord) -> pb.TensorInfo:
    """The stored fields of a TensorInfo; those describing live state (health, repair) are left unset."""
    return tensor_into(pb.TensorInfo(), record)


def tensor_into(
    out: pb.TensorInfo, record: TensorRecord, *, layout: int | None = None
) -> pb.TensorInfo:
    """`out` (a new TensorInfo, or one added to a repeated field of an answer being built: no copy of it is
    made then) with the stored fields of `record`; its layout as `layout`, an index into the answer's own
    layouts, when given (ListTensorsRequest.layouts_apart), else in full."""
    out.name, out.version, out.state = record.name, record.version, state_to_proto(record.state)
    out.nbytes, out.created_unix = record.nbytes, record.created_unix
    out.options.CopyFrom(_options(record.options))
    if layout is None:
        metadata_into(out.metadata, record.metadata)
    else:
        out.layout = layout
    if record.promoting:
        out.promoting = True
    if record.put_token:
        out.put_token = record.put_token
    if record.owner:
        out.owner = record.owner
    out.lost_shards.extend(record.lost_shards)
    out.shard_checksums.extend(record.checksums)
    return out


@functools.lru_cache(maxsize=64)
def _options(options: TensorOptions) -> pb.TensorOptions:
    """The message of a tensor's options (records share a few; never changed: messages copy it in)."""
    return options_to_proto(options)


def tensor_from_proto(info: pb.TensorInfo) -> TensorRecord:
    """The record of a TensorInfo's stored fields (its answer-only fields are dropped)."""
    return TensorRecord(
        name=info.name,
        version=info.version,
        metadata=metadata_from_proto(info.metadata),
        state=state_from_proto(info.state),
        options=options_from_proto(info.options),
        created_unix=info.created_unix,
        put_token=info.put_token,
        owner=info.owner,
        promoting=info.promoting,
        lost_shards=tuple(info.lost_shards),
        checksums=tuple(info.shard_checksums),
    )


def snapshot_to_proto(
    record: SnapshotRecord,
    tensor: Callable[[pb.TensorInfo, TensorRecord], object] = tensor_into,
) -> pb.SnapshotInfo:
    """A SnapshotInfo, each tensor's message filled in place by `tensor(message, record)` (an answer's
    describes its health)."""
    out = pb.SnapshotInfo(
        prefix=record.prefix,
        number=record.number,
        state=state_to_proto(record.state),
        created_unix=record.created_unix,
        nbytes=record.nbytes,
        keep=record.keep,
        skeleton=record.skeleton,
        delta_of=record.delta_of,
        shared_nbytes=record.shared_nbytes,
    )
    for entry in record.entries:
        tensor(out.entries.add(key=entry.key).tensor, entry.tensor)
    return out


def with_writable(info: pb.SnapshotInfo, writable: Iterable[pb.WritableShard]) -> pb.SnapshotInfo:
    """`info` with each shard its ranks opened for in-place writes under its entry (CreateSnapshot's answer)."""
    entries = {entry.tensor.name: entry for entry in info.entries}
    for shard in writable:
        entries[shard.name].writable.append(shard)
    return info


def snapshot_from_proto(info: pb.SnapshotInfo) -> SnapshotRecord:
    """The record of a SnapshotInfo, each tensor's stored fields only."""
    return SnapshotRecord(
        prefix=info.prefix,
        number=info.number,
        keep=info.keep,
        entries=tuple(SnapshotEntry(e.key, tensor_from_proto(e.tensor)) for e in info.entries),
        state=state_from_proto(info.state),
        created_unix=info.created_unix,
        skeleton=info.skeleton,
        delta_of=info.delta_of,
        shared_nbytes=info.shared_nbytes,
    )
