"""update_rows: publish a new version of a 2-D table with some rows replaced, atomically.

The coordinator creates version v+1 from the READY version v on every rank
(CreateTensor init=INIT_COPY, still PENDING and invisible; ranks share v's
blocks instead of copying them, server/rank/blocks.py), the client writes the
new rows to every shard holding them (replicas too) with ShardServer.WriteRows,
which copies only the blocks they touch, and CommitTensor promotes v+1
everywhere before the catalog flips to it. A reader sees all old or all new
rows. Duplicate ids: the last value given wins, as in a sequence of
assignments. A copy on a rank that is down (a replica) is left out of v+1: the
rows go to every live copy, and the coordinator repairs the missing one.

Ordering and group commit: the coordinator groups the updates of one table
from any number of clients (server/coordinator/drivers/update_groups.py). An update
that arrives while the table's pending version is collecting joins it: its
CreateTensor answers with that version and its order in it once the members
before it have written, and its CommitTensor answers once the last member has
committed the version. So rows of a later update (by version, then order)
win on every replica, and no update aborts another; one that cannot join (the
version is committing), or whose version failed or a reshard or checkpoint
load overtook, is made again (on the new layout) until the client's deadline.
Within a client, calls for one table that arrive while an update of it is
being made wait, then go together as one member (in call order: a later call's
rows win). Each call returns the version that holds its rows (and, with
update_rows_ordered, its order in that version).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import torch

from shardserve.client.embedding.ids import validate_update
from shardserve.client.embedding.views import TableView, TableViews
from shardserve.client.errors import AbortedError, ShardServeError
from shardserve.client.new_tensor import NewTensor
from shardserve.client.session import Session
from shardserve.core.wire import metadata_from_proto, tensor_bytes
from shardserve.protos import shardserve_pb2 as pb

WRITE_BATCH_BYTES = 4 << 20
RETRY_PAUSE_S = (
    0.01  # before asking again for a table's update slot (doubling up to MAX_RETRY_PAUSE_S)
)
MAX_RETRY_PAUSE_S = 0.2


class RowUpdate(NamedTuple):
    """Where an update_rows call landed: the version holding its rows, and its member's order in that version
    (rows of a higher order, then of a later version, win)."""

    version: int
    order: int


@dataclass
class _Call:
    """One update_rows call waiting for the version that will hold its rows."""

    ids: torch.Tensor
    values: torch.Tensor
    version: int = 0
    order: int = 0
    error: BaseException | None = None


class _TableQueue:
    """The update_rows calls of one client for one table: queued, then applied together by one of them."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self.guard = threading.Lock()  # protects `calls`
        self.applying = threading.Lock()  # held by the call that makes the next version


_queues: dict[tuple[int, str], _TableQueue] = {}
_queues_guard = threading.Lock()


def _queue(session: Session, name: str) -> _TableQueue:
    with _queues_guard:
        return _queues.setdefault((id(session), name), _TableQueue())


def update_rows(session: Session, views: TableViews, name: str, ids: Any, values: Any) -> int:
    """Replace rows `ids` of table `name` by `values` [len(ids), dim] in a new version; returns that version (which
    may hold other calls' rows too, applied in order)."""
    return update_rows_ordered(session, views, name, ids, values).version


def update_rows_ordered(
    session: Session, views: TableViews, name: str, ids: Any, values: Any
) -> RowUpdate:
    """update_rows, answering the version that holds the rows and the call's order in it."""
    unique, rows = validate_update(views.view(name), ids, values)  # bad input fails here, alone
    call = _Call(unique, rows)
    queue = _queue(session, name)
    with queue.guard:
        queue.calls.append(call)
    with queue.applying:
        if not call.version and call.error is None:  # not applied by an earlier caller's batch
            with queue.guard:
                batch, queue.calls = queue.calls, []
            _apply_batch(session, views, name, batch)
    if call.error is not None:
        raise call.error
    return RowUpdate(call.version, call.order)


def _apply_batch(session: Session, views: TableViews, name: str, batch: list[_Call]) -> None:
    """Make one version holding every call of `batch` (later calls' rows win); tell each call its outcome."""
    try:
        landed = _apply(
            session,
            views,
            name,
            torch.cat([c.ids for c in batch]),
            torch.cat([c.values for c in batch]),
        )
    except BaseException as err:  # noqa: BLE001 - handed to every caller of the batch
        for call in batch:
            call.error = err
        return
    for call in batch:
        call.version, call.order = landed


def _apply(
    session: Session, views: TableViews, name: str, ids: torch.Tensor, values: torch.Tensor
) -> RowUpdate:
    """One version with rows `ids` set to `values`, made again while the table is busy with another update or a
    reshard overtakes it, until the client's deadline."""
    give_up = time.monotonic() + session.channel.timeout
    pause = RETRY_PAUSE_S
    while True:
        try:
            return _apply_once(session, views, name, ids, values)
        except AbortedError:
            if time.monotonic() + pause >= give_up:
                raise
            time.sleep(pause)
            pause = min(2 * pause, MAX_RETRY_PAUSE_S)


def _apply_once(
    session: Session, views: TableViews, name: str, ids: torch.Tensor, values: torch.Tensor
) -> RowUpdate:
    view = views.view(name)
    new = NewTensor(name, view.summary.metadata, init="copy", overwrite=True)
    info = session.create_tensor(new)  # a copy of whichever version is READY now, in its layout
    try:
        if metadata_from_proto(info.metadata) != view.summary.metadata:
            view = views.view(name, refresh=True)  # resharded meanwhile: route by the layout copied
            if metadata_from_proto(info.metadata) != view.summary.metadata:
                raise AbortedError(
                    f"table {name!r} changed layout while its update started; making it again"
                )
        unique, rows = validate_update(view, ids, values)
        missing = frozenset(
            info.unavailable_shards
        )  # copies on dead ranks: the coordinator repairs them
        jobs = [
            partial(
                _write_batch,
                session,
                view,
                name=name,
                version=info.version,
                index=index,
                ids=batch_ids,
                rows=batch_rows,
            )
            for index, batch_ids, batch_rows in _shard_batches(view, unique, rows, missing)
        ]
        session.run_all(jobs)
        committed = session.commit(name, info.version)
    except BaseException:
        session.abort(name, info.version)
        raise
    views.view(name, refresh=True)
    return RowUpdate(int(committed.version), int(committed.update_order))


def _shard_batches(
    view: TableView, ids: torch.Tensor, rows: torch.Tensor, missing: frozenset[int]
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
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
        shard_rows = rows[mask][:, col : col + width].contiguous()
        per_batch = max(1, WRITE_BATCH_BYTES // max(1, width * shard_rows.element_size()))
        for lo in range(0, shard_ids.numel(), per_batch):
            yield index, shard_ids[lo : lo + per_batch], shard_rows[lo : lo + per_batch]


def _write_batch(
    session: Session,
    view: TableView,
    *,
    name: str,
    version: int,
    index: int,
    ids: torch.Tensor,
    rows: torch.Tensor,
) -> None:
    address = session.address_of(view.summary.metadata.shards_metadata[index].rank)
    request = pb.WriteRowsRequest(
        name=name,
        version=version,
        shard_index=index,
        ids=bytes(tensor_bytes(ids)),
        values=bytes(tensor_bytes(rows.contiguous())),
    )
    channel = session.channel
    reply = channel.unary(
        channel.shard_server(address).WriteRows,
        request,
        f"rank at {address}",
        timeout=channel.data_timeout(len(request.values)),
    )
    if reply.rows_written != ids.numel():
        raise ShardServeError(f"rank at {address} wrote {reply.rows_written} of {ids.numel()} rows")
