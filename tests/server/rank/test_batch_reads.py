"""ReadRegions on one rank (server/rank/reads/batch.py): many boxes in one reply, every bad region named.

A real ShardStore with the servicer called in-process: the bytes of every
region bit for bit against plain torch slicing, in request order; bad fields,
boxes outside their shard, unknown and dropped versions, and over-large
batches refused with their status code and `regions[i]`; the rank answering
again after each refusal. The bulk port answers the same batch as a
KIND_READS frame, its refusals leaving the connection in step.
"""

from __future__ import annotations

import socket
import struct

import grpc
import pytest
import torch
from google.rpc import status_pb2
from server_helpers import Aborted, ServicerContext, recv_exactly

from shardserve.core.metadata import TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.core.wire import tensor_bytes
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.bulk_wire import HEADER, KIND_READS
from shardserve.protos.errors import Reason, detail_of_status
from shardserve.server.rank.reads.batch import BatchReads
from shardserve.server.rank.reads.bulk import BulkReads
from shardserve.server.rank.reads.path import BATCH_READ_BYTES, MAX_BATCH_REGIONS
from shardserve.server.rank.store import ShardStore

SOURCES = {
    "a": torch.arange(24, dtype=torch.float32).reshape(6, 4),
    "b": torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16),
    "c": torch.tensor([True, False, True, True, False]),
    "d": torch.tensor([1 + 2j, -3j], dtype=torch.complex64),
    "two": torch.arange(40, dtype=torch.int64).reshape(
        8, 5
    ),  # two shards of 4 rows, both on this rank
    "big": torch.arange(300_000, dtype=torch.float32),  # 1.2 MB: over one batch
}


@pytest.fixture
def store() -> ShardStore:
    store = ShardStore(0, max_request_bytes=1 << 20, version_grace=0.0)
    for name, source in SOURCES.items():
        placements = ["rank:0/cpu"] * (2 if name == "two" else 1)
        meta = ChunkShardingSpec(0, placements).build_metadata(
            tuple(source.shape), TensorProperties(dtype=source.dtype)
        )
        store.allocate(name, 1, meta)
        for index, shard in enumerate(meta.shards_metadata):
            part = source[
                tuple(slice(o, o + s) for o, s in zip(shard.shard_offsets, shard.shard_sizes))
            ]
            data = tensor_bytes(part.contiguous())
            with store.leases.write(name, 1, index, source.dtype, len(data)) as writer:
                writer.write(0, data)
        store.promote(name, 1)
    return store


def region(
    name: str,
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    shard_index: int = 0,
    version: int = 1,
) -> pb.ReadRegionRequest:
    return pb.ReadRegionRequest(
        name=name, version=version, shard_index=shard_index, offsets=offsets, sizes=sizes
    )


def expected(request: pb.ReadRegionRequest) -> bytes:
    box = tuple(slice(o, o + s) for o, s in zip(request.offsets, request.sizes))
    return tensor_bytes(SOURCES[request.name][box].contiguous())


def refused(store: ShardStore, regions: list[pb.ReadRegionRequest]) -> Aborted:
    with pytest.raises(Aborted) as caught:
        BatchReads(store).ReadRegions(pb.ReadRegionsRequest(regions=regions), ServicerContext())
    return caught.value


GOOD = [
    region("a", (1, 1), (3, 2)),
    region("b", (0,), (3,)),
    region("c", (1,), (3,)),
    region("d", (0,), (2,)),
    region("a", (0, 0), (6, 4)),
    region("two", (5, 1), (2, 3), shard_index=1),
    region("a", (2, 2), (0, 2)),
    region("two", (0, 0), (4, 5), version=0),
]


def test_every_region_comes_bit_for_bit_in_request_order(store):
    reply = BatchReads(store).ReadRegions(pb.ReadRegionsRequest(regions=GOOD), ServicerContext())
    parts = [expected(r) for r in GOOD]
    assert reply.data == b"".join(parts)
    assert list(reply.offsets) == [sum(len(p) for p in parts[:i]) for i in range(len(parts))]


@pytest.mark.parametrize(
    "bad, code, words",
    [
        (region("", (0,), (1,)), grpc.StatusCode.INVALID_ARGUMENT, "name is empty"),
        (region("a", (0,), (1,)), grpc.StatusCode.INVALID_ARGUMENT, "offsets has 1 dims"),
        (region("a", (0, -1), (1, 1)), grpc.StatusCode.INVALID_ARGUMENT, "offsets[1]=-1"),
        (region("a", (5, 0), (2, 4)), grpc.StatusCode.INVALID_ARGUMENT, "not inside the shard"),
        (region("two", (4, 0), (1, 5)), grpc.StatusCode.INVALID_ARGUMENT, "not inside the shard"),
        (
            region("two", (0, 0), (1, 5), shard_index=2),
            grpc.StatusCode.INVALID_ARGUMENT,
            "shard_index 2",
        ),
        (region("a", (0, 0), (1, 1), version=7), grpc.StatusCode.FAILED_PRECONDITION, "version 7"),
        (region("nope", (0,), (1,)), grpc.StatusCode.NOT_FOUND, "'nope'"),
        (region("big", (0,), (300_000,)), grpc.StatusCode.RESOURCE_EXHAUSTED, "max_request_bytes"),
    ],
)
def test_a_bad_region_is_named_with_its_code_and_the_rank_serves_on(store, bad, code, words):
    caught = refused(store, [GOOD[0], bad, GOOD[1]])
    assert caught.code == code, caught
    assert caught.details.startswith("regions[1]: ") and words in caught.details, caught.details
    reply = BatchReads(store).ReadRegions(pb.ReadRegionsRequest(regions=GOOD), ServicerContext())
    assert reply.data == b"".join(expected(r) for r in GOOD)


def test_a_dropped_version_is_refused_by_name(store):
    store.drop("b", 1)
    caught = refused(store, [GOOD[0], GOOD[1]])
    assert caught.code == grpc.StatusCode.NOT_FOUND, caught
    assert caught.details.startswith("regions[1]: ") and "'b'" in caught.details, caught.details


def test_an_answer_over_one_mebibyte_is_refused_at_the_region_that_passes_it(store):
    quarter = BATCH_READ_BYTES // 4 // 4  # elements of a quarter MiB of float32
    regions = [region("big", (i * quarter,), (quarter,)) for i in range(4)] + [
        region("big", (0,), (1,))
    ]
    reply = BatchReads(store).ReadRegions(
        pb.ReadRegionsRequest(regions=regions[:4]), ServicerContext()
    )
    assert len(reply.data) == BATCH_READ_BYTES
    caught = refused(store, regions)
    assert caught.code == grpc.StatusCode.RESOURCE_EXHAUSTED and caught.details.startswith(
        "regions[4]: "
    ), caught


def test_an_empty_or_too_long_batch_is_refused(store):
    caught = refused(store, [])
    assert caught.code == grpc.StatusCode.INVALID_ARGUMENT and caught.details.startswith(
        "regions:"
    ), caught
    caught = refused(store, [region("b", (0,), (1,))] * (MAX_BATCH_REGIONS + 1))
    assert caught.code == grpc.StatusCode.RESOURCE_EXHAUSTED and caught.details.startswith(
        "regions:"
    ), caught


# ---------------------------------------------------------------- the bulk port


@pytest.fixture
def port(store):
    reads = BulkReads(store, "127.0.0.1")
    yield reads
    reads.close()


def ask(sock: socket.socket, regions: list[pb.ReadRegionRequest]) -> tuple[grpc.StatusCode, bytes]:
    message = pb.ReadRegionsRequest(regions=regions).SerializeToString()
    sock.sendall(struct.pack("<II", KIND_READS, len(message)) + message)
    status, _, length = HEADER.unpack(recv_exactly(sock, HEADER.size))
    return next(c for c in grpc.StatusCode if c.value[0] == status), recv_exactly(sock, length)


def test_the_bulk_port_answers_a_batch_and_names_a_bad_region(port):
    with socket.create_connection(("127.0.0.1", port.port), timeout=10.0) as sock:
        sock.sendall(port.tickets.issue("ipv4:127.0.0.1:4242"))
        code, body = ask(sock, GOOD)
        assert code == grpc.StatusCode.OK
        assert pb.ReadRegionsReply.FromString(body).data == b"".join(expected(r) for r in GOOD)
        code, body = ask(sock, [GOOD[0], region("a", (5, 0), (2, 4))])
        status = status_pb2.Status.FromString(body)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and status.message.startswith(
            "regions[1]: "
        )
        detail = detail_of_status(status)
        assert detail.reason == Reason.INVALID_ARGUMENT and detail.metadata["item"] == "regions[1]"
        code, body = ask(sock, GOOD[:2])
        assert code == grpc.StatusCode.OK
        assert pb.ReadRegionsReply.FromString(body).data == b"".join(expected(r) for r in GOOD[:2])
