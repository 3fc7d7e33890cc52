"""Round trips between shardcore and torch: ShardedTensor metadata, specs, DCP, DTensor."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed._shard.metadata import ShardMetadata as TorchShardMetadata
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata as TorchMeta
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as TorchProperties
from torch.distributed._shard.sharding_spec import ChunkShardingSpec as TorchChunkSpec
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec as TorchEnumerableSpec
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import _check_box_bounds, _validate_global_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

from shardserve.core import (
    Box,
    ChunkShardingSpec,
    EnumerableShardingSpec,
    Replicate,
    Shard,
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
    as_spec,
    boxes_from_dcp_storage_metadata,
    dtensor_layout,
    from_dcp_storage_metadata,
    make_metadata,
    metadata_from_dtensor,
    metadata_from_placements,
    metadata_from_torch,
    metadata_to_torch,
    placements_from_torch,
    placements_to_torch,
    properties_from_torch,
    properties_to_torch,
    spec_from_torch,
    spec_to_torch,
    to_dcp_storage_metadata,
    validate_metadata,
)

PROPS = TensorProperties(dtype=torch.float64, requires_grad=True, pin_memory=True)


def _dcp_accepts(storage) -> bool:
    result = _validate_global_plan([], Metadata(state_dict_metadata={"t": storage}))
    return result is True or result == []


def test_metadata_round_trips_through_torch():
    meta = ChunkShardingSpec(-1, ["rank:0/cpu", "rank:1/cuda:1", "rank:0/cpu"]).build_metadata(
        (4, 7), PROPS
    )
    theirs = metadata_to_torch(meta)
    assert isinstance(theirs, TorchMeta) and theirs.size == torch.Size([4, 7])
    assert isinstance(theirs.shards_metadata[0], TorchShardMetadata)
    assert theirs.shards_metadata[1].placement.rank() == 1
    assert theirs.shards_metadata[1].placement.device() == torch.device("cuda:1")
    assert theirs.tensor_properties == TorchProperties(
        dtype=torch.float64, requires_grad=True, pin_memory=True
    )
    assert metadata_from_torch(theirs) == meta


@pytest.mark.parametrize(
    "size, dim, k", [((10, 3), 0, 4), ((3, 11), -1, 3), ((0, 2), 0, 2), ((2, 3, 8), 1, 3)]
)
def test_torch_built_metadata_converts_to_ours(size, dim, k):
    placements = [f"rank:{i % 2}/cpu" for i in range(k)]
    theirs = TorchChunkSpec(dim, list(placements)).build_metadata(
        torch.Size(size), properties_to_torch(PROPS)
    )
    assert metadata_from_torch(theirs) == ChunkShardingSpec(dim, placements).build_metadata(
        size, PROPS
    )


def test_properties_round_trip_and_bad_type():
    assert properties_from_torch(properties_to_torch(PROPS)) == PROPS
    with pytest.raises(TypeError, match="tensor_properties must be a TensorProperties"):
        properties_from_torch(object())
    with pytest.raises(TypeError, match="expected a torch ShardedTensorMetadata"):
        metadata_from_torch(object())
    with pytest.raises(TypeError, match="meta must be a shardcore ShardedTensorMetadata"):
        metadata_to_torch(object())


def test_specs_round_trip_through_torch():
    chunk = ChunkShardingSpec(-2, ["rank:0/cpu", "rank:1/cpu", "rank:0/cpu"])
    theirs = spec_to_torch(chunk)
    assert isinstance(theirs, TorchChunkSpec) and theirs.dim == -2
    assert spec_from_torch(theirs) == chunk
    enumerable = EnumerableShardingSpec(
        [ShardMetadata((0, 0), (2, 2), 0), ShardMetadata((0, 2), (2, 1), 1)]
    )
    theirs = spec_to_torch(enumerable)
    assert isinstance(theirs, TorchEnumerableSpec)
    assert spec_from_torch(theirs) == enumerable
    size = (2, 3)
    assert metadata_from_torch(
        theirs.build_metadata(torch.Size(size), properties_to_torch(PROPS))
    ) == enumerable.build_metadata(size, PROPS)


def test_as_spec_takes_ours_or_torchs():
    ours = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"])
    assert as_spec(ours) is ours
    assert as_spec(TorchChunkSpec(0, ["rank:0/cpu", "rank:1/cpu"])) == ours
    with pytest.raises(
        TypeError, match="spec must be torch's ChunkShardingSpec or EnumerableShardingSpec"
    ):
        as_spec("rows")
    with pytest.raises(TypeError, match="spec must be a shardcore ChunkShardingSpec"):
        spec_to_torch(TorchChunkSpec(0, ["rank:0/cpu"]))


def test_replicated_enumerable_spec_is_refused_by_torch():
    spec = EnumerableShardingSpec([ShardMetadata((0,), (2,), 0), ShardMetadata((0,), (2,), 1)])
    with pytest.raises(ValueError, match="torch's EnumerableShardingSpec refuses these shards"):
        spec_to_torch(spec)


def test_dcp_storage_metadata_matches_what_dcp_saves(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"t": torch.arange(12.0).reshape(3, 4)}, checkpoint_id=str(tmp_path), no_dist=True)
    stored = FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata["t"]
    assert to_dcp_storage_metadata(make_metadata((3, 4), [((0, 0), (3, 4), 0)])) == stored
    meta = from_dcp_storage_metadata(stored, lambda index, box: "rank:0/cpu")
    assert meta == make_metadata((3, 4), [((0, 0), (3, 4), "rank:0/cpu")])


def test_dcp_storage_holds_replicas_once_and_drops_empty_shards():
    meta = metadata_from_placements((5, 4), [[0, 1], [2, 3], [4, 5]], [Shard(0), Replicate()])
    storage = to_dcp_storage_metadata(meta)
    assert [tuple(c.offsets) for c in storage.chunks] == [(0, 0), (2, 0), (4, 0)]
    assert _dcp_accepts(storage)
    clamped = ChunkShardingSpec(0, ["rank:0/cpu"] * 4).build_metadata((5,))
    assert len(to_dcp_storage_metadata(clamped).chunks) == 3


def test_clamped_chunk_offsets_pass_dcp_bounds_where_torchs_fail():
    size = torch.Size([5])
    theirs = TorchChunkSpec(0, ["rank:0/cpu"] * 4).build_metadata(size, TorchProperties())
    ours = ChunkShardingSpec(0, ["rank:0/cpu"] * 4).build_metadata((5,))

    def chunk(s):
        return ChunkStorageMetadata(
            offsets=torch.Size(s.shard_offsets), sizes=torch.Size(s.shard_sizes)
        )

    assert not _check_box_bounds(size, chunk(theirs.shards_metadata[3]))
    assert all(_check_box_bounds(size, chunk(s)) for s in ours.shards_metadata)


def test_dcp_round_trip_with_placement_list():
    meta = ChunkShardingSpec(1, ["rank:2/cpu", "rank:0/cpu", "rank:1/cpu"]).build_metadata(
        (2, 9), PROPS
    )
    storage = to_dcp_storage_metadata(meta)
    assert boxes_from_dcp_storage_metadata(storage) == [s.box for s in meta.shards_metadata]
    assert from_dcp_storage_metadata(storage, [s.placement for s in meta.shards_metadata]) == meta


@pytest.mark.parametrize(
    "placement, error, message",
    [
        (["rank:0/cpu"], ValueError, r"placement has 1 entries but the storage has 2 chunks"),
        ("rank:0/cpu", TypeError, r"placement must be a sequence \(one per chunk\) or a callable"),
        (["rank:0/cpu", "nowhere"], ValueError, r"placement 'nowhere' is not of the form"),
    ],
)
def test_dcp_from_bad_placement(placement, error, message):
    storage = to_dcp_storage_metadata(make_metadata((4,), [((0,), (2,), 0), ((2,), (2,), 1)]))
    with pytest.raises(error, match=message):
        from_dcp_storage_metadata(storage, placement)


def test_dcp_from_wrong_type():
    with pytest.raises(TypeError, match="expected a DCP TensorStorageMetadata"):
        boxes_from_dcp_storage_metadata(object())
    with pytest.raises(TypeError, match="meta must be a shardcore ShardedTensorMetadata"):
        to_dcp_storage_metadata(object())


@pytest.fixture(scope="module")
def mesh_2x2():
    return DeviceMesh("cpu", [[0, 1], [2, 3]], _init_backend=False, _rank=0)


def test_metadata_from_dtensor(mesh_2x2):
    local = torch.zeros(3, 3, dtype=torch.float64)
    dtensor = DTensor.from_local(
        local,
        mesh_2x2,
        [TorchShard(0), TorchReplicate()],
        run_check=False,
        shape=torch.Size([5, 3]),
        stride=(3, 1),
    )
    meta = metadata_from_dtensor(dtensor)
    assert meta == metadata_from_placements(
        (5, 3), [[0, 1], [2, 3]], [Shard(0), Replicate()], dtype=torch.float64
    )
    assert meta.shards_metadata[0].shard_sizes == tuple(local.shape)


def test_metadata_from_dtensor_spec(mesh_2x2):
    placements = (TorchShard(1), TorchShard(0))
    with_meta = DTensorSpec(
        mesh_2x2, placements, tensor_meta=TensorMeta(torch.Size([4, 6]), (6, 1), torch.int32)
    )
    expected = metadata_from_placements(
        (4, 6), [[0, 1], [2, 3]], [Shard(1), Shard(0)], dtype=torch.int32
    )
    assert metadata_from_dtensor(with_meta) == expected
    bare = DTensorSpec(mesh_2x2, placements)
    with pytest.raises(ValueError, match="size is required"):
        metadata_from_dtensor(bare)
    assert metadata_from_dtensor(bare, (4, 6)).shards_metadata == expected.shards_metadata
    with pytest.raises(TypeError, match="expected a DTensor or DTensorSpec"):
        metadata_from_dtensor(torch.zeros(2))


def test_dtensor_placements_convert_both_ways():
    ours = (Shard(1), Replicate(), Shard(-1))
    theirs = placements_to_torch(ours)
    assert theirs == (TorchShard(1), TorchReplicate(), TorchShard(-1))
    assert placements_from_torch(theirs) == ours
    with pytest.raises(TypeError, match=r"placements\[1\] is a Partial"):
        placements_from_torch([TorchShard(0), Partial()])
    with pytest.raises(TypeError, match=r"placements\[0\] is a _StridedShard"):
        placements_from_torch([_StridedShard(0, split_factor=2)])


MESHES = [(1,), (2,), (3,), (4,), (2, 2), (2, 3), (3, 2), (1, 4)]


@settings(max_examples=50, deadline=None)
@given(size=st.lists(st.integers(0, 9), min_size=1, max_size=3), data=st.data())
def test_dtensor_layout_reproduces_placement_layouts(size, data):
    mesh_shape = data.draw(st.sampled_from(MESHES))
    options = [Replicate()] + [Shard(d) for d in range(len(size))]
    placements = data.draw(
        st.lists(st.sampled_from(options), min_size=len(mesh_shape), max_size=len(mesh_shape))
    )
    count = 1
    for n in mesh_shape:
        count *= n
    mesh = torch.tensor(data.draw(st.permutations(range(count)))).reshape(mesh_shape).tolist()
    meta = metadata_from_placements(size, mesh, placements)
    found_mesh, found_placements = dtensor_layout(meta)
    assert metadata_from_placements(size, found_mesh, found_placements) == meta


def test_dtensor_layout_of_a_chunk_spec():
    meta = ChunkShardingSpec(1, ["rank:3/cpu", "rank:1/cpu", "rank:2/cpu"]).build_metadata((4, 7))
    assert dtensor_layout(meta) == ([3, 1, 2], (Shard(1),))


@pytest.mark.parametrize(
    "meta, message",
    [
        (
            ChunkShardingSpec(0, ["rank:0/cpu", "rank:0/cpu"]).build_metadata((4,)),
            "one shard per distinct rank",
        ),
        (
            make_metadata((4,), [((0,), (4,), "rank:0/cpu"), ((0,), (4,), "rank:1/cuda:0")]),
            "several device types",
        ),
        (
            metadata_from_placements((8,), [0, 1], [Shard(0)], sharding_shapes={0: [5, 3]}),
            "no Shard/Replicate combination reproduces these 2 shards",
        ),
        (ShardedTensorMetadata((), (3,)), "one shard per distinct rank"),
    ],
)
def test_dtensor_layout_not_expressible(meta, message):
    with pytest.raises(ValueError, match=message):
        dtensor_layout(meta)


def test_interop_output_validates():
    meta = metadata_from_torch(
        TorchEnumerableSpec(
            [TorchShardMetadata([0], [2], "rank:0/cpu"), TorchShardMetadata([2], [2], "rank:1/cpu")]
        ).build_metadata(torch.Size([4]), TorchProperties())
    )
    assert validate_metadata(meta).distinct_boxes == 2
    assert meta.shards_metadata[1].box == Box((2,), (2,))


def test_metadata_from_dtensor_on_a_cuda_mesh_names_local_devices():
    from types import SimpleNamespace

    mesh = SimpleNamespace(device_type="cuda", mesh=torch.tensor([[0, 1], [2, 3]]))
    spec = SimpleNamespace(
        mesh=mesh,
        placements=(TorchShard(0), TorchShard(1)),
        tensor_meta=TensorMeta(torch.Size([4, 4]), (4, 1), torch.float16),
    )
    meta = metadata_from_dtensor(spec, devices_per_host=2)
    assert [str(s.placement) for s in meta.shards_metadata] == [
        "rank:0/cuda:0",
        "rank:1/cuda:1",
        "rank:2/cuda:0",
        "rank:3/cuda:1",
    ]
    assert meta.dtype == torch.float16
