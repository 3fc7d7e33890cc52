"""AllocateMany / PromoteMany / DropMany on one rank: the servicer called in-process on a real ShardStore.

A batch allocates every tensor or none (a tensor over the memory limit leaves nothing allocated), every bad
field is refused before anything changes and named by its index, the count per call is capped, and with
persistence each promoted version is durable and restores bit for bit.
"""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
import pytest
import torch
from server_helpers import Aborted, ServicerContext

from shardserve.core.metadata import TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.core.wire import metadata_to_proto
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.rank.persistence import FsyncPolicy, Persistence
from shardserve.server.rank.service import MAX_BATCH_VERSIONS, ShardServerServicer
from shardserve.server.rank.store import ShardStore, VersionState

SHAPE = (4, 8)  # float32: 128 bytes a tensor


def allocation(
    name: str, version: int = 1, shape: tuple[int, ...] = SHAPE
) -> pb.AllocateShardsRequest:
    meta = ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata(
        shape, TensorProperties(dtype=torch.float32)
    )
    return pb.AllocateShardsRequest(
        name=name, version=version, metadata=metadata_to_proto(meta), init=pb.INIT_ARANGE
    )


def servicer(memory_limit: int = 0, persist_root: Path | None = None) -> ShardServerServicer:
    persistence = None if persist_root is None else Persistence(0, persist_root, FsyncPolicy.ALWAYS)
    return ShardServerServicer(
        ShardStore(
            0,
            memory_limit=memory_limit,
            shared_memory=False,
            version_grace=0,
            persistence=persistence,
        )
    )


def refused(call, request) -> Aborted:  # type: ignore[no-untyped-def]
    with pytest.raises(Aborted) as caught:
        call(request, ServicerContext())
    return caught.value


def promote_many(names: list[str], version: int = 1) -> pb.PromoteManyRequest:
    return pb.PromoteManyRequest(
        versions=[pb.PromoteVersionRequest(name=n, version=version) for n in names]
    )


def drop_many(names: list[str], version: int = 1) -> pb.DropManyRequest:
    return pb.DropManyRequest(
        versions=[pb.DropVersionRequest(name=n, version=version) for n in names]
    )


def test_a_batch_is_allocated_promoted_and_dropped_in_one_call_each():
    rank = servicer()
    names = [f"t{i}" for i in range(50)]
    answer = rank.AllocateMany(
        pb.AllocateManyRequest(tensors=[allocation(n) for n in names]), ServicerContext()
    )
    assert answer.allocated_bytes == 50 * 128 == rank.store.memory_used
    rank.PromoteMany(promote_many(names), ServicerContext())
    assert {(n, v, s) for n, v, s in rank.store.held()} == {
        (n, 1, VersionState.SERVED) for n in names
    }
    expected = torch.arange(32, dtype=torch.float32).reshape(SHAPE)
    assert all(torch.equal(rank.store.local_tensor(n, 1, 0), expected) for n in names)
    rank.DropMany(drop_many(names), ServicerContext())
    assert rank.store.held() == [] and rank.store.memory_used == 0


def test_a_batch_logs_one_line_per_call_and_a_single_tensor_its_own(caplog):
    rank = servicer()
    names = [f"t{i}" for i in range(50)]
    with caplog.at_level(logging.DEBUG, logger="shardserve.server.rank"):
        rank.AllocateMany(
            pb.AllocateManyRequest(tensors=[allocation(n) for n in names]), ServicerContext()
        )
        rank.PromoteMany(promote_many(names), ServicerContext())
        rank.DropMany(drop_many(names), ServicerContext())
        rank.AllocateShards(allocation("alone"), ServicerContext())
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert info == [
        "rank 0 allocated 6400 bytes for 't0' version 1, 't1' version 1, 't2' version 1 "
        "and 47 more",
        "rank 0 serves 't0' version 1, 't1' version 1, 't2' version 1 and 47 more",
        "rank 0 dropped 50 held versions of 't0' version 1, 't1' version 1, 't2' version 1 "
        "and 47 more",
        "rank 0 allocated 'alone' version 1: 1 shards, 128 bytes",
    ]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert sum("allocated 't" in m for m in debug) == 50  # each tensor still there at DEBUG


def test_a_tensor_over_the_memory_limit_leaves_nothing_allocated():
    rank = servicer(memory_limit=3 * 128)
    batch = [allocation("a"), allocation("b"), allocation("big", shape=(4, 16)), allocation("c")]
    err = refused(rank.AllocateMany, pb.AllocateManyRequest(tensors=batch))
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.details.startswith(
        "tensors[2] ('big' version 1): "
    )
    assert "memory limit" in err.details
    assert rank.store.held() == [] and rank.store.memory_used == 0
    fits = rank.AllocateMany(
        pb.AllocateManyRequest(tensors=[allocation(n, 2) for n in "abc"]), ServicerContext()
    )
    assert fits.allocated_bytes == 3 * 128  # the failed batch's room was given back


def test_a_tensor_already_held_fails_the_batch_and_keeps_the_held_one():
    rank = servicer()
    rank.AllocateMany(pb.AllocateManyRequest(tensors=[allocation("held")]), ServicerContext())
    err = refused(
        rank.AllocateMany, pb.AllocateManyRequest(tensors=[allocation("new"), allocation("held")])
    )
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION and err.details.startswith(
        "tensors[1] ('held' version 1): "
    )
    assert [(n, v) for n, v, _ in rank.store.held()] == [("held", 1)]


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda r: setattr(r, "name", ""), "tensors[1].name is empty"),
        (lambda r: setattr(r, "version", 0), "tensors[1].version must be > 0"),
        (lambda r: r.metadata.size.append(-3), "tensors[1].metadata"),
        (lambda r: setattr(r.options, "oov", 9), "tensors[1].options.oov 9"),
    ],
)
def test_a_bad_field_is_named_and_refused_before_anything_is_allocated(change, field):
    rank = servicer()
    bad = allocation("bad")
    change(bad)
    err = refused(
        rank.AllocateMany,
        pb.AllocateManyRequest(tensors=[allocation("good"), bad, allocation("late")]),
    )
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and field in err.details
    assert rank.store.held() == [] and rank.store.memory_used == 0


def test_bad_promotes_and_drops_change_nothing():
    rank = servicer()
    rank.AllocateMany(
        pb.AllocateManyRequest(tensors=[allocation("a"), allocation("b")]), ServicerContext()
    )
    bad = promote_many(["a", "b"])
    bad.versions[1].version = 0
    err = refused(rank.PromoteMany, bad)
    assert (
        err.code == grpc.StatusCode.INVALID_ARGUMENT
        and "versions[1].version must be > 0" in err.details
    )
    err = refused(rank.PromoteMany, promote_many(["a", "missing"]))
    assert err.code == grpc.StatusCode.NOT_FOUND and err.details.startswith("versions[1]: ")
    bad = drop_many(["a", "b"])
    bad.versions[1].name = "x" * 10_000
    err = refused(rank.DropMany, bad)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "versions[1].name" in err.details
    assert {n for n, _, _ in rank.store.held()} == {"a", "b"}


@pytest.mark.parametrize(
    "method, request_of",
    [
        (
            "AllocateMany",
            lambda n: pb.AllocateManyRequest(
                tensors=[pb.AllocateShardsRequest(name="t", version=1)] * n
            ),
        ),
        (
            "PromoteMany",
            lambda n: pb.PromoteManyRequest(
                versions=[pb.PromoteVersionRequest(name="t", version=1)] * n
            ),
        ),
        (
            "DropMany",
            lambda n: pb.DropManyRequest(versions=[pb.DropVersionRequest(name="t", version=1)] * n),
        ),
    ],
)
def test_the_count_per_call_is_capped(method, request_of):
    err = refused(getattr(servicer(), method), request_of(MAX_BATCH_VERSIONS + 1))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        f"{MAX_BATCH_VERSIONS + 1} in one call, over the limit of {MAX_BATCH_VERSIONS}"
        in err.details
    )


def test_persisted_batch_versions_restore_and_dropped_ones_do_not(tmp_path):
    rank = servicer(persist_root=tmp_path)
    names = [f"t{i}" for i in range(5)]
    rank.AllocateMany(
        pb.AllocateManyRequest(tensors=[allocation(n) for n in names]), ServicerContext()
    )
    rank.PromoteMany(promote_many(names), ServicerContext())
    rank.DropMany(drop_many(names[:2]), ServicerContext())
    rank.store.persistence.close()
    again = ShardStore(
        0,
        shared_memory=False,
        version_grace=0,
        persistence=Persistence(0, tmp_path, FsyncPolicy.ALWAYS),
    )
    assert sorted(again.restore()) == [(n, 1) for n in names[2:]]
    expected = torch.arange(32, dtype=torch.float32).reshape(SHAPE)
    assert all(torch.equal(again.local_tensor(n, 1, 0), expected) for n in names[2:])
