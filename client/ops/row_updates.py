"""update_rows: publish a new version of a 2-D table with some rows replaced, atomically.

The coordinator creates version v+1 as a copy of the READY version v on every
rank (CreateTensor init=INIT_COPY, still PENDING and invisible), the client
writes the new rows to every shard holding them (replicas too) with
ShardServer.WriteRows, and CommitTensor promotes v+1 everywhere before the
catalog flips to it; readers at v keep reading v until it is dropped, then
refresh. A reader therefore sees all old or all new rows. Any failure aborts
v+1. Duplicate ids: the last value given wins, as in a sequence of assignments.
A copy on a rank that is down (a replica) is left out of v+1: the rows go to
every live copy, and the coordinator repairs the missing one from them.
Concurrent update_rows of one table: updates from one client are serialized
per table; across clients, a later one aborts a pending earlier one (which
then raises), and one that finds the READY version replaced before it started
copies the new one instead (each update then lands whole, the last one wins).
"""
from __future__ import annotations

import threading
from functools import partial
from typing import Any, Iterator

import torch

from client.embedding.ids import validate_update
from client.embedding.views import TableView, TableViews
from client.errors import ShardServeError, StaleVersionError
from client.session import Session
from protos import shardserve_pb2 as pb
from shardcore.metadata import ShardedTensorMetadata
from shardcore.wire import metadata_to_proto, tensor_bytes

WRITE_BATCH_BYTES = 4 << 20
_locks: dict[tuple[int, str], threading.Lock] = {}
_locks_guard = threading.Lock()


def _table_lock(session: Session, name: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault((id(session), name), threading.Lock())


def update_rows(session: Session, views: TableViews, name: str, ids: Any, values: Any) -> int:
    """Replace rows `ids` of table `name` by `values` [len(ids), dim] in a new version; returns that version."""
    with _table_lock(session, name):
        validate_update(views.view(name, refresh=True), ids, values)  # bad input fails before the copy
        view, info = _copy_of_ready_version(session, views, name)
        meta = view.summary.metadata
        try:
            unique, rows = validate_update(view, ids, values)  # against the copied version's own layout
            missing = frozenset(info.unavailable_shards)  # copies on dead ranks: the coordinator repairs them
            jobs = [partial(_write_batch, session, meta, name, info.version, index, batch_ids, batch_rows)
                    for index, batch_ids, batch_rows in _shard_batches(view, unique, rows, missing)]
            session.run_all(jobs)
            committed = session.commit(name, info.version)
        except BaseException:
            session.abort(name, info.version)
            raise
        views.view(name, refresh=True)
        return int(committed.version)


def _copy_of_ready_version(session: Session, views: TableViews, name: str) -> tuple[TableView, pb.TensorInfo]:
    """CreateTensor(INIT_COPY) of the READY version; if another client committed in between, once more."""
    try:
        return _create_copy(session, views, name)
    except StaleVersionError:
        return _create_copy(session, views, name)


def _create_copy(session: Session, views: TableViews, name: str) -> tuple[TableView, pb.TensorInfo]:
    view = views.view(name, refresh=True)
    request = pb.CreateTensorRequest(name=name, metadata=metadata_to_proto(view.summary.metadata),
                                     init=pb.INIT_COPY, overwrite=True, source_version=view.version)
    return view, session.create_tensor(request)


def _shard_batches(view: TableView, ids: torch.Tensor, rows: torch.Tensor,
                   missing: frozenset[int]) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(shard index, ids, rows of its columns) for every shard holding some of `ids` (but the `missing` copies,
    which the new version does not have), in batches."""
    for index, shard in enumerate(view.summary.metadata.shards_metadata):
        start, count = shard.shard_offsets[0], shard.shard_sizes[0]
        if 0 in shard.shard_sizes or index in missing:
            continue
        mask = (ids >= start) & (ids < start + count)
        if not bool(mask.any()):
            continue
        col, width = shard.shard_offsets[1], shard.shard_sizes[1]
        shard_ids = ids[mask]
        shard_rows = rows[mask][:, col:col + width].contiguous()
        per_batch = max(1, WRITE_BATCH_BYTES // max(1, width * shard_rows.element_size()))
        for lo in range(0, shard_ids.numel(), per_batch):
            yield index, shard_ids[lo:lo + per_batch], shard_rows[lo:lo + per_batch]


def _write_batch(session: Session, meta: ShardedTensorMetadata, name: str, version: int, index: int,
                 ids: torch.Tensor, rows: torch.Tensor) -> None:
    address = session.address_of(meta.shards_metadata[index].rank)
    request = pb.WriteRowsRequest(name=name, version=version, shard_index=index, ids=bytes(tensor_bytes(ids)),
                                  values=bytes(tensor_bytes(rows.contiguous())))
    channel = session.channel
    reply = channel.unary(channel.shard_server(address).WriteRows, request, f"rank at {address}",
                          timeout=channel.data_timeout(len(request.values)))
    if reply.rows_written != ids.numel():
        raise ShardServeError(f"rank at {address} wrote {reply.rows_written} of {ids.numel()} rows")
