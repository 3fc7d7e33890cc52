"""get_state_dict of mid-size tensors held by same-host ranks (client.spmd_reads copying them out of mapped
memory one after another on the caller's thread) on a real cluster.

One 2-rank cluster for the module. Pieces between the batching threshold (64 KiB) and the parallel-copy size
(8 MiB) are read through mappings with one OpenShards call per rank, not one fetch each on the read pool; with
transport="shm" the small pieces are read so too. A mapped read that fails is read again by itself. Every piece
is compared bit for bit with plain torch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardserve.client import connect, counters, spmd
from shardserve.client.paths.shard_opener import SharedMemoryError
from shardserve.client.paths.shm import SharedMemoryPath
from shardserve.server.launcher import LocalCluster

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float16]


def mid_sized(count: int) -> dict[str, torch.Tensor]:
    """`count` tensors of 96 KiB to 1.5 MiB, of several dtypes, each filled with its own values."""
    state = {}
    for i in range(count):
        dtype = DTYPES[i % len(DTYPES)]
        rows = 48 + 16 * (i % 4)
        values = torch.arange(rows * 2048, dtype=torch.int64).reshape(rows, 2048) + 7 * i
        state[f"layer{i}.w"] = (
            (values % 251).to(dtype)
            if not dtype.is_floating_point
            else (values.to(torch.float64) / 16).to(dtype)
        )
    return state


def shm_reads() -> int:
    return counters.metrics()["reads"].get("shm", 0)


@pytest.fixture(scope="module")
def cluster(cluster2: LocalCluster) -> LocalCluster:
    """The shared 2-rank cluster (conftest)."""
    return cluster2


@pytest.fixture(scope="module")
def put(cluster: LocalCluster) -> dict[str, torch.Tensor]:
    state = mid_sized(40)
    with connect(cluster.address) as client:
        spmd.put_state_dict(client, state, "mid", durable=False)
    return state


def test_mid_size_pieces_are_read_through_mappings_rank_by_rank(
    cluster: LocalCluster, put: dict
) -> None:
    into = {key: torch.zeros_like(t) for key, t in put.items()}
    into["layer0.w"] = torch.zeros(2048, 48).t()  # a strided target
    into["layer5.w"] = torch.zeros(put["layer5.w"].shape, dtype=torch.bfloat16)  # a cast in flight
    with connect(cluster.address) as client:
        before = shm_reads()
        spmd.get_state_dict(client, "mid", into=into)
        assert shm_reads() - before <= 2  # one read per rank, not one per piece
    expected = dict(put, **{"layer5.w": put["layer5.w"].to(torch.bfloat16)})
    assert [key for key, t in expected.items() if not torch.equal(into[key], t)] == []


def test_a_mapped_read_that_fails_is_read_again_by_itself(
    cluster: LocalCluster, put: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    real, failed = SharedMemoryPath.start_read, []

    def every_third_refused(self: SharedMemoryPath, address: str, read: Any, *args: Any) -> Any:
        if not failed or len(failed) % 3:
            failed.append(read.summary.name)
            raise SharedMemoryError(f"rank at {address}: mapping refused")
        failed.append("")
        return real(self, address, read, *args)

    monkeypatch.setattr(SharedMemoryPath, "start_read", every_third_refused)
    into = {key: torch.zeros_like(t) for key, t in put.items()}
    with connect(cluster.address, transport="auto") as client:
        spmd.get_state_dict(client, "mid", into=into)
    assert any(failed)
    assert [key for key, t in put.items() if not torch.equal(into[key], t)] == []


def test_small_pieces_with_transport_shm_are_read_through_mappings(cluster: LocalCluster) -> None:
    state = {f"b{i}": torch.full((7, 3), float(i)) for i in range(30)}
    with connect(cluster.address) as client:
        spmd.put_state_dict(client, state, "small_shm", durable=False)
    into = {key: torch.zeros_like(t) for key, t in state.items()}
    with connect(cluster.address, transport="shm") as client:
        before = shm_reads()
        spmd.get_state_dict(client, "small_shm", into=into)
        assert shm_reads() - before <= 2
    assert [key for key, t in state.items() if not torch.equal(into[key], t)] == []


@pytest.mark.parametrize("verify", [False, True])
def test_large_same_host_pieces_are_copied_at_most_one_per_core_at_once(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch, verify: bool
) -> None:
    """Pieces over 8 MiB (and verified pieces) are fetched on the read pool; copies out of same-host memory go at
    most one per core at a time. Each fetch waits (bounded) for a third to start, so more at once would show."""
    import os
    import threading

    from shardserve.client.tensor import RemoteShardedTensor

    state = {f"big{i}": torch.full((2304, 1024), float(i)) for i in range(6)}  # 9 MiB each
    with connect(cluster.address) as client:
        spmd.put_state_dict(client, state, "lanes", durable=False)
    real, guard, most = RemoteShardedTensor.fetch, threading.Condition(), [0, 0]

    def counted(self: RemoteShardedTensor, *args: Any, **kwargs: Any) -> Any:
        with guard:
            most[0] += 1
            most[1] = max(most[1], most[0])
            guard.notify_all()
            guard.wait_for(lambda: most[0] > 2, timeout=0.2)
        try:
            return real(self, *args, **kwargs)
        finally:
            with guard:
                most[0] -= 1

    monkeypatch.setattr(RemoteShardedTensor, "fetch", counted)
    into = {key: torch.zeros_like(t) for key, t in state.items()}
    with connect(cluster.address) as client:
        spmd.get_state_dict(client, "lanes", into=into, verify=verify)
    assert 1 <= most[1] <= (os.cpu_count() or 1)
    assert [key for key, t in state.items() if not torch.equal(into[key], t)] == []
