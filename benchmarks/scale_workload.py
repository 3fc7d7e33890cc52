"""What the scale harness asks of the coordinator: a state dict of many tiny tensors, replicated tables to
reshard and repair, and the calls that put, commit, reshard and read them (raw gRPC, as a client sends them).

Every tensor lives on one *group* of GROUP_RANKS consecutive ranks (all ranks when there are fewer), as a
tensor-parallel group holds its part of a model: the work (tensors, shards, bytes) stays the same whatever the
number of ranks, so a cost that grows with the ranks is the coordinator's own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import NamedTuple

import torch

from shardserve.core.metadata import ShardedTensorMetadata, ShardMetadata, TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.core.wire import metadata_to_proto
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc

GROUP_RANKS = 10
ROWS, COLS = 10, 4  # a state dict tensor: 10 row shards of 4 float32 (16 bytes each)
TABLE_COLS = 4
WRITE_THREADS = 16
TIMEOUT_S = 600.0
PREFIX = "scale"


def group_of(index: int, world: int) -> list[int]:
    """The ranks of the group that holds tensor `index`."""
    size = min(GROUP_RANKS, world)
    groups = max(1, world // size)
    first = (index % groups) * size
    return list(range(first, first + size))


def state_layout(index: int, world: int) -> ShardedTensorMetadata:
    """Tensor `index` of the state dict: ROWS x COLS float32, one row per shard over its group (Shard(0))."""
    ranks = group_of(index, world)
    placements = [f"rank:{ranks[r % len(ranks)]}/cpu" for r in range(ROWS)]
    return ChunkShardingSpec(0, placements).build_metadata((ROWS, COLS), TensorProperties())


def state_value(index: int) -> torch.Tensor:
    """The values tensor `index` of the state dict holds (distinct per tensor: a mixed-up shard shows)."""
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + index * 1000


def table_layout(index: int, world: int, rows: int, shift: int = 0) -> ShardedTensorMetadata:
    """Table `index`: `rows` x TABLE_COLS float32, one row per box and each box on two ranks of its group
    (replicas), the copies of row r on group[(r + shift) % n] and group[(r + shift + 1) % n]."""
    ranks = group_of(index, world)
    n = len(ranks)
    shards = tuple(
        ShardMetadata((r, 0), (1, TABLE_COLS), f"rank:{ranks[(r + shift + copy) % n]}/cpu")
        for r in range(rows)
        for copy in range(2 if n > 1 else 1)
    )
    return ShardedTensorMetadata(shards, (rows, TABLE_COLS), TensorProperties())


def table_value(rows: int) -> torch.Tensor:
    """What an arange-filled table holds: each element's row-major index."""
    return torch.arange(rows * TABLE_COLS, dtype=torch.float32).reshape(rows, TABLE_COLS)


@dataclass(frozen=True)
class StateDict:
    """The harness's state dict: `count` tensors over `world` ranks."""

    count: int
    world: int

    def key(self, index: int) -> str:
        return f"layer{index}.weight"

    @property
    def shards(self) -> int:
        return self.count * ROWS

    def create_request(self) -> pb.CreateSnapshotRequest:
        return pb.CreateSnapshotRequest(
            prefix=PREFIX,
            keep=1,
            tensors=[
                pb.SnapshotTensor(
                    key=self.key(i), metadata=metadata_to_proto(state_layout(i, self.world))
                )
                for i in range(self.count)
            ],
        )


def write_snapshot(snapshot: pb.SnapshotInfo, rank_stub, *, state: StateDict) -> int:
    """Write every shard of a pending snapshot of `state` to its rank (WriteShards, one call per rank, ranks at
    once); the bytes written."""
    index_of = {state.key(i): i for i in range(state.count)}
    per_rank: dict[int, tuple[list[pb.WriteShardHeader], list[bytes]]] = {}
    for entry in snapshot.entries:
        value = state_value(index_of[entry.key])
        for shard_index, shard in enumerate(entry.tensor.metadata.shards_metadata):
            rank = int(shard.placement.split(":")[1].split("/")[0])
            row = value[shard.shard_offsets[0] : shard.shard_offsets[0] + shard.shard_sizes[0]]
            data = row.contiguous().numpy().tobytes()
            headers, chunks = per_rank.setdefault(rank, ([], []))
            headers.append(
                pb.WriteShardHeader(
                    name=entry.tensor.name,
                    version=entry.tensor.version,
                    shard_index=shard_index,
                    dtype=pb.FLOAT32,
                    nbytes=len(data),
                )
            )
            chunks.append(data)

    def write(rank: int) -> int:
        headers, chunks = per_rank[rank]
        request = pb.WriteShardsRequest(shards=headers, data=b"".join(chunks))
        return rank_stub(rank).WriteShards(request, timeout=TIMEOUT_S).bytes_written

    with futures.ThreadPoolExecutor(WRITE_THREADS) as pool:
        return sum(pool.map(write, sorted(per_rank)))


def create_tables(stub: pb_grpc.CoordinatorStub, *, count: int, rows: int, world: int) -> None:
    """Create and commit `count` arange-filled replicated tables (CreateTensor with INIT_ARANGE)."""

    def create(index: int) -> None:
        stub.CreateTensor(  # overwrite: an attempt that failed may have left the table, or its put pending
            pb.CreateTensorRequest(
                name=f"table{index}",
                metadata=metadata_to_proto(table_layout(index, world, rows)),
                init=pb.INIT_ARANGE,
                overwrite=True,
            ),
            timeout=TIMEOUT_S,
        )

    with futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(create, range(count)))


class ReshardRun(NamedTuple):
    """One table's reshard as the harness saw it."""

    plan_s: float  # to the first progress message, which comes once the plan is made and checked
    plan_cpu_s: float  # the coordinator's CPU seconds meanwhile (its other threads' too)
    fanout_s: float  # from there to DONE
    tensor: pb.TensorInfo  # the new version


def reshard_table(
    stub: pb_grpc.CoordinatorStub,
    index: int,
    *,
    rows: int,
    world: int,
    shift: int,
    cpu: Callable[[], float] = lambda: 0.0,
) -> ReshardRun:
    """Reshard table `index` to its layout shifted by `shift` ranks; `cpu`: the coordinator's CPU seconds so
    far (planning's share of the coordinator's time apart from the simulated ranks', which share its cores)."""
    request = pb.ReshardRequest(
        name=f"table{index}", metadata=metadata_to_proto(table_layout(index, world, rows, shift))
    )
    cpu0 = cpu()
    start = time.perf_counter()
    first = plan_cpu = None
    done = None
    for progress in stub.Reshard(request, timeout=TIMEOUT_S):
        if first is None:
            first, plan_cpu = time.perf_counter(), cpu() - cpu0
        if progress.phase == pb.RESHARD_DONE:
            done = progress.tensor
    end = time.perf_counter()
    if done is None or first is None or plan_cpu is None:
        raise RuntimeError(f"reshard of table{index} ended without RESHARD_DONE")
    return ReshardRun(first - start, plan_cpu, end - first, done)
