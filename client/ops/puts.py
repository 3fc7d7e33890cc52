"""A whole put of one tensor: create a PENDING version, write every shard to its ranks, commit.

On the same host the create opens the shards for this client's in-place writes (as a snapshot's does): the
writer fills them with no call to the ranks and the commit counts them written. A name put again with the same
layout and options has its next version reserved after the put returned (client/tensor_reservations.py); the
put after fills that one, with no create on its path, and puts anew if the reservation is gone.

Cluster.put's path when it is not a delta (or a delta that must be made in full, client/put_delta.py). Nothing is
visible on failure: the version is aborted; a write told the version is gone reads as ABORTED when another put or
create of the name with overwrite=True replaced it meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import grpc
import torch

from shardserve.client import catalog_requests as catalog
from shardserve.client.errors import (
    AbortedError,
    ShardServeError,
    StaleVersionError,
    TensorNotFoundError,
)
from shardserve.client.new_tensor import NewTensor
from shardserve.client.paths.writes import shard_write
from shardserve.client.session import Session
from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.regions import cut_tensor
from shardserve.core.tensor_options import TensorOptions
from shardserve.protos import shardserve_pb2 as pb

log = logging.getLogger(__name__)


LayOut = Callable[[bool], ShardedTensorMetadata]
"""The layout of the tensor being put, over the ranks listed at most RECENT_RANKS_S ago (True: a put that may
fill its reserved version) or listed now (False)."""


def put_tensor(
    session: Session,
    name: str,
    tensor: torch.Tensor,
    lay_out: LayOut,
    options: TensorOptions,
    *,
    overwrite: bool,
    chunk_bytes: int,
    reserve_next: bool,
) -> pb.TensorInfo:
    """Put `tensor` as a new version of `name`: into the version reserved for this put when it was made for the
    same layout and options (and `overwrite`), else into one created now, laid out by `lay_out`; every shard
    whole (`chunk_bytes`: the message size of shards streamed over gRPC), then committed; nothing visible on
    failure. With `reserve_next` and `overwrite`, a name put twice in a row with the same layout and options has
    its next version reserved once this put is done."""
    reservations = session.tensor_reservations
    reserved, committed = reservations.take(name), None
    if reserved is not None:
        meta = lay_out(True)
        if overwrite and reserved.basis == (meta, options):
            committed = _fill_reserved(
                session, reserved.info, meta, cut_tensor(tensor, meta), chunk_bytes
            )
        else:
            session.abort(name, reserved.info.version)
    if committed is None:
        meta = lay_out(False)
        committed = put_whole_tensor(
            session,
            name,
            meta,
            cut_tensor(tensor, meta),
            options,
            overwrite=overwrite,
            chunk_bytes=chunk_bytes,
        )
    basis = (meta, options)
    if overwrite and reserve_next and reservations.repeats(name, basis):
        replaced = reservations.keep_later(name, basis, lambda: _reserve(session, name, basis))
        if replaced is not None:
            session.abort(name, replaced.info.version)
    return committed


def put_whole_tensor(
    session: Session,
    name: str,
    meta: ShardedTensorMetadata,
    shards: list[torch.Tensor],
    options: TensorOptions,
    *,
    overwrite: bool,
    chunk_bytes: int,
) -> pb.TensorInfo:
    """Create a version of `name` laid out as `meta`, write every shard whole (`shards`: the tensor cut by it;
    `chunk_bytes`: the message size of shards streamed over gRPC) and commit it; aborted on failure."""
    info = session.create_tensor(
        NewTensor(name, meta, overwrite=overwrite, options=options), in_place=True
    )
    try:
        return _fill(session, info, meta, shards, chunk_bytes)
    except BaseException:
        session.abort(name, info.version)
        raise


def forget_reserved(session: Session, name: str) -> None:
    """Abort the version reserved for this client's next put of `name`, if any (a put that creates its version
    otherwise, as a delta put does, would drop it anyway)."""
    reserved = session.tensor_reservations.take(name)
    if reserved is not None:
        session.abort(name, reserved.info.version)


def _fill_reserved(
    session: Session,
    info: pb.TensorInfo,
    meta: ShardedTensorMetadata,
    shards: list[torch.Tensor],
    chunk_bytes: int,
) -> pb.TensorInfo | None:
    """Write every shard into the reserved version `info` and commit it; None (the version aborted) when that
    fails, as it does once the coordinator dropped the reservation: the caller then creates one."""
    try:
        return _fill(session, info, meta, shards, chunk_bytes)
    except ShardServeError as err:
        log.info(
            "%r: the reserved version %d failed (%s); creating one", info.name, info.version, err
        )
        session.abort(info.name, info.version)
        return None
    except BaseException:
        session.abort(info.name, info.version)
        raise


def _fill(
    session: Session,
    info: pb.TensorInfo,
    meta: ShardedTensorMetadata,
    shards: list[torch.Tensor],
    chunk_bytes: int,
) -> pb.TensorInfo:
    """Write every shard of pending version `info` (in place into the shards its create opened) and commit."""
    name = info.name
    opened = {shard.shard_index: shard.segment for shard in info.writable}
    writes = [
        (
            meta.shards_metadata[index].rank,
            shard_write(
                name,
                info.version,
                index,
                shard,
                chunk_bytes,
                dtype=meta.dtype,
                segment=opened.get(index),
            ),
        )
        for index, shard in enumerate(shards)
    ]
    try:
        session.write_shards(writes)
    except (StaleVersionError, TensorNotFoundError) as err:
        raise _why_writes_failed(session, name, info.version, err) from None
    return session.commit(name, info.version, written_in_place=bool(opened))


def _reserve(
    session: Session, name: str, basis: tuple[ShardedTensorMetadata, TensorOptions]
) -> pb.TensorInfo | None:
    """The next version of `name` made as a reservation (run on the client's reservation thread); None, logged,
    when it is not made (another put of the name in progress, a rank down, the client closing)."""
    meta, options = basis
    new = NewTensor(name, meta, overwrite=True, options=options, reserve=True)
    try:
        return session.create_tensor(new, in_place=True)
    except Exception as err:  # noqa: BLE001 - one not made only makes the next put create its version
        log.info("%r: the next put is not reserved: %s", name, err)
        return None


def _why_writes_failed(
    session: Session, name: str, version: int, err: ShardServeError
) -> ShardServeError:
    """A write told "no such version": AbortedError when the version is gone from the catalog (a concurrent put or
    create of the name with overwrite=True aborted it), else the write's own error."""
    with contextlib.suppress(ShardServeError):
        listed = session.call("ListTensors", catalog.list_tensors_request(True)).tensors
        if not any(t.name == name and t.version == version for t in listed):
            return AbortedError(
                f"put of {name!r} version {version} was aborted while it wrote: another put "
                f"or create of {name!r} with overwrite=True replaced it",
                grpc.StatusCode.ABORTED,
            )
    return err
