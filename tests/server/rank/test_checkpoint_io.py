"""server.rank.jobs.checkpoint_io in real gloo worlds (2 and 3 ranks on 127.0.0.1): DCP round trips bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from gloo_world import World
from reference import shards_of

from shardserve.core.metadata import ShardedTensorMetadata, TensorProperties, make_metadata
from shardserve.core.specs import ChunkShardingSpec
from shardserve.server.common.dcp_metadata import checkpoint_tensors
from shardserve.server.rank.jobs.checkpoint_io import (
    CheckpointError,
    load_shards,
    load_tensors,
    save_shards,
    save_tensors,
)

SIZE = (51, 12)


def make_table(seed: int, size=SIZE, dtype=torch.float32) -> torch.Tensor:
    """A deterministic table both the test process and the ranks can build."""
    return torch.randn(size, generator=torch.Generator().manual_seed(seed)).to(dtype)


def layout(size, boxes, dtype=torch.float32) -> ShardedTensorMetadata:
    """Metadata from (row0, rows, col0, cols, rank) tuples (1-D tensors: (start, length, rank))."""
    if len(size) == 1:
        return make_metadata(size, [((r0,), (n,), rank) for r0, n, rank in boxes], dtype)
    return make_metadata(
        size, [((r0, c0), (nr, nc), rank) for r0, nr, c0, nc, rank in boxes], dtype
    )


UNEVEN_ROWS = layout(SIZE, [(0, 7, 0, 12, 0), (7, 30, 0, 12, 1), (37, 14, 0, 12, 2)])
COLUMNS = layout(SIZE, [(0, 51, 0, 5, 0), (0, 51, 5, 1, 1), (0, 51, 6, 6, 2)])
GRID = layout(
    SIZE,
    [
        (r0, nr, c0, nc, (i * 3 + j) % 3)
        for i, (r0, nr) in enumerate([(0, 20), (20, 31)])
        for j, (c0, nc) in enumerate([(0, 4), (4, 5), (9, 3)])
    ],
)
REPLICATED = layout(
    SIZE,
    [(0, 26, 0, 12, 0), (0, 26, 0, 12, 2), (26, 25, 0, 6, 1), (26, 25, 6, 6, 2), (26, 25, 6, 6, 0)],
)
THREE_RANK_LAYOUTS = {
    "uneven_rows": UNEVEN_ROWS,
    "columns": COLUMNS,
    "grid": GRID,
    "replicated": REPLICATED,
}


def as_dtype(meta: ShardedTensorMetadata, dtype: torch.dtype) -> ShardedTensorMetadata:
    return dataclasses.replace(meta, tensor_properties=TensorProperties(dtype=dtype))


def expected_shards(
    full: torch.Tensor, meta: ShardedTensorMetadata, rank: int
) -> dict[int, torch.Tensor]:
    views = shards_of(full, meta)
    return {i: views[i] for i in meta.shards_on(rank)}


def assert_same_shards(got: dict[int, torch.Tensor], expected: dict[int, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for index, tensor in expected.items():
        assert got[index].dtype == tensor.dtype and torch.equal(got[index], tensor), (
            f"shard {index} differs"
        )


@pytest.fixture(scope="module")
def world3():
    world = World(3)
    yield world
    world.close()


@pytest.fixture(scope="module")
def world2():
    world = World(2)
    yield world
    world.close()


# --- what the ranks run ----------------------------------------------------------------------------


def _load(
    rank: int, path: str, layouts: dict[str, ShardedTensorMetadata]
) -> dict[str, dict[int, torch.Tensor]]:
    return load_tensors(path, layouts, rank, dist.group.WORLD)


def _save(
    rank: int,
    path: str,
    tables: dict[str, tuple[ShardedTensorMetadata, int, torch.dtype]],
    spoil_rank: int | None = None,
) -> None:
    """Every rank saves its own shards (cut from a table it builds from the seed); spoil_rank sends a bad one."""
    request = {}
    for key, (meta, seed, dtype) in tables.items():
        views = shards_of(make_table(seed, meta.size, dtype), meta)
        mine = {i: views[i].clone() for i in meta.shards_on(rank)}
        if rank == spoil_rank:
            first = min(mine)
            mine[first] = mine[first][:-1]
        request[key] = (meta, mine)
    save_tensors(path, request, None)


def _load_expecting_error(
    rank: int, path: str, key: str, meta: ShardedTensorMetadata
) -> tuple[str, str]:
    try:
        load_shards(path, key, meta, rank)
    except CheckpointError as exc:
        return type(exc.reason).__name__, str(exc)
    return "no error", ""


def _load_seeing_path(
    rank: int, paths: dict[int, str], key: str, meta: ShardedTensorMetadata
) -> tuple[str, str]:
    """Like _load_expecting_error, but each rank sees its own path (a filesystem that is not shared)."""
    return _load_expecting_error(rank, paths[rank], key, meta)


def _save_expecting_error(rank: int, path: str, tables, spoil_rank: int) -> tuple[str, str]:
    try:
        _save(rank, path, tables, spoil_rank)
    except CheckpointError as exc:
        return type(exc.reason).__name__, str(exc)
    return "no error", ""


def _save_job_without_the_version_on(rank: int, path: str, missing_rank: int) -> tuple[str, str]:
    """The rank side of a checkpoint_save job, where `missing_rank` does not hold the version to save."""
    import time

    from shardserve.core.wire import metadata_to_proto
    from shardserve.protos import shardserve_pb2 as pb
    from shardserve.server.rank.jobs.checkpoint import run_checkpoint_save
    from shardserve.server.rank.jobs.context import JobContext
    from shardserve.server.rank.store import ShardStore

    store = ShardStore(rank, shared_memory=False)
    if rank != missing_rank:
        shards = expected_shards(make_table(3), UNEVEN_ROWS, rank)
        store.install("emb", 1, UNEVEN_ROWS, {i: t.clone() for i, t in shards.items()})
        store.promote("emb", 1)
    job = pb.CollectiveJob(
        seq=1,
        ranks=[0, 1, 2],
        timeout_s=60,
        checkpoint_save=pb.CheckpointJob(
            path=path,
            tensors=[
                pb.CheckpointTensor(name="emb", version=1, metadata=metadata_to_proto(UNEVEN_ROWS))
            ],
        ),
    )
    try:
        run_checkpoint_save(job, JobContext(store, rank, job, deadline=time.monotonic() + 60))
    except CheckpointError as exc:
        return type(exc.reason).__name__, str(exc)
    return "no error", ""


def _row_chunks_spec(dim: int):
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    return ChunkShardingSpec(
        dim=dim, placements=[f"rank:{r}/cpu" for r in range(dist.get_world_size())]
    )


def _save_sharded_tensor(rank: int, path: str, seed: int) -> None:
    """torch's own way: a ShardedTensor over the world, saved with dcp.save."""
    from torch.distributed._shard import sharded_tensor

    full = make_table(seed)
    st = sharded_tensor.empty(_row_chunks_spec(0), *SIZE)
    for shard in st.local_shards():
        (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        shard.tensor.copy_(full[r0 : r0 + nr, c0 : c0 + nc])
    dcp.save({"emb": st}, storage_writer=dcp.FileSystemWriter(path))


def _load_into_sharded_tensor(
    rank: int, path: str, key: str, dim: int
) -> dict[tuple, torch.Tensor]:
    from torch.distributed._shard import sharded_tensor

    st = sharded_tensor.empty(_row_chunks_spec(dim), *SIZE)
    dcp.load({key: st}, checkpoint_id=path)
    return {tuple(s.metadata.shard_offsets): s.tensor.clone() for s in st.local_shards()}


def _load_into_dtensor(rank: int, path: str, key: str) -> torch.Tensor:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    local = torch.empty(
        torch.chunk(torch.empty(SIZE), dist.get_world_size(), dim=1)[rank].shape,
        dtype=torch.float16,
    )
    dtensor = DTensor.from_local(
        local, mesh, [Shard(1)], run_check=False, shape=torch.Size(SIZE), stride=(SIZE[1], 1)
    )
    dcp.load({key: dtensor}, checkpoint_id=path)
    return dtensor.to_local().clone()


# --- tests -------------------------------------------------------------------------------------------


def test_plain_dcp_checkpoint_loads_into_three_rank_layouts(world3, tmp_path):
    """dcp.save with no process group (one process, plain tensors) -> every rank reads its own shards."""
    full, bias = make_table(1), make_table(2, (51,), torch.bfloat16)
    dcp.save({"emb": full, "bias": bias}, checkpoint_id=str(tmp_path), no_dist=True)
    bias_layout = layout((51,), [(0, 10, 0), (10, 41, 1), (0, 10, 2)], torch.bfloat16)
    for name, meta in THREE_RANK_LAYOUTS.items():
        answers = world3.run(_load, str(tmp_path), {"emb": meta, "bias": bias_layout})
        for rank, loaded in answers.items():
            assert_same_shards(loaded["emb"], expected_shards(full, meta, rank))
            assert_same_shards(loaded["bias"], expected_shards(bias, bias_layout, rank))


def test_sharded_tensor_saved_on_two_ranks_loads_into_three_rank_layouts(world2, world3, tmp_path):
    world2.run(_save_sharded_tensor, str(tmp_path), 3)
    full = make_table(3)
    assert checkpoint_tensors(tmp_path) == {"emb": (SIZE, torch.float32)}
    for meta in (UNEVEN_ROWS, GRID):
        for rank, loaded in world3.run(_load, str(tmp_path), {"emb": meta}).items():
            assert_same_shards(loaded["emb"], expected_shards(full, meta, rank))


def test_save_shards_output_loads_with_plain_dcp_load(world2, world3, tmp_path):
    """save_tensors from 3 ranks (replicas, grid) -> plain tensors, a 2-rank ShardedTensor and a DTensor."""
    path = str(tmp_path)
    world3.run(
        _save,
        path,
        {
            "emb": (REPLICATED, 4, torch.float32),
            "small": (as_dtype(GRID, torch.float16), 5, torch.float16),
        },
    )
    full, small = make_table(4), make_table(5, SIZE, torch.float16)
    assert checkpoint_tensors(path) == {
        "emb": (SIZE, torch.float32),
        "small": (SIZE, torch.float16),
    }

    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata["emb"]
    assert len(stored.chunks) == 3  # five shards, two of them replicas: written once each

    plain = {"emb": torch.empty(SIZE), "small": torch.empty(SIZE, dtype=torch.float16)}
    dcp.load(plain, checkpoint_id=path, no_dist=True)
    assert torch.equal(plain["emb"], full) and torch.equal(plain["small"], small)

    for dim in (0, 1):
        answers = world2.run(_load_into_sharded_tensor, path, "emb", dim)
        for rank, shards in answers.items():
            chunks = torch.chunk(full, 2, dim=dim)
            part, start = chunks[rank], sum(c.shape[dim] for c in chunks[:rank])
            offsets = (start, 0) if dim == 0 else (0, start)
            assert list(shards) == [offsets] and torch.equal(shards[offsets], part)

    for rank, local in world2.run(_load_into_dtensor, path, "small").items():
        assert torch.equal(local, torch.chunk(small, 2, dim=1)[rank])


def test_save_then_load_round_trip_into_another_layout(world3, tmp_path):
    world3.run(
        _save, str(tmp_path), {"emb": (as_dtype(COLUMNS, torch.bfloat16), 6, torch.bfloat16)}
    )
    full = make_table(6, SIZE, torch.bfloat16)
    meta = layout(
        SIZE, [(0, 51, 0, 12, 1), (0, 51, 0, 12, 2)], torch.bfloat16
    )  # replicas on ranks 1, 2
    for rank, loaded in world3.run(_load, str(tmp_path), {"emb": meta}).items():
        assert_same_shards(loaded["emb"], expected_shards(full, meta, rank))


def test_failed_loads_and_saves_raise_on_every_rank_without_hanging(world3, tmp_path):
    path = str(tmp_path)
    dcp.save({"emb": make_table(7)}, checkpoint_id=path, no_dist=True)

    answers = world3.run(_load_expecting_error, path, "missing", UNEVEN_ROWS)
    for kind, message in answers.values():
        assert kind == "KeyError"
        assert (
            "failed on ranks [0, 1, 2]" in message
            and "holds no tensor 'missing' (it holds: emb)" in message
        )

    wrong = layout((51, 13), [(0, 51, 0, 13, 0)])
    for kind, message in world3.run(_load_expecting_error, path, "emb", wrong).values():
        assert (
            kind == "ValueError"
            and "'emb' is (51, 12) in checkpoint" in message
            and "(51, 13)" in message
        )

    for kind, message in world3.run(
        _load_expecting_error, str(tmp_path / "nowhere"), "emb", GRID
    ).values():
        assert kind == "FileNotFoundError" and "failed on ranks [0, 1, 2]" in message
        assert "nowhere is not a DCP checkpoint" in message

    paths = {0: path, 1: str(tmp_path / "not_shared"), 2: path}
    for kind, message in world3.run(_load_seeing_path, paths, "emb", GRID).values():
        assert kind == "FileNotFoundError" and "failed on ranks [1]" in message

    answers = world3.run(
        _save_expecting_error, str(tmp_path / "spoilt"), {"emb": (GRID, 8, torch.float32)}, 1
    )
    for kind, message in answers.values():
        assert (
            kind == "ValueError"
            and "failed on ranks [1]" in message
            and "has shape (19, 5)" in message
        )

    answers = world3.run(_save_job_without_the_version_on, str(tmp_path / "unleased"), 1)
    for (
        kind,
        message,
    ) in answers.values():  # rank 1 failed before DCP's collectives, yet nobody waits for it
        assert kind == "ValueError" and "failed on ranks [1]" in message
        assert (
            "rank failed before the checkpoint's collectives" in message
            and "not found on rank 1" in message
        )

    for rank, loaded in world3.run(_load, path, {"emb": GRID}).items():  # the world still works
        assert_same_shards(loaded["emb"], expected_shards(make_table(7), GRID, rank))


def test_single_process_round_trip_and_argument_errors(tmp_path):
    meta = layout(SIZE, [(0, 20, 0, 12, 0), (20, 31, 0, 12, 0)])
    full = make_table(9)
    save_shards(tmp_path, "emb", meta, dict(enumerate(shards_of(full, meta))))
    assert_same_shards(load_shards(tmp_path, "emb", GRID, 0), expected_shards(full, GRID, 0))
    with pytest.raises(FileNotFoundError, match="is not a DCP checkpoint"):
        checkpoint_tensors(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="rank must be a non-negative int"):
        load_shards(tmp_path, "emb", GRID, -1)
    with pytest.raises(TypeError, match="layout of 'emb' must be a ShardedTensorMetadata"):
        load_shards(tmp_path, "emb", "rows", 0)
    with pytest.raises(ValueError, match="overlap|gap|cover"):
        save_shards(tmp_path / "gap", "emb", layout(SIZE, [(0, 20, 0, 12, 0)]), {})
    with pytest.raises(
        CheckpointError, match="has dtype torch.float64 but the layout's dtype is torch.float32"
    ):
        save_shards(tmp_path / "dtype", "emb", meta, {0: torch.zeros(20, 12, dtype=torch.float64)})
    with pytest.raises(CheckpointError, match=r"local_shards\[7\] of 'emb': index is not a shard"):
        save_shards(tmp_path / "index", "emb", meta, {7: torch.zeros(1)})


def test_single_process_replicas_on_one_rank_subset_of_keys_and_nested_checkpoints(tmp_path):
    """A layout holding one box twice on a rank fills both; a nested state dict's keys are its DCP FQNs."""
    full, other = make_table(10), make_table(11, (4, 3))
    dcp.save(
        {"model": {"emb.weight": full, "other": other}}, checkpoint_id=str(tmp_path), no_dist=True
    )
    assert checkpoint_tensors(tmp_path) == {
        "model.emb.weight": (SIZE, torch.float32),
        "model.other": ((4, 3), torch.float32),
    }
    twice = layout(SIZE, [(0, 51, 0, 6, 0), (0, 51, 0, 6, 0), (0, 51, 6, 6, 0)])
    loaded = load_shards(tmp_path, "model.emb.weight", twice, 0)
    assert_same_shards(loaded, expected_shards(full, twice, 0))
    assert loaded[0].data_ptr() != loaded[1].data_ptr()


def test_load_writes_into_given_buffers_in_one_process(tmp_path):
    """`into` (a rank's recycled buffers) is filled in place; shards without a fitting buffer are allocated."""
    full = torch.randn(12, 5, generator=torch.Generator().manual_seed(3))
    dcp.save({"emb": full}, checkpoint_id=str(tmp_path), no_dist=True)
    meta = ChunkShardingSpec(0, ["rank:0/cpu", "rank:0/cpu"]).build_metadata(
        (12, 5), TensorProperties()
    )
    given = torch.full((6, 5), float("nan"))
    shards = load_tensors(
        tmp_path, {"emb": meta}, 0, into={"emb": {0: given, 1: torch.empty(5, 6)}}
    )["emb"]
    assert shards[0] is given and torch.equal(given, full[:6])
    assert shards[1].shape == (6, 5) and torch.equal(shards[1], full[6:])
