"""Requests checked and turned into the drivers' orders, at the service edge (server/coordinator/service.py).

Every check here is of the request alone, each failure INVALID_ARGUMENT naming the field; what depends on the
cluster's state (placements on live ranks, a tensor's current version) is the driver's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.planner import DEFAULT_BUCKET_BYTES
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.common.errors import InvalidArgument
from shardserve.server.common.requests import check_name, check_version, parse_metadata
from shardserve.server.coordinator.drivers.orders import (
    DEFAULT_KEEP,
    MAX_HOST_ID_BYTES,
    MAX_KEEP,
    MAX_SNAPSHOT_TENSORS,
    CommitOrder,
    LoadOrder,
    ReshardOrder,
    SaveOrder,
    SnapshotOrder,
    check_path,
    check_skeleton_keys,
    check_skeleton_packs,
    skeleton_keys,
)


def snapshot_order(
    request: pb.CreateSnapshotRequest, *, authenticated: bool = False
) -> SnapshotOrder:
    """The checked order of a CreateSnapshot request; INVALID_ARGUMENT naming the field. An `authenticated`
    caller's writer_host_id is dropped: in-place writes are for unauthenticated clusters (a mapping outlives
    its right to the tensor: server/rank/writes/in_place.py)."""
    prefix = check_name(request.prefix, "prefix")
    keep = request.keep or DEFAULT_KEEP
    if keep > MAX_KEEP:
        raise InvalidArgument(f"keep {keep} is over the limit of {MAX_KEEP}")
    layouts = _checked_tensors(request.tensors)
    skeleton = _checked_skeleton(request.skeleton, layouts)
    check_host_id(request.writer_host_id, "writer_host_id")
    return SnapshotOrder(
        prefix,
        keep,
        layouts,
        skeleton,
        durable=not request.not_durable,
        writer_host_id="" if authenticated else request.writer_host_id,
        delta_of=check_version(request.delta_of, "delta_of", allow_zero=True),
    )


def check_host_id(value: str, field: str) -> str:
    """A writer's host id (boot id and namespaces), at most MAX_HOST_ID_BYTES; INVALID_ARGUMENT naming `field`."""
    if len(value.encode()) > MAX_HOST_ID_BYTES:
        raise InvalidArgument(
            f"{field}: {len(value.encode())} bytes, over the limit of {MAX_HOST_ID_BYTES}",
            metadata={"field": field},
        )
    return value


def check_reserve(request: pb.CreateTensorRequest) -> bool:
    """CreateTensorRequest.reserve: only for a version its writer fills (INIT_NONE) that replaces the READY one
    (overwrite), as the put it is reserved for does."""
    if request.reserve and (request.init != pb.INIT_NONE or not request.overwrite):
        raise InvalidArgument(
            "reserve is for the next put of a tensor: it needs init INIT_NONE and overwrite",
            metadata={"field": "reserve"},
        )
    return request.reserve


def commit_order(request: pb.CommitSnapshotRequest) -> CommitOrder:
    """The checked order of a CommitSnapshot request; INVALID_ARGUMENT naming the field. A skeleton's tensor
    references are checked against the pending snapshot's keys by the driver (check_skeleton_keys)."""
    skeleton = request.skeleton if request.HasField("skeleton") else None
    if request.reserve_later and not request.reserve_next:
        raise InvalidArgument(
            "reserve_later is set without reserve_next: nothing is reserved",
            metadata={"field": "reserve_later"},
        )
    return CommitOrder(
        check_name(request.prefix, "prefix"),
        check_version(request.number, "number"),
        written_in_place=request.written_in_place,
        skeleton=skeleton,
        skeleton_keys=tuple(skeleton_keys(skeleton or "")),
        reserve_next=request.reserve_next,
        reserve_later=request.reserve_later,
    )


def snapshot_view(view: pb.SnapshotView) -> pb.SnapshotView:
    """A request's SnapshotView (UNSPECIFIED: FULL); INVALID_ARGUMENT naming `view` for an unknown one."""
    if view not in pb.SnapshotView.values():
        raise InvalidArgument(
            f"view {view} is not a known SnapshotView", metadata={"field": "view"}
        )
    return pb.SNAPSHOT_VIEW_FULL if view == pb.SNAPSHOT_VIEW_UNSPECIFIED else view


def reshard_order(request: pb.ReshardRequest) -> ReshardOrder:
    """The checked order of a Reshard request; INVALID_ARGUMENT naming the field."""
    name = check_name(request.name)
    layout = parse_metadata(request.metadata)
    if request.bucket_bytes < 0:
        raise InvalidArgument(f"bucket_bytes {request.bucket_bytes} is negative (0 = default)")
    return ReshardOrder(
        name, layout, request.bucket_bytes or DEFAULT_BUCKET_BYTES, request.timeout_s
    )


def load_order(request: pb.LoadCheckpointRequest) -> LoadOrder:
    """The checked order of a LoadCheckpoint request; INVALID_ARGUMENT naming the field. Whether the
    checkpoint holds the tensors, and the ranks the layouts name, are the driver's to check."""
    path = check_path(request.path)
    if not request.tensors:
        raise InvalidArgument("tensors is empty: name at least one tensor to load")
    layouts: dict[str, ShardedTensorMetadata] = {}
    for i, tensor in enumerate(request.tensors):
        name = check_name(tensor.name, f"tensors[{i}].name")
        if name in layouts:
            raise InvalidArgument(f"tensors[{i}].name {name!r} is given twice")
        layouts[name] = parse_metadata(tensor.metadata, f"tensors[{i}].metadata")
    return LoadOrder(path, layouts, overwrite=request.overwrite, timeout_s=request.timeout_s)


def save_order(request: pb.SaveCheckpointRequest) -> SaveOrder:
    """The checked order of a SaveCheckpoint request; INVALID_ARGUMENT naming the field."""
    path = check_path(request.path)
    names = tuple(request.names)
    if len(set(names)) != len(names):
        raise InvalidArgument("names holds duplicates")
    for i, name in enumerate(names):
        check_name(name, f"names[{i}]")
    return SaveOrder(path, names, timeout_s=request.timeout_s)


def _checked_tensors(tensors: Iterable[pb.SnapshotTensor]) -> dict[str, ShardedTensorMetadata]:
    """{key: metadata} of the request, keys unique and non-empty, each layout valid."""
    layouts: dict[str, ShardedTensorMetadata] = {}
    for i, tensor in enumerate(tensors):
        key = check_name(tensor.key, f"tensors[{i}].key")
        if key in layouts:
            raise InvalidArgument(f"tensors[{i}].key {key!r} appears twice")
        try:
            layouts[key] = parse_metadata(tensor.metadata)
        except InvalidArgument as err:
            raise InvalidArgument(f"tensors[{i}] ({key!r}): {err.message}") from None
        if len(layouts) > MAX_SNAPSHOT_TENSORS:
            raise InvalidArgument(f"tensors: more than {MAX_SNAPSHOT_TENSORS}")
    if not layouts:
        raise InvalidArgument("tensors is empty: a snapshot holds at least one tensor")
    return layouts


def _checked_skeleton(skeleton: str, layouts: Mapping[str, ShardedTensorMetadata]) -> str:
    """The request's state dict skeleton: "" (tensors only), or typed JSON (shardserve.core.state_tree) of at
    most MAX_SKELETON_BYTES whose tensor references are exactly the snapshot's tensors."""
    if skeleton:
        check_skeleton_keys(skeleton_keys(skeleton), layouts)
        check_skeleton_packs(skeleton, layouts)
    return skeleton
