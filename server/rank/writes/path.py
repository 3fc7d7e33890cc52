"""The write half of a rank's data paths: one entry per kind of write, whatever carries the bytes.

WriteShard (a gRPC stream of chunks), WriteShards (bytes inline, a same-host writer's memfd, or written in
place), the bulk
port's write frame (bytes following on its connection), WriteRows and WriteBytes all come through `WritePath`: each
shard is written under the store's write lease (a shard whose bytes do not all arrive is left torn, and a
promote refuses it until it is written again) and its bytes counted once.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.common.principals import Principal
from shardserve.server.common.requests import check_name, check_version, parse_dtype
from shardserve.server.rank.errors import InvalidArgument
from shardserve.server.rank.store import ShardStore
from shardserve.server.rank.table_rows import local_rows, parse_ids, parse_rows
from shardserve.server.rank.writes.bulk import receive_batch
from shardserve.server.rank.writes.byte_ranges import checked_ranges
from shardserve.server.rank.writes.in_place import finish_written, open_for_write
from shardserve.server.rank.writes.shards import ShardBytes, batch_bytes, checked_batch, write_batch
from shardserve.server.rank.writes.shared import SharedSource


class WritePath:
    """The writes of one rank: shard streams, shard batches from any source, and row rewrites."""

    def __init__(self, store: ShardStore) -> None:
        self.store = store

    def stream(self, requests: Iterable[pb.WriteShardRequest]) -> int:
        """Write one shard from a WriteShard stream (a header, then chunks in order); the bytes written."""
        messages = iter(requests)
        first = next(messages, None)
        if first is None or not first.HasField("header"):
            raise InvalidArgument("header: the first WriteShard message must carry the header")
        header = first.header
        name = check_name(header.name, "header.name")
        version = check_version(header.version, "header.version")
        dtype = parse_dtype(header.dtype, "header.dtype")
        with self.store.leases.write(
            name, version, header.shard_index, dtype, header.nbytes
        ) as writer:
            for message in messages:
                part = message.WhichOneof("part")
                if part == "chunk":
                    writer.write(message.chunk.offset, message.chunk.data)
                elif part == "header":
                    raise InvalidArgument(
                        "header: only the first WriteShard message may carry a header"
                    )
                else:
                    raise InvalidArgument(
                        "part: a WriteShard message carries neither header nor chunk"
                    )
        self.store.metrics.written(name, writer.written)
        return writer.written

    def batch(self, request: pb.WriteShardsRequest) -> pb.WriteShardsResponse:
        """Write a WriteShards batch whose bytes are inline or in a same-host writer's memfd."""
        shards = checked_batch(request.shards)
        source = request.WhichOneof("source")
        if source == "data":
            return pb.WriteShardsResponse(bytes_written=self._from_inline(shards, request.data))
        if source == "shared":
            with SharedSource.open(
                request.shared, batch_bytes(shards), self.store.shared.enabled
            ) as shared:
                return pb.WriteShardsResponse(
                    bytes_written=write_batch(
                        self.store, shards, lambda shard, view: shared.read_into(shard.offset, view)
                    )
                )
        if source == "written_in_place":
            return pb.WriteShardsResponse(bytes_written=finish_written(self.store, shards))
        raise InvalidArgument(
            "source: a WriteShards call carries its bytes inline (data), names a same-host "
            "memfd (shared) or says they were written in place; only the bulk port sends them "
            "after the request"
        )

    def open_in_place(self, request: pb.OpenShardsForWriteRequest) -> pb.OpenShardsForWriteResponse:
        """Where a same-host writer finds the requested pending shards' memory to fill it itself."""
        return pb.OpenShardsForWriteResponse(segments=open_for_write(self.store, request))

    def receive(
        self, conn: socket.socket, request: pb.WriteShardsRequest, principal: Principal | None
    ) -> pb.WriteShardsResponse:
        """Write a bulk-port batch whose bytes follow on `conn` (server/rank/writes/bulk.py)."""
        return receive_batch(conn, self.store, request, principal)

    def rows(self, request: pb.WriteRowsRequest) -> int:
        """Overwrite rows of one local shard of a PENDING version; returns the number of rows written."""
        name = check_name(request.name)
        version = check_version(request.version)
        ids = parse_ids(request.ids, "ids")
        leases = self.store.leases
        with leases.lease(name, version, served=False) as record:
            shard = leases.shard_of(record, request.shard_index)  # refused unless held here
            local = local_rows(record, request.shard_index, ids, "ids")
            values = parse_rows(request.values, shard.dtype, (ids.size, shard.shape[1]), "values")
            durable = record.options.durable
        if np.unique(local).size != local.size:
            raise InvalidArgument("ids holds duplicates; send each row once")
        if self.store.persistence is not None and durable:  # durable order: log, then write
            self.store.persistence.log_rows(name, version, request.shard_index, local, values)
        rows = torch.from_numpy(local)
        # checked above: no refusal leaves the shard torn
        with leases.rewrite(name, version, request.shard_index, rows) as shard:
            shard.index_copy_(0, rows.to(shard.device), values.to(shard.device))
        self.store.metrics.written(request.name, len(request.values))
        return int(ids.size)

    def byte_ranges(self, request: pb.WriteBytesRequest) -> int:
        """Overwrite byte ranges of one local shard of a PENDING version (a delta put's changed blocks); returns
        the bytes written. A version sharing blocks with another copies only the blocks the ranges touch."""
        name = check_name(request.name)
        version = check_version(request.version)
        leases = self.store.leases
        with leases.lease(name, version, served=False) as record:
            shard = leases.shard_of(record, request.shard_index)  # refused unless held here
            nbytes = shard.numel() * shard.element_size()
            durable = record.options.durable
        persistence = self.store.persistence
        if persistence is not None and durable and persistence.is_update(name, version):
            raise InvalidArgument(  # its update log records rows, not byte ranges
                f"version {version} of {name!r} is a durable row update's copy: write it with WriteRows",
                metadata={"tensor": name},
            )
        shared = request.HasField("shared")
        total = sum(request.lengths) if shared else len(request.data)
        ranges = checked_ranges(request.starts, request.lengths, nbytes, total)
        with self._byte_source(request, total) as read:
            with leases.rewrite(name, version, request.shard_index, byte_ranges=ranges) as shard:
                flat = shard.reshape(-1).view(torch.uint8)
                at = 0
                for start, stop in ranges:
                    read(at, flat[start:stop].numpy().data)
                    at += stop - start
        self.store.metrics.written(name, total)
        return total

    @contextlib.contextmanager
    def _byte_source(
        self, request: pb.WriteBytesRequest, total: int
    ) -> Iterator[Callable[[int, memoryview], None]]:
        """A reader of WriteBytes' `total` bytes, read(offset, view), from its staging memfd or inline data."""
        if not request.HasField("shared"):
            inline = memoryview(request.data)

            def read(offset: int, view: memoryview) -> None:
                view[:] = inline[offset : offset + len(view)]

            yield read
            return
        if request.data:
            raise InvalidArgument(
                "data: bytes sent inline with a shared source; send one of them",
                metadata={"field": "data"},
            )
        with SharedSource.open(request.shared, total, self.store.shared.enabled) as source:
            yield source.read_into

    def _from_inline(self, shards: Sequence[ShardBytes], data: bytes) -> int:
        if len(data) != batch_bytes(shards):
            raise InvalidArgument(
                f"data: {len(data)} bytes for shards of {batch_bytes(shards)} bytes in all"
            )
        view = memoryview(data)

        def fill(shard: ShardBytes, target: memoryview) -> None:
            target[:] = view[shard.offset : shard.offset + shard.nbytes]

        return write_batch(self.store, shards, fill)
