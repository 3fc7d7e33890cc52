"""Batch requests to ranks built from bytes: the joined entries parse to exactly the message built field by
field, each entry is encoded once for every rank that repeats it, an allocation's entry (its name and version
joined to the fields its layout shares) parses to the request built whole, and the rank stub's batch methods send
such bytes as they are (and plain messages as before) to a real gRPC server, blocking and on grpc.aio, each
method's callable made when first used."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest
import torch

from shardserve.core.metadata import ShardedTensorMetadata, ShardMetadata, TensorProperties
from shardserve.core.tensor_options import TensorOptions
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.server.coordinator.catalog.records import Init, TensorRecord
from shardserve.server.coordinator.ranks.calls import (
    Allocation,
    allocation_entry,
    allocation_request,
)
from shardserve.server.coordinator.ranks.encoded import Encoded, Entries, rank_stub, serialized


def _promote(version: tuple[str, int]) -> pb.PromoteVersionRequest:
    return pb.PromoteVersionRequest(name=version[0], version=version[1])


def _drop(version: tuple[str, int]) -> pb.DropVersionRequest:
    return pb.DropVersionRequest(name=version[0], version=version[1])


def _allocate(version: tuple[str, int]) -> pb.AllocateShardsRequest:
    return pb.AllocateShardsRequest(name=version[0], version=version[1], reserve_only=True)


def test_joined_entries_parse_to_the_message_built_field_by_field():
    versions = [
        ("layer.w", 3),
        ("layer.b", 1 << 40),
        ("é" * 70, 2),
    ]  # a long name: a two-byte length
    tensors = Entries(pb.AllocateManyRequest, "tensors", serialized(_allocate))
    drops = Entries(pb.AllocateManyRequest, "drop_first", serialized(_drop))
    fields = pb.AllocateManyRequest(writer_host_id="host-1").SerializeToString()
    encoded = Encoded(fields + tensors.joined(versions) + drops.joined(versions[:1]))
    expected = pb.AllocateManyRequest(
        writer_host_id="host-1",
        tensors=[_allocate(v) for v in versions],
        drop_first=[_drop(versions[0])],
    )
    assert pb.AllocateManyRequest.FromString(encoded.data) == expected
    assert pb.PromoteManyRequest.FromString(
        Entries(pb.PromoteManyRequest, "versions", serialized(_promote)).joined([])
    ) == (pb.PromoteManyRequest())


def test_an_entry_repeated_across_ranks_is_encoded_once():
    made: list[tuple[str, int]] = []

    def make(version: tuple[str, int]) -> pb.PromoteVersionRequest:
        made.append(version)
        return _promote(version)

    entries = Entries(pb.PromoteManyRequest, "versions", serialized(make))
    first = entries.joined([("a", 1), ("b", 1)])
    second = entries.joined([("b", 1), ("a", 1)])
    assert made == [("a", 1), ("b", 1)]
    assert [v.name for v in pb.PromoteManyRequest.FromString(second).versions] == ["b", "a"]
    assert pb.PromoteManyRequest.FromString(first).versions[0].name == "a"


class Recorder(pb_grpc.ShardServerServicer):
    """Records the PromoteMany requests it parsed and answers one checksum per entry."""

    def __init__(self) -> None:
        self.seen: list[pb.PromoteManyRequest] = []

    def PromoteMany(self, request, context):  # noqa: N802 - the service's name
        self.seen.append(request)
        return pb.PromoteManyResponse(
            checksums=[
                pb.ShardChecksum(name=v.name, version=v.version, checksum=7)
                for v in request.versions
            ]
        )

    def RunCollective(self, request, context):  # noqa: N802 - the service's name
        yield pb.CollectiveProgress(bytes_done=1, bytes_total=2)
        yield pb.CollectiveProgress(bytes_done=2, bytes_total=2, done=True)


class CountingChannel:
    """A real channel that records each callable made on it: (kind, method path)."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.channel = channel
        self.made: list[tuple[str, str]] = []

    def unary_unary(self, path: str, **options):
        self.made.append(("unary_unary", path))
        return self.channel.unary_unary(path, **options)

    def unary_stream(self, path: str, **options):
        self.made.append(("unary_stream", path))
        return self.channel.unary_stream(path, **options)


def _serve(recorder: Recorder) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_ShardServerServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_the_rank_stub_sends_encoded_requests_and_messages_alike():
    recorder = Recorder()
    server, address = _serve(recorder)
    entries = Entries(pb.PromoteManyRequest, "versions", serialized(_promote))
    fields = pb.PromoteManyRequest(finish_in_place=True).SerializeToString()
    encoded = Encoded(fields + entries.joined([("t", 1), ("u", 2)]))
    expected = pb.PromoteManyRequest(
        finish_in_place=True, versions=[_promote(("t", 1)), _promote(("u", 2))]
    )
    try:
        with grpc.insecure_channel(address) as channel:
            stub = rank_stub(channel)
            answer = stub.PromoteMany(encoded, timeout=10)
            stub.PromoteMany(expected, timeout=10)
        assert [c.name for c in answer.checksums] == ["t", "u"]

        async def on_aio() -> pb.PromoteManyResponse:
            async with grpc.aio.insecure_channel(address) as channel:
                return await rank_stub(channel).PromoteMany(encoded, timeout=10)

        assert asyncio.run(on_aio()) == answer
        assert recorder.seen == [expected, expected, expected]
    finally:
        server.stop(None)


def test_an_allocation_entry_parses_to_the_request_built_field_by_field():
    def layout(*ranks: int) -> ShardedTensorMetadata:
        shards = tuple(ShardMetadata((i,), (2,), f"rank:{r}/cpu") for i, r in enumerate(ranks))
        return ShardedTensorMetadata(shards, (2 * len(ranks),), TensorProperties())

    records = [
        TensorRecord("a", 1, layout(0, 1)),
        TensorRecord("b", 1 << 40, layout(0, 1)),  # the same layout: its shared fields reused
        TensorRecord("c", 7, layout(1, 0), options=TensorOptions("default", b"\x01\x02")),
    ]
    allocations = [
        Allocation(),
        Allocation(init=Init.COPY, source_version=5, source_name="p@1/k"),
        Allocation(init=Init.NORMAL, seed=11),
        Allocation(reserve_only=True),
    ]
    for record in records:
        for allocation in allocations:
            entry = pb.AllocateShardsRequest.FromString(allocation_entry(record, allocation))
            assert entry == allocation_request(record, allocation)


def test_copies_of_many_sources_encode_their_shared_layout_once(monkeypatch):
    """A delta put's copies each name another source tensor: the layout they share is still encoded once."""
    from shardserve.server.coordinator.ranks import calls

    encoded = []
    real = calls.metadata_to_proto
    monkeypatch.setattr(calls, "metadata_to_proto", lambda m: encoded.append(m) or real(m))
    shards = tuple(ShardMetadata((i * 3,), (3,), f"rank:{i}/cpu") for i in range(3))
    layout = ShardedTensorMetadata(shards, (9,), TensorProperties(dtype=torch.float64))
    records = [TensorRecord(f"p@8/key{k}", 100 + k, layout) for k in range(50)]
    copies = [
        Allocation(init=Init.COPY, source_version=50 + k, source_name=f"p@7/key{k}")
        for k in range(50)
    ]
    entries = [allocation_entry(r, c) for r, c in zip(records, copies)]
    assert encoded.count(layout) == 1
    for entry, record, copy in zip(entries, records, copies):
        assert pb.AllocateShardsRequest.FromString(entry) == allocation_request(record, copy)


def test_the_rank_stub_makes_a_methods_callable_once_when_first_used():
    """A stub per rank made at registration and per fan-out channel: none of the service's 23 callables is made
    up front, each one used is made once, of its kind (a server stream for RunCollective), and a name the
    service lacks is an AttributeError."""
    recorder = Recorder()
    server, address = _serve(recorder)
    request = pb.PromoteManyRequest(versions=[_promote(("t", 1))])
    try:
        with grpc.insecure_channel(address) as channel:
            counting = CountingChannel(channel)
            stub = rank_stub(counting)
            assert counting.made == []
            for _ in range(2):
                assert [c.name for c in stub.PromoteMany(request, timeout=10).checksums] == ["t"]
            progress = list(stub.RunCollective(pb.CollectiveJob(), timeout=10))
            assert [p.bytes_done for p in progress] == [1, 2] and progress[-1].done
            with pytest.raises(AttributeError, match="NoSuchMethod"):
                stub.NoSuchMethod  # noqa: B018 - the lookup is what is tested
        service = "/shardserve.v1.ShardServer"
        assert counting.made == [
            ("unary_unary", f"{service}/PromoteMany"),
            ("unary_stream", f"{service}/RunCollective"),
        ]
    finally:
        server.stop(None)
