"""The drivers' orders: what a snapshot, a reshard or a checkpoint load or save is asked to do, as domain values.

The service edge makes them from checked requests (server/coordinator/requests.py), so the drivers
(snapshots.py, reshard.py, checkpoint.py) never see a protobuf message; the checks of an order's values that
the drivers share live here too (paths, a state dict skeleton's tensor references).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.packs import PackError, check_pack_layouts, packs_of, stored_keys
from shardserve.core.state_tree import StateTreeError, tensor_keys
from shardserve.server.common.errors import InvalidArgument, RequestTooLarge

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
    one it was created with (None: kept), and whether to reserve the prefix's next snapshot (before or after
    the commit answers)."""

    prefix: str
    number: int
    written_in_place: bool = False
    skeleton: str | None = None
    skeleton_keys: tuple[str, ...] = ()  # the tensor keys `skeleton` refers to
    reserve_next: bool = False
    reserve_later: bool = False  # with reserve_next: after the commit answered (LaterReservations)


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


def skeleton_keys(skeleton: str) -> list[str]:
    """The keys a snapshot with this skeleton holds as tensors: those its tree refers to, a packed one's pack
    in its place (shardserve.core.packs); RESOURCE_EXHAUSTED past MAX_SKELETON_BYTES, INVALID_ARGUMENT naming
    `skeleton` when it does not parse or its packs are not well formed."""
    if not skeleton:
        return []
    if len(skeleton.encode()) > MAX_SKELETON_BYTES:
        raise RequestTooLarge(
            f"skeleton: {len(skeleton.encode())} bytes, over the limit of {MAX_SKELETON_BYTES}",
            metadata={"field": "skeleton"},
        )
    try:
        return stored_keys(tensor_keys(skeleton), packs_of(skeleton))
    except (StateTreeError, PackError) as err:
        raise InvalidArgument(f"skeleton: {err}", metadata={"field": "skeleton"}) from None


def check_skeleton_packs(skeleton: str, layouts: Mapping[str, ShardedTensorMetadata]) -> None:
    """INVALID_ARGUMENT naming `skeleton` unless each pack it lists is stored as a uint8 tensor of its size."""
    try:
        check_pack_layouts(packs_of(skeleton), layouts)
    except PackError as err:
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
