"""get_state_dict of many small tensors (client.spmd batching them per rank as ReadRegions calls) on a real cluster.

One 2-rank cluster for the module. A world of one gets ~300 small tensors and a few big ones into plain
tensors; a 2-process gloo job writes columns and reads rows, so every piece it reads spans two server shards;
a batch whose rank fails is read again piece by piece, and a batch refused as a bad request fails the get.
Every piece is compared bit for bit with plain torch.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest
import torch
from gloo_world import World

from shardserve.client import connect, counters, spmd
from shardserve.client.errors import InvalidArgumentError, RankUnavailableError
from shardserve.server.launcher import LocalCluster

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.int64,
    torch.bool,
    torch.float16,
    torch.uint8,
    torch.complex64,
]
SHAPES = [(16, 16), (7,), (3, 5, 2), (1, 9), (33, 4), ()]


def value(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The global tensor of `key`: every element tells its key and place."""
    base = torch.arange(torch.Size(shape).numel(), dtype=torch.int64).reshape(shape) * 3 + sum(
        map(ord, key)
    )
    if dtype == torch.bool:
        return base % 3 == 1
    if dtype == torch.uint8:
        return (base % 251).to(dtype)
    if dtype.is_complex:
        return torch.complex(base.float(), -base.float() / 4).to(dtype)
    return base.to(dtype) if not dtype.is_floating_point else (base.to(torch.float64) / 8).to(dtype)


def small_and_big() -> dict[str, torch.Tensor]:
    """300 small tensors of every dtype and shape, and 3 over the batching threshold."""
    state = {
        f"block{i % 7}.p{i}": value(f"p{i}", SHAPES[i % len(SHAPES)], DTYPES[i % len(DTYPES)])
        for i in range(300)
    }
    state.update({f"big{i}": value(f"big{i}", (300, 100 + i), torch.float32) for i in range(3)})
    return state


def network_reads() -> int:
    """Reads answered over the network (the batches: shared memory serves this host's single reads)."""
    reads = counters.metrics()["reads"]
    return reads.get("grpc", 0) + reads.get("bulk", 0)


# ---------------------------------------------------------------- job functions (run on every world rank)


def job_columns_then_rows(rank: int, address: str) -> list[str]:
    """Put 40 small 2-D tensors as Shard(1) of 2 ranks, get them as Shard(0): each piece spans both shards."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh("cpu", [0, 1])
    full = {f"w{i}": value(f"w{i}", (6 + i % 3, 8), DTYPES[i % len(DTYPES)]) for i in range(40)}
    with connect(address) as cluster:
        spmd.put_state_dict(
            cluster, {k: distribute_tensor(t, mesh, [Shard(1)]) for k, t in full.items()}, "cols"
        )
        into = {
            k: distribute_tensor(torch.zeros_like(t), mesh, [Shard(0)]) for k, t in full.items()
        }
        before = network_reads()
        spmd.get_state_dict(cluster, "cols", into=into)
        assert network_reads() > before, "the small pieces were not read in batches"
    wrong = []
    for key, tensor in into.items():
        rows = full[key].shape[0]
        start = min(rank * ((rows + 1) // 2), rows)
        if not torch.equal(tensor.to_local(), full[key][start : start + (rows + 1) // 2]):
            wrong.append(key)
    return wrong


# ---------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def cluster(cluster2: LocalCluster) -> LocalCluster:
    """The shared 2-rank cluster (conftest)."""
    return cluster2


@pytest.fixture(scope="module")
def put(cluster: LocalCluster) -> dict[str, torch.Tensor]:
    state = small_and_big()
    with connect(cluster.address) as client:
        spmd.put_state_dict(client, state, "small")
    return state


def test_a_world_of_one_gets_small_and_big_tensors_bit_for_bit(
    cluster: LocalCluster, put: dict
) -> None:
    into = {key: torch.zeros_like(t) for key, t in put.items()}
    into["big0"] = torch.zeros(100, 300).t()  # strided targets, big and small
    into["block0.p0"] = torch.zeros(16, 16).t()
    with connect(cluster.address) as client:
        before = network_reads()
        spmd.get_state_dict(client, "small", into=into)
        batched = network_reads() - before
    assert 1 <= batched <= 4, batched  # one call per rank and MiB, not one per small piece
    assert [key for key, t in put.items() if not torch.equal(into[key], t)] == []


@pytest.fixture(scope="module")
def spans(cluster: LocalCluster) -> dict[str, torch.Tensor]:
    """Small tensors put as two row shards, one on each rank."""
    from shardserve.core.specs import ChunkShardingSpec

    state = {f"t{i}": value(f"t{i}", (9, 5), DTYPES[i % len(DTYPES)]) for i in range(20)}
    with connect(cluster.address) as client:
        spmd.put_state_dict(
            client, state, "spans", spec=ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"])
        )
        assert {s.rank for s in client.snapshot("spans")["t0"].metadata().shards_metadata} == {0, 1}
    return state


def test_a_piece_over_two_server_shards_is_filled_from_both(
    cluster: LocalCluster, spans: dict
) -> None:
    into = {key: torch.zeros_like(t) for key, t in spans.items()}
    with connect(cluster.address) as client:
        spmd.get_state_dict(client, "spans", into=into)
    assert [key for key, t in spans.items() if not torch.equal(into[key], t)] == []


def test_a_two_process_job_reads_rows_of_column_shards(
    cluster: LocalCluster, world2: World
) -> None:
    answers = world2.run(job_columns_then_rows, cluster.address, timeout=180)
    assert answers == {0: [], 1: []}


def refusing(method: Any, refuse: Any) -> Any:
    """`method` (a network path's ReadRegions call, sent or whole) raising `refuse(address)`'s error where
    it gives one, else calling through."""

    def call(self: Any, address: str, request: Any, *args: Any, **kwargs: Any) -> Any:
        error = refuse(address, request)
        if error is not None:
            raise error
        return method(self, address, request, *args, **kwargs)

    return call


def refuse_batches(monkeypatch: pytest.MonkeyPatch, refuse: Any) -> None:
    """Make every ReadRegions call, on the bulk port and over gRPC, go through `refuse` first."""
    from shardserve.client.paths.bulk import BulkPath
    from shardserve.client.paths.grpc import GrpcPath

    monkeypatch.setattr(BulkPath, "send_read_regions", refusing(BulkPath.send_read_regions, refuse))
    monkeypatch.setattr(GrpcPath, "read_regions", refusing(GrpcPath.read_regions, refuse))


def test_a_batch_whose_rank_fails_is_read_piece_by_piece(
    cluster: LocalCluster, spans: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    failed = []
    into = {key: torch.zeros_like(t) for key, t in spans.items()}
    with connect(cluster.address) as client:
        down = next(r.address for r in client.ranks() if r.rank == 1)

        def rank1_down(address: str, request: Any) -> Exception | None:
            if address != down:
                return None
            failed.append(len(request.regions))
            return RankUnavailableError(f"rank at {address}: connection refused")

        refuse_batches(monkeypatch, rank1_down)
        spmd.get_state_dict(client, "spans", into=into)
    assert failed, "no batch went to rank 1"
    assert [key for key, t in spans.items() if not torch.equal(into[key], t)] == []


def test_a_batch_whose_bulk_port_fails_goes_over_grpc(
    cluster: LocalCluster, spans: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardserve.client.paths.bulk import BulkPath, BulkReadError

    def port_down(address: str, request: Any) -> Exception:
        return BulkReadError(f"rank at {address}, bulk port: connection refused")

    monkeypatch.setattr(
        BulkPath, "send_read_regions", refusing(BulkPath.send_read_regions, port_down)
    )
    into = {key: torch.zeros_like(t) for key, t in spans.items()}
    with connect(cluster.address) as client:
        before = counters.metrics()["reads"].get("grpc", 0)
        spmd.get_state_dict(client, "spans", into=into)
        assert counters.metrics()["reads"].get("grpc", 0) - before == 2  # one batch per rank
    assert [key for key, t in spans.items() if not torch.equal(into[key], t)] == []


def test_a_batch_refused_as_a_bad_request_fails_the_get(
    cluster: LocalCluster, put: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(address: str, request: Any) -> Exception:
        return InvalidArgumentError("regions[0]: offsets/sizes: box is not inside the shard")

    refuse_batches(monkeypatch, refused)
    with connect(cluster.address) as client:
        with pytest.raises(spmd.SpmdError, match=r"regions\[0\]"):
            spmd.get_state_dict(client, "small", into={"block0.p0": torch.zeros(16, 16)})


def test_a_state_dict_put_and_get_run_with_the_cyclic_collector_paused(
    cluster: LocalCluster, put: dict
) -> None:
    """With a young-generation threshold low enough that the calls' undecorated bodies collect dozens of times
    on the calling thread, the calls themselves collect there at most once or twice (the young generation swept
    right after the collector is back on), and leave it on."""
    into = {key: torch.zeros_like(t) for key, t in put.items()}
    caller, counting, counted = threading.get_ident(), [False], [0]

    def count(phase: str, info: dict) -> None:
        if phase == "start" and counting[0] and threading.get_ident() == caller:
            counted[0] += 1

    def collections_in(call) -> int:  # type: ignore[no-untyped-def]
        counted[0], counting[0] = 0, True
        call()
        counting[0] = False
        return counted[0]

    threshold = gc.get_threshold()
    gc.set_threshold(50, 10, 10)
    gc.callbacks.append(count)
    try:
        with connect(cluster.address) as client:
            paused = collections_in(lambda: spmd.put_state_dict(client, put, "paused"))
            paused += collections_in(lambda: spmd.get_state_dict(client, "paused", into=into))
            assert gc.isenabled()
            plain = collections_in(
                lambda: spmd.put_state_dict.__wrapped__(client, put, "paused")  # type: ignore[attr-defined]
            )
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*threshold)
    assert paused <= 4 and plain >= 20, (paused, plain)
    assert [key for key, t in put.items() if not torch.equal(into[key], t)] == []


def test_a_state_dict_get_leaves_no_tensor_proxies_behind(cluster: LocalCluster, put: dict) -> None:
    """The proxy a get makes for each tensor is freed by reference counting when the get returns: with the
    collector off, no RemoteShardedTensor of the get is still tracked after it (a proxy and its reader holding
    each other would be a cycle per tensor, hundreds every step, left for the collector)."""
    into = {key: torch.zeros_like(t) for key, t in put.items()}

    def proxies() -> int:
        return sum(type(o).__name__ == "RemoteShardedTensor" for o in gc.get_objects())

    with connect(cluster.address) as client:
        spmd.put_state_dict(client, put, "proxies")
        was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()
        try:
            before = proxies()
            spmd.get_state_dict(client, "proxies", into=into)
            after = proxies()
        finally:
            if was_enabled:
                gc.enable()
    assert after == before, (before, after)
    assert [key for key, t in put.items() if not torch.equal(into[key], t)] == []
