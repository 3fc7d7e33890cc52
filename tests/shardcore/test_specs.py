"""ChunkShardingSpec / EnumerableShardingSpec / DTensor placements against torch's own implementations."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import shards_of
from torch.distributed._shard.metadata import ShardMetadata as TorchShardMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as TorchProperties
from torch.distributed._shard.sharding_spec import ChunkShardingSpec as TorchChunkSpec
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from shardserve.core import (
    ChunkShardingSpec,
    EnumerableShardingSpec,
    LayoutError,
    RemoteDevice,
    Replicate,
    Shard,
    ShardMetadata,
    TensorProperties,
    assemble,
    cut_tensor,
    metadata_from_placements,
    validate_metadata,
)


def _triples(meta):
    return [
        (tuple(s.shard_offsets), tuple(s.shard_sizes), str(s.placement))
        for s in meta.shards_metadata
    ]


def _placement_forms(k):
    """k placements over 3 ranks (so ranks repeat), alternately as str, ours, torch's _remote_device."""
    forms = (str, RemoteDevice, torch.distributed._remote_device)
    return [forms[i % 3](f"rank:{i % 3}/cpu") for i in range(k)]


def test_chunk_spec_equals_torch_over_grid():
    """Sizes 0..40 on 1-4-D tensors, 1-8 placements, every dim (negative too), repeated ranks."""
    compared = clamped = 0
    for ndim in range(1, 5):
        for k in range(1, 9):
            placements = _placement_forms(k)
            torch_placements = [str(p) if isinstance(p, RemoteDevice) else p for p in placements]
            for dim in range(-ndim, ndim):
                for n in range(41):
                    size = [2] * ndim
                    size[dim] = n
                    theirs = TorchChunkSpec(dim, list(torch_placements)).build_metadata(
                        torch.Size(size), TorchProperties()
                    )
                    ours = ChunkShardingSpec(dim, placements).build_metadata(size)
                    validate_metadata(ours)
                    torch_valid = all(s.shard_offsets[dim] <= n for s in theirs.shards_metadata)
                    if torch_valid:
                        assert _triples(ours) == _triples(theirs), (size, dim, k)
                        compared += 1
                    else:
                        clamped += 1
                        assert [t[1] for t in _triples(ours)] == [t[1] for t in _triples(theirs)]
    assert compared > 5000 and clamped > 500


def test_chunk_spec_clamps_where_torch_overruns():
    theirs = TorchChunkSpec(0, ["rank:0/cpu"] * 4).build_metadata(
        torch.Size([5]), TorchProperties()
    )
    ours = ChunkShardingSpec(0, ["rank:0/cpu"] * 4).build_metadata((5,))
    assert [list(s.shard_offsets) for s in theirs.shards_metadata] == [[0], [2], [4], [6]]
    assert [s.shard_offsets for s in ours.shards_metadata] == [(0,), (2,), (4,), (5,)]
    assert [s.shard_sizes for s in ours.shards_metadata] == [(2,), (2,), (1,), (0,)]
    assert validate_metadata(ours).empty_shards == (3,)


@pytest.mark.parametrize("n", [0, 1, 5, 7, 12])
@pytest.mark.parametrize("k", [1, 3, 4, 8])
def test_chunk_spec_cuts_like_torch_chunk(n, k):
    tensor = torch.arange(n * 3, dtype=torch.float64).reshape(3, n)
    meta = ChunkShardingSpec(-1, [f"rank:{i}/cpu" for i in range(k)]).build_metadata(
        tensor.shape, TensorProperties(torch.float64)
    )
    pieces = cut_tensor(tensor, meta)
    expected = torch.chunk(tensor, k, dim=1)
    for piece, ref in itertools.zip_longest(pieces, expected):
        if ref is None:
            assert piece.numel() == 0
        else:
            assert torch.equal(piece, ref)
    assert torch.equal(assemble(meta, pieces), tensor)


def test_chunk_spec_is_a_hashable_value():
    a = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cuda:1"])
    b = ChunkShardingSpec(0, (RemoteDevice("rank:0/cpu"), "rank:1/cuda:1"))
    assert a == b and hash(a) == hash(b)
    assert a.placements[1].device() == torch.device("cuda:1")
    assert ChunkShardingSpec(0, [0, 1]).placements == (
        RemoteDevice("rank:0/cpu"),
        RemoteDevice("rank:1/cpu"),
    )
    with pytest.raises(AttributeError):
        a.dim = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: ChunkShardingSpec("0", ["rank:0/cpu"]), TypeError, r"dim must be an int"),
        (lambda: ChunkShardingSpec(True, ["rank:0/cpu"]), TypeError, r"dim must be an int"),
        (lambda: ChunkShardingSpec(0, []), ValueError, r"placements must not be empty"),
        (lambda: ChunkShardingSpec(0, "rank:0/cpu"), TypeError, r"placements must be a sequence"),
        (
            lambda: ChunkShardingSpec(0, ["rank:0/cpu", "gpu0"]),
            ValueError,
            r"placements\[1\]: placement 'gpu0'",
        ),
        (
            lambda: ChunkShardingSpec(0, ["rank:0/cpu", None]),
            ValueError,
            r"placements\[1\] is None",
        ),
        (
            lambda: ChunkShardingSpec(2, ["rank:0/cpu"]).build_metadata((4, 4)),
            ValueError,
            r"dim 2 is out of range",
        ),
        (
            lambda: ChunkShardingSpec(-3, ["rank:0/cpu"]).build_metadata((4, 4)),
            ValueError,
            r"dim -3 is out of range",
        ),
        (
            lambda: ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata((4, -1)),
            ValueError,
            r"size\[1\]=-1 is negative",
        ),
        (
            lambda: ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata((4.5,)),
            TypeError,
            r"size must hold integers",
        ),
        (
            lambda: ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata((4,), TorchProperties()),
            TypeError,
            r"tensor_properties must be a shardcore TensorProperties",
        ),
    ],
)
def test_chunk_spec_bad_input(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_enumerable_spec_builds_validated_metadata():
    shards = [
        ShardMetadata((0, 0), (2, 4), 0),
        ShardMetadata((2, 0), (2, 4), 1),
        ShardMetadata((2, 0), (2, 4), 2),
    ]
    spec = EnumerableShardingSpec(shards)
    meta = spec.build_metadata((4, 4), TensorProperties(torch.int64))
    assert meta.shards_metadata == tuple(shards) and meta.dtype == torch.int64
    assert validate_metadata(meta).replica_groups == ((1, 2),)
    assert hash(spec) == hash(EnumerableShardingSpec(tuple(shards)))


def test_enumerable_spec_accepts_torch_shard_metadata():
    spec = EnumerableShardingSpec(
        [TorchShardMetadata([0], [3], "rank:0/cpu"), TorchShardMetadata([3], [1], "rank:1/cpu")]
    )
    assert spec.shards == (
        ShardMetadata((0,), (3,), "rank:0/cpu"),
        ShardMetadata((3,), (1,), "rank:1/cpu"),
    )


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: EnumerableShardingSpec([]), ValueError, r"shards must not be empty"),
        (
            lambda: EnumerableShardingSpec([object()]),
            TypeError,
            r"shards\[0\] is a object, not a ShardMetadata",
        ),
        (
            lambda: EnumerableShardingSpec(
                [ShardMetadata((0,), (2,), 0), ShardMetadata((0, 0), (1, 1), 1)]
            ),
            LayoutError,
            r"dim count mismatch in shards \[1\]",
        ),
        (
            lambda: EnumerableShardingSpec(
                [ShardMetadata((0,), (3,), 0), ShardMetadata((2,), (2,), 1)]
            ),
            LayoutError,
            r"overlap in shards \[0, 1\]",
        ),
        (
            lambda: EnumerableShardingSpec(
                [ShardMetadata((0,), (3,), 0), ShardMetadata((-1,), (1,), 1)]
            ),
            LayoutError,
            r"shard_offsets\[0\]=-1 is negative",
        ),
        (
            lambda: EnumerableShardingSpec([ShardMetadata((0,), (3,), 0)]).build_metadata((4,)),
            LayoutError,
            r"gap: .* offsets \(3,\), sizes \(1,\)",
        ),
        (
            lambda: EnumerableShardingSpec([ShardMetadata((0,), (3,), 0)]).build_metadata((2,)),
            LayoutError,
            r"out of bounds in shards \[0\]",
        ),
    ],
)
def test_enumerable_spec_bad_input(make, error, message):
    with pytest.raises(error, match=message):
        make()


def _check_cut_and_assemble(tensor: torch.Tensor, meta) -> None:  # type: ignore[no-untyped-def]
    """cut_tensor gives each shard's slice of the tensor, and assemble puts plain slices back into it."""
    for got, want in zip(cut_tensor(tensor, meta), shards_of(tensor, meta), strict=True):
        assert torch.equal(got, want)
    assert torch.equal(assemble(meta, [p.clone() for p in shards_of(tensor, meta)]), tensor)


@settings(max_examples=100, deadline=None)
@given(size=st.lists(st.integers(0, 12), min_size=1, max_size=4), data=st.data())
def test_chunk_spec_layouts_cover_the_tensor(size, data):
    dim = data.draw(st.integers(-len(size), len(size) - 1))
    ranks = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=8))
    meta = ChunkShardingSpec(dim, ranks).build_metadata(size, TensorProperties(torch.int32))
    validate_metadata(meta)
    tensor = torch.randint(-99, 99, tuple(size), dtype=torch.int32)
    _check_cut_and_assemble(tensor, meta)


def _torch_placement(p, ndim):
    return TorchShard(p.dim % ndim) if isinstance(p, Shard) else TorchReplicate()


MESHES = [(1,), (2,), (3,), (5,), (2, 2), (2, 3), (3, 2), (1, 4)]


def test_dtensor_rule_equals_compute_local_shape_and_global_offset():
    """1-D and 2-D meshes, every placement combination, uneven and empty chunks."""
    checked = 0
    for mesh_shape in MESHES:
        count = 1
        for n in mesh_shape:
            count *= n
        ranks = torch.arange(count).reshape(mesh_shape).tolist()
        meshes = [DeviceMesh("cpu", ranks, _init_backend=False, _rank=r) for r in range(count)]
        for ndim in (1, 2, 3):
            options = [Replicate()] + [Shard(d) for d in range(-ndim, ndim)]
            for placements in itertools.product(options, repeat=len(mesh_shape)):
                theirs = [_torch_placement(p, ndim) for p in placements]
                for n in (0, 1, 2, 5, 7):
                    size = (n, 3, 4)[:ndim] if ndim > 1 else (n,)
                    meta = metadata_from_placements(size, ranks, placements)
                    validate_metadata(meta)
                    for shard, mesh in zip(meta.shards_metadata, meshes):
                        local, offset = compute_local_shape_and_global_offset(size, mesh, theirs)
                        assert (shard.shard_sizes, shard.shard_offsets) == (
                            tuple(local),
                            tuple(offset),
                        )
                        checked += 1
    assert checked > 5000


def test_replicate_gives_one_identical_box_per_rank():
    meta = metadata_from_placements((6, 2), [[3, 1], [0, 2]], [Replicate(), Shard(0)])
    assert [s.rank for s in meta.shards_metadata] == [3, 1, 0, 2]
    assert validate_metadata(meta).replica_groups == ((0, 2), (1, 3))
    assert meta.shards_metadata[0].shard_sizes == (3, 2)


def test_cuda_placements_use_local_index():
    meta = metadata_from_placements(
        (8,), [0, 1, 2, 3], [Shard(0)], device="cuda", devices_per_host=2
    )
    assert [str(s.placement) for s in meta.shards_metadata] == [
        "rank:0/cuda:0",
        "rank:1/cuda:1",
        "rank:2/cuda:0",
        "rank:3/cuda:1",
    ]
    assert (
        str(
            metadata_from_placements((8,), [5], [Shard(0)], device="cuda")
            .shards_metadata[0]
            .placement
        )
        == "rank:5/cuda:0"
    )


def test_torch_placements_and_tensor_mesh_are_accepted():
    ours = metadata_from_placements(
        (5, 4), [[0, 1], [2, 3]], [Shard(1), Shard(0)], dtype=torch.bfloat16
    )
    theirs = metadata_from_placements(
        (5, 4), torch.tensor([[0, 1], [2, 3]]), [TorchShard(1), TorchShard(0)], dtype=torch.bfloat16
    )
    assert ours == theirs and ours.dtype == torch.bfloat16


def test_sharding_shapes_give_uneven_sizes():
    meta = metadata_from_placements(
        (8, 4), [[0, 1], [2, 3]], [Shard(0), Shard(1)], sharding_shapes={0: [5, 3], 1: [1, 3]}
    )
    assert [(s.shard_offsets, s.shard_sizes) for s in meta.shards_metadata] == [
        ((0, 0), (5, 1)),
        ((0, 1), (5, 3)),
        ((5, 0), (3, 1)),
        ((5, 1), (3, 3)),
    ]
    validate_metadata(meta)
    tensor = torch.randn(8, 4)
    assert torch.equal(cut_tensor(tensor, meta)[1], tensor[0:5, 1:4])


def test_sharding_shapes_take_physicsnemo_full_shapes():
    full = metadata_from_placements(
        (6, 4), [0, 1, 2], [Shard(0)], sharding_shapes={0: [(1, 4), (0, 4), (5, 4)]}
    )
    bare = metadata_from_placements((6, 4), [0, 1, 2], [Shard(0)], sharding_shapes={0: [1, 0, 5]})
    import numpy as np

    numeric = metadata_from_placements(
        (6, 4), [0, 1, 2], [Shard(0)], sharding_shapes={0: [np.int64(1), torch.tensor(0), 5]}
    )  # like `size`
    assert numeric == bare
    with pytest.raises(ValueError, match="must be a non-negative int"):
        metadata_from_placements((6, 4), [0, 1, 2], [Shard(0)], sharding_shapes={0: [1, True, 5]})
    assert full == bare
    assert [s.shard_offsets for s in full.shards_metadata] == [(0, 0), (6, 0), (1, 0)]
    validate_metadata(full)


def test_sharding_shapes_on_nested_same_dim():
    meta = metadata_from_placements(
        (10,), [[0, 1], [2, 3]], [Shard(0), Shard(0)], sharding_shapes={1: [4, 1]}
    )
    assert [(s.shard_offsets, s.shard_sizes) for s in meta.shards_metadata] == [
        ((0,), (4,)),
        ((4,), (1,)),
        ((5,), (4,)),
        ((9,), (1,)),
    ]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(mesh=[]), ValueError, r"mesh must be a non-empty list"),
        (dict(mesh=[[0, 1], [2]]), ValueError, r"mesh is not rectangular"),
        (dict(mesh=[[0, 1], [1, 2]]), ValueError, r"mesh lists ranks \[1\] more than once"),
        (dict(mesh=[[0, -1], [2, 3]]), ValueError, r"ranks must be non-negative integers"),
        (
            dict(placements=[Shard(0)]),
            ValueError,
            r"placements has 1 entries but the mesh has 2 dims",
        ),
        (
            dict(placements=[Shard(2), Replicate()]),
            ValueError,
            r"placements\[0\] = Shard\(2\) is out of range",
        ),
        (dict(placements=[Replicate(), Partial()]), TypeError, r"placements\[1\] is a Partial"),
        (dict(size=(8, -4)), ValueError, r"size\[1\]=-4 is negative"),
        (dict(device="tpu"), ValueError, r"device must be 'cpu' or 'cuda'"),
        (dict(devices_per_host=0), ValueError, r"devices_per_host must be a positive int"),
        (dict(sharding_shapes=[5, 3]), TypeError, r"sharding_shapes must be a dict"),
        (
            dict(sharding_shapes={2: [4, 4]}),
            ValueError,
            r"sharding_shapes\[2\]: key must be a mesh dim",
        ),
        (
            dict(sharding_shapes={1: [4, 4]}),
            ValueError,
            r"sharding_shapes\[1\]: mesh dim 1 is Replicate",
        ),
        (
            dict(sharding_shapes={0: [8]}),
            ValueError,
            r"sharding_shapes\[0\] has 1 entries but mesh dim 0 has 2",
        ),
        (
            dict(sharding_shapes={0: [5, 2]}),
            ValueError,
            r"sharding_shapes\[0\] adds up to 7 but tensor dim 0 has 8",
        ),
        (
            dict(sharding_shapes={0: [9, -1]}),
            ValueError,
            r"sharding_shapes\[0\]\[1\] must be a non-negative int",
        ),
        (
            dict(sharding_shapes={0: [(4,), (4,)]}),
            ValueError,
            r"sharding_shapes\[0\]\[0\] is a shape of 1 dims",
        ),
        (
            dict(sharding_shapes={0: [(4, 4), (4, 3)]}),
            ValueError,
            r"sharding_shapes\[0\]\[1\]\[1\]=3 but dim 1 is not sharded and has size 4",
        ),
    ],
)
def test_placements_bad_input(kwargs, error, message):
    args = dict(size=(8, 4), mesh=[[0, 1], [2, 3]], placements=[Shard(0), Replicate()])
    args.update(kwargs)
    with pytest.raises(error, match=message):
        metadata_from_placements(**args)


@settings(max_examples=100, deadline=None)
@given(size=st.lists(st.integers(0, 9), min_size=1, max_size=3), data=st.data())
def test_random_placements_validate_and_round_trip_data(size, data):
    mesh_shape = data.draw(st.sampled_from(MESHES))
    options = [Replicate()] + [Shard(d) for d in range(-len(size), len(size))]
    placements = data.draw(
        st.lists(st.sampled_from(options), min_size=len(mesh_shape), max_size=len(mesh_shape))
    )
    count = 1
    for n in mesh_shape:
        count *= n
    ranks = data.draw(st.permutations(range(count)))
    mesh = torch.tensor(ranks).reshape(mesh_shape).tolist()
    meta = metadata_from_placements(size, mesh, placements, dtype=torch.float64)
    validate_metadata(meta)
    tensor = torch.randn(tuple(size), dtype=torch.float64)
    _check_cut_and_assemble(tensor, meta)


def test_box_holds_plain_int_tuples_and_refuses_non_integers():
    import numpy as np

    from shardserve.core.metadata import Box

    box = Box([np.int64(2), torch.tensor(3)], (4, 5))
    assert box.offsets == (2, 3) and all(type(v) is int for v in box.offsets + box.sizes)
    assert Box((1, 2), (3, 4)) == Box([1, 2], [3, 4])
    for bad in [(True, 0), (0, 1.5), ("1", 0)]:
        with pytest.raises(TypeError, match="offsets must hold integers"):
            Box(bad, (1, 1))
    shard = ShardMetadata((2, 0), (2, 4), 0)
    assert shard.box is shard.box and shard.box == Box((2, 0), (2, 4))
    assert "rank:0/cpu" in {RemoteDevice("rank:0/cpu")} and RemoteDevice("rank:1/cuda:0") in {
        "rank:1/cuda:0"
    }


@pytest.mark.parametrize("placement", ["rank:\u0660/cpu", "rank:1/cuda:\u0661", "rank:\uff11/cpu"])
def test_placements_take_ascii_digits_only(placement):
    """int() reads Arabic-Indic or fullwidth digits as numbers; a placement naming rank 0 that way is refused."""
    with pytest.raises(ValueError, match="is not of the form"):
        RemoteDevice(placement)
