"""The drivers' orders: CreateSnapshot, Reshard and checkpoint requests checked and turned into domain values at
the service edge (server/coordinator/service.py), so the drivers (snapshots.py, reshard.py, checkpoint.py) never
see a protobuf message.

Every check here is of the request alone; what depends on the cluster's state (placements on live ranks, a
tensor's current version) is the driver's.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.planner import DEFAULT_BUCKET_BYTES
from shardserve.core.state_tree import StateTreeError, tensor_keys
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.common.errors import InvalidArgument, RequestTooLarge
from shardserve.server.common.requests import check_name, check_version, parse_metadata

DEFAULT_KEEP = (
    2  # committed snapshots kept per prefix: the newest, and the one readers pinned before it
)
MAX_KEEP = 1024
MAX_SNAPSHOT_TENSORS = 1 << 16
MAX_SKELETON_BYTES = (
    4 << 20
)  # a state dict's non-tensor tree: an optimizer's param_groups, steps, names
MAX_HOST_ID_BYTES = 256  # a boot id and a few namespace inodes (protos/same_host.py)
MAX_PATH_BYTES = 4096  # Linux's PATH_MAX


@dataclass(frozen=True)
class SnapshotOrder:
    """A snapshot to create: its prefix, how many to keep, each key's layout, the non-tensor tree."""

    prefix: str
    keep: int
    layouts: Mapping[str, ShardedTensorMetadata]
    skeleton: str
    durable: bool
    # a same-host writer whose shards the ranks open for in-place writes, if any
    writer_host_id: str = ""
    # a delta put: the prefix's newest snapshot, each tensor a copy of its tensor of the same key (0: none)
    delta_of: int = 0


@dataclass(frozen=True)
class CommitOrder:
    """A pending snapshot to commit: whether its in-place writes are done, the non-tensor tree replacing the
    one it was created with (None: kept), and whether to reserve the prefix's next snapshot."""

    prefix: str
    number: int
    written_in_place: bool = False
    skeleton: str | None = None
    skeleton_keys: tuple[str, ...] = ()  # the tensor keys `skeleton` refers to
    reserve_next: bool = False


@dataclass(frozen=True)
class ReshardOrder:
    """A reshard to run: the tensor, its new layout, the round size, the job timeout (0: the default)."""

    name: str
    layout: ShardedTensorMetadata
    bucket_bytes: int
    timeout_s: float


@dataclass(frozen=True)
class LoadOrder:
    """A checkpoint load to run: the checkpoint's path, each tensor's new layout by name, whether an existing
    tensor may be replaced, the job timeout (0: the default)."""

    path: str
    layouts: Mapping[str, ShardedTensorMetadata]
    overwrite: bool = False
    timeout_s: float = 0.0


@dataclass(frozen=True)
class SaveOrder:
    """A checkpoint save to run: the path, the tensors by name (empty: every tensor), the job timeout (0: the
    default)."""

    path: str
    names: tuple[str, ...] = ()
    timeout_s: float = 0.0


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
    if len(request.writer_host_id.encode()) > MAX_HOST_ID_BYTES:
        raise InvalidArgument(
            f"writer_host_id: {len(request.writer_host_id.encode())} bytes, over the limit of "
            f"{MAX_HOST_ID_BYTES}",
            metadata={"field": "writer_host_id"},
        )
    return SnapshotOrder(
        prefix,
        keep,
        layouts,
        skeleton,
        durable=not request.not_durable,
        writer_host_id="" if authenticated else request.writer_host_id,
        delta_of=check_version(request.delta_of, "delta_of", allow_zero=True),
    )


def commit_order(request: pb.CommitSnapshotRequest) -> CommitOrder:
    """The checked order of a CommitSnapshot request; INVALID_ARGUMENT naming the field. A skeleton's tensor
    references are checked against the pending snapshot's keys by the driver (check_skeleton_keys)."""
    skeleton = request.skeleton if request.HasField("skeleton") else None
    return CommitOrder(
        check_name(request.prefix, "prefix"),
        check_version(request.number, "number"),
        written_in_place=request.written_in_place,
        skeleton=skeleton,
        skeleton_keys=tuple(_skeleton_keys(skeleton or "")),
        reserve_next=request.reserve_next,
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


def check_path(path: str) -> str:
    """A checkpoint path the ranks can resolve: absolute, no NUL, at most MAX_PATH_BYTES; INVALID_ARGUMENT."""
    if not path:
        raise InvalidArgument("path is empty")
    if not os.path.isabs(path):
        raise InvalidArgument(
            f"path {path!r} must be absolute (the ranks resolve it, not the client)"
        )
    if "\x00" in path:
        raise InvalidArgument(f"path {path!r} holds a NUL character")
    if len(path.encode()) > MAX_PATH_BYTES:
        raise InvalidArgument(
            f"path is {len(path.encode())} bytes long; the limit is {MAX_PATH_BYTES}"
        )
    return path


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
        check_skeleton_keys(_skeleton_keys(skeleton), layouts)
    return skeleton


def _skeleton_keys(skeleton: str) -> list[str]:
    """The tensor keys a non-empty skeleton refers to; RESOURCE_EXHAUSTED past MAX_SKELETON_BYTES,
    INVALID_ARGUMENT naming `skeleton` when it does not parse."""
    if not skeleton:
        return []
    if len(skeleton.encode()) > MAX_SKELETON_BYTES:
        raise RequestTooLarge(
            f"skeleton: {len(skeleton.encode())} bytes, over the limit of {MAX_SKELETON_BYTES}",
            metadata={"field": "skeleton"},
        )
    try:
        return tensor_keys(skeleton)
    except StateTreeError as err:
        raise InvalidArgument(f"skeleton: {err}", metadata={"field": "skeleton"}) from None


def check_skeleton_keys(referenced: Iterable[str], keys: Iterable[str]) -> None:
    """INVALID_ARGUMENT naming `skeleton` unless it refers to exactly the snapshot's tensor `keys`."""
    referenced, keys = sorted(referenced), sorted(keys)
    if referenced != keys:
        extra, missing = sorted(set(referenced) - set(keys)), sorted(set(keys) - set(referenced))
        raise InvalidArgument(
            f"skeleton: refers to tensors {extra} the snapshot lacks and misses {missing}",
            metadata={"field": "skeleton"},
        )
