"""Ranks of one host reshard through each other's shard memory: a real `up`-style cluster of two CPU ranks.

Nothing of a reshard between them crosses gloo (the reshard's answer counts the bytes copied through memory and
the bytes sent), for plain reshards and for replicated layouts, bit for bit. A source rank SIGKILLed while its
peer has its memory mapped fails the job naming it, and the old version stays the one the catalog serves.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from reference import shards_of
from waiting import wait_until

from shardserve import connect
from shardserve.client.errors import RankUnavailableError, ShardServeError
from shardserve.core.metadata import TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.server.rank.jobs.reshard import MAPPED_STALL_ENV

SHAPE = (256, 192)
VICTIM = "mapped_victim"
STALL_S = 6  # rank 1's pause once it has mapped rank 0's memory, in reshards of VICTIM


def chunk(dim: int, ranks=(0, 1)) -> ChunkShardingSpec:
    return ChunkShardingSpec(dim, [f"rank:{r}/cpu" for r in ranks])


def source(dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(SHAPE, generator=gen).to(dtype)
    return torch.randint(-(2**31), 2**31, SHAPE, generator=gen).to(dtype)


@pytest.fixture(scope="module")
def cluster(make_cluster):
    with pytest.MonkeyPatch.context() as patch:  # the ranks inherit it
        patch.setenv(MAPPED_STALL_ENV, f"1:{STALL_S}:{VICTIM}")
        return make_cluster(ranks=2)


def reshard_counting(proxy, spec, **kwargs):
    """Reshard `proxy` into `spec`; (the new proxy, the "done" report)."""
    reports = []
    moved = proxy.reshard(spec, progress=reports.append, timeout=30, **kwargs)
    done = [r for r in reports if r.phase == "done"]
    assert done, reports
    return moved, done[-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_two_ranks_of_one_host_reshard_without_the_network(cluster, dtype):
    tensor = source(dtype, seed=len(str(dtype)))
    with connect(cluster.address) as client:
        proxy = client.put(f"rows_{dtype}".replace(".", "_"), tensor, spec=chunk(0))
        moved, done = reshard_counting(proxy, chunk(1))
        assert torch.equal(moved.full_tensor(), tensor)
        # rows -> columns: each rank needs half of the other's rows, copied out of its memory
        half = tensor.numel() * tensor.element_size() // 2
        assert done.mapped_bytes == half and done.sent_bytes == 0
        back, done = reshard_counting(moved, chunk(0))
        assert torch.equal(back.full_tensor(), tensor) and done.sent_bytes == 0


def test_replicas_are_made_through_memory_too(cluster):
    tensor = source(torch.float64, seed=5)
    with connect(cluster.address) as client:
        proxy = client.put("replicated_rows", tensor, spec=chunk(0))
        moved, done = reshard_counting(proxy, chunk(1), replicas=2)
        assert torch.equal(moved.full_tensor(), tensor)
        assert done.sent_bytes == 0 and done.mapped_bytes > 0
        for per_rank in moved.remote_shards().values():
            for shard in per_rank:
                part = shards_of(tensor, moved.metadata())[shard.index]
                assert torch.equal(shard.fetch(), part)


def _maps_rank_0_memory(pids: list[int]) -> bool:
    """Whether rank 1's process maps one of rank 0's memfds (its shard segments)."""
    rank_0, rank_1 = pids
    inodes = set()
    for fd in os.listdir(f"/proc/{rank_0}/fd"):
        try:
            if "shardserve-shard" in os.readlink(f"/proc/{rank_0}/fd/{fd}"):
                inodes.add(os.stat(f"/proc/{rank_0}/fd/{fd}").st_ino)
        except OSError:
            continue
    with open(f"/proc/{rank_1}/maps") as maps:
        return any(int(line.split()[4]) in inodes for line in maps if "shardserve-shard" in line)


def test_a_source_killed_while_its_memory_is_mapped_fails_the_job_and_the_old_version_stays(
    cluster,
):
    tensor = source(torch.float32, seed=9)
    src = chunk(0).build_metadata(SHAPE, TensorProperties(dtype=torch.float32))
    with connect(cluster.address) as client:
        proxy = client.put(VICTIM, tensor, spec=chunk(0))
        outcome: dict[str, BaseException] = {}

        def run() -> None:
            try:
                proxy.reshard(chunk(1), timeout=30)
            except ShardServeError as err:
                outcome["error"] = err

        thread = threading.Thread(target=run)
        thread.start()
        pids = cluster.rank_pids
        wait_until(lambda: _maps_rank_0_memory(pids), 20, "rank 1 to map rank 0's shard")
        killed = time.monotonic()
        cluster.kill_rank(0, signal.SIGKILL)
        thread.join(60)
        assert not thread.is_alive()
        error = outcome.get("error")
        assert isinstance(error, RankUnavailableError), error
        assert "rank 0 is down" in str(error)
        assert time.monotonic() - killed < 30
        after = client.tensor(VICTIM)
        assert after.version == proxy.version  # the catalog still serves the old version
        shard = next(s for s in after.remote_shards()[1] if s.index == 1)
        assert torch.equal(shard.fetch(), shards_of(tensor, src)[1])
