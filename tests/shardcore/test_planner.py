"""plan_reshard and the in-memory executor: property tests over random layouts, plus edge cases."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict, deque

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import shards_of

from shardserve.core import (
    ChunkShardingSpec,
    Replicate,
    Shard,
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
    apply_plan,
    copy_box,
    make_metadata,
    metadata_from_placements,
    pack_bucket,
    plan_reshard,
    plan_reshard_per_round,
    split_box,
    unpack_bucket,
)
from shardserve.core.metadata import Box

DTYPES = (torch.float32, torch.int64, torch.float16, torch.bool, torch.complex64, torch.uint8)


def reference_tensor(size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Distinct-ish values per element, so a misplaced element shows."""
    values = torch.arange(math.prod(size), dtype=torch.int64).reshape(size)
    if dtype == torch.bool:
        return values % 3 == 1
    if dtype == torch.uint8:
        return (values % 251).to(dtype)
    return values.to(dtype)


# ---------------------------------------------------------------- layout generator


@st.composite
def grid_boxes(draw, size: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Random cuts per dim (repeated cuts give empty shards), boxes = product of the intervals."""
    per_dim = []
    for n in size:
        cuts = sorted(draw(st.lists(st.integers(0, n), max_size=3)))
        bounds = [0, *cuts, n]
        per_dim.append([(lo, hi - lo) for lo, hi in zip(bounds, bounds[1:])])
    return [
        (tuple(o for o, _ in combo), tuple(s for _, s in combo))
        for combo in itertools.product(*per_dim)
    ]


@st.composite
def guillotine_boxes(draw, size: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Recursive random splits of random boxes: arbitrary (non-grid) enumerable layouts."""
    boxes = [(tuple(0 for _ in size), tuple(size))]
    if not size:
        return boxes
    for _ in range(draw(st.integers(0, 7))):
        i = draw(st.integers(0, len(boxes) - 1))
        d = draw(st.integers(0, len(size) - 1))
        offsets, sizes = boxes[i]
        cut = draw(st.integers(0, sizes[d]))
        left = sizes[:d] + (cut,) + sizes[d + 1 :]
        right = (
            offsets[:d] + (offsets[d] + cut,) + offsets[d + 1 :],
            sizes[:d] + (sizes[d] - cut,) + sizes[d + 1 :],
        )
        boxes[i] = (offsets, left)
        boxes.append(right)
    return boxes


@st.composite
def placed(draw, boxes, size, dtype, rank_pool) -> ShardedTensorMetadata:
    """Place each box on 1..3 distinct ranks of the pool (replicas), in a shuffled shard order."""
    shards = []
    for offsets, sizes in boxes:
        holders = draw(st.lists(st.sampled_from(rank_pool), min_size=1, max_size=3, unique=True))
        shards.extend(ShardMetadata(offsets, sizes, f"rank:{r}/cpu") for r in holders)
    shards = draw(st.permutations(shards))
    return ShardedTensorMetadata(tuple(shards), size, TensorProperties(dtype=dtype))


@st.composite
def layouts(draw, size: tuple[int, ...], dtype: torch.dtype) -> ShardedTensorMetadata:
    """A random valid layout of `size`: grid, guillotine, chunk spec or DTensor mesh, on a rank subset."""
    rank_pool = sorted(draw(st.sets(st.integers(0, 7), min_size=1, max_size=5)))
    kinds = ["grid", "guillotine", "mesh"] + (["chunk"] if size else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "grid":
        return draw(placed(draw(grid_boxes(size)), size, dtype, rank_pool))
    if kind == "guillotine":
        return draw(placed(draw(guillotine_boxes(size)), size, dtype, rank_pool))
    if kind == "chunk":
        dim = draw(st.integers(-len(size), len(size) - 1))
        ranks = draw(st.lists(st.sampled_from(rank_pool), min_size=1, max_size=6))
        return ChunkShardingSpec(dim, [f"rank:{r}/cpu" for r in ranks]).build_metadata(
            size, TensorProperties(dtype=dtype)
        )
    shape = draw(st.sampled_from([(1,), (2,), (3,), (2, 2), (1, 3), (3, 2)]))
    ranks = draw(
        st.lists(
            st.integers(0, 7), min_size=math.prod(shape), max_size=math.prod(shape), unique=True
        )
    )
    mesh = (
        ranks
        if len(shape) == 1
        else [ranks[i * shape[1] : (i + 1) * shape[1]] for i in range(shape[0])]
    )
    rules = [
        draw(st.sampled_from([Replicate()] + [Shard(d) for d in range(len(size))])) for _ in shape
    ]
    return metadata_from_placements(size, mesh, rules, dtype=dtype)


@st.composite
def reshard_cases(draw):
    ndim = draw(st.integers(0, 4))
    size = tuple(draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim)))
    dtype = draw(st.sampled_from(DTYPES))
    src = draw(layouts(size, dtype))
    dst = draw(layouts(size, dtype))
    bucket_bytes = draw(st.sampled_from([1, 3, 8, 24, 64, 1 << 20]))
    return src, dst, bucket_bytes


# ---------------------------------------------------------------- checks


def simulate_ranks(plan, src_shards) -> list[torch.Tensor]:
    """Run the plan as ranks would: each rank packs what for_rank says it sends, peers unpack in order."""
    dst_meta = plan.dst
    out = [torch.zeros(s.shard_sizes, dtype=dst_meta.dtype) for s in dst_meta.shards_metadata]
    ranks = sorted(
        {s.rank for s in plan.src.shards_metadata} | {s.rank for s in dst_meta.shards_metadata}
    )
    mine_src = {
        r: {i: t for i, t in enumerate(src_shards) if plan.src.shards_metadata[i].rank == r}
        for r in ranks
    }
    mine_dst = {
        r: {i: t for i, t in enumerate(out) if dst_meta.shards_metadata[i].rank == r} for r in ranks
    }
    wires: dict[tuple[int, int], deque] = defaultdict(deque)
    for r in ranks:
        part = plan.for_rank(r)
        for t in part.local:
            copy_box(
                mine_src[r][t.src_shard],
                plan.src.shards_metadata[t.src_shard].box,
                mine_dst[r][t.dst_shard],
                dst_meta.shards_metadata[t.dst_shard].box,
                t.box,
            )
        for bucket in part.sends:
            wires[(r, bucket.dst_rank)].append(pack_bucket(bucket, mine_src[r]))
    for r in ranks:
        for bucket in plan.for_rank(r).recvs:
            unpack_bucket(bucket, wires[(bucket.src_rank, r)].popleft(), mine_dst[r])
    assert all(not q for q in wires.values())
    return out


def check_plan_structure(plan, src, dst, bucket_bytes) -> None:
    itemsize = src.tensor_properties.itemsize
    coverage = [torch.zeros(s.shard_sizes, dtype=torch.int32) for s in dst.shards_metadata]
    for t in plan.transfers:
        s_shard, d_shard = src.shards_metadata[t.src_shard], dst.shards_metadata[t.dst_shard]
        assert (t.src_rank, t.dst_rank) == (s_shard.rank, d_shard.rank)
        assert s_shard.box.contains(t.box) and d_shard.box.contains(t.box)
        assert not t.box.is_empty()
        assert t.nbytes == t.box.numel() * itemsize
        if not t.is_local:
            assert not any(
                s.rank == t.dst_rank and s.box.contains(t.box) for s in src.shards_metadata
            )
        coverage[t.dst_shard][
            tuple(
                slice(o - so, o - so + n)
                for o, so, n in zip(t.offsets, d_shard.shard_offsets, t.sizes)
            )
        ] += 1
    for j, c in enumerate(coverage):
        assert bool((c == 1).all()), f"dst shard {j} not covered exactly once"
    keys = [(not t.is_local, t.src_rank, t.dst_rank) for t in plan.transfers]
    assert keys == sorted(keys)
    assert all(t.src_rank == t.dst_rank for t in plan.transfers if t.is_local)
    assert [t for b in plan.buckets for t in b.transfers] == [
        t for t in plan.transfers if not t.is_local
    ]
    for b in plan.buckets:
        assert b.transfers and all(
            (t.src_rank, t.dst_rank) == (b.src_rank, b.dst_rank) for t in b.transfers
        )
        assert b.nbytes == sum(t.nbytes for t in b.transfers)
        if itemsize <= bucket_bytes:
            assert b.nbytes <= bucket_bytes
        else:
            assert all(t.box.numel() == 1 for t in b.transfers)
    assert (
        plan.nbytes_local + plan.nbytes_remote
        == sum(s.numel() for s in dst.shards_metadata) * itemsize
    )


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reshard_cases())
def test_random_reshard_reproduces_every_destination_shard(case):
    src, dst, bucket_bytes = case
    plan = plan_reshard(src, dst, bucket_bytes=bucket_bytes)
    check_plan_structure(plan, src, dst, bucket_bytes)
    x = reference_tensor(src.size, src.dtype)
    expected = shards_of(x, dst)
    src_shards = [t.clone() for t in shards_of(x, src)]
    for got, want in zip(apply_plan(plan, src_shards), expected, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    for got, want in zip(simulate_ranks(plan, src_shards), expected, strict=True):
        assert torch.equal(got, want)
    assert plan_reshard(src, dst, bucket_bytes=bucket_bytes) == plan


# ---------------------------------------------------------------- targeted cases


def rows(n: int, ranks: list[int], cols: int = 4, dtype=torch.float32) -> ShardedTensorMetadata:
    return ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in ranks]).build_metadata(
        (n, cols), TensorProperties(dtype=dtype)
    )


def test_unchanged_layout_is_all_local_and_unbucketed():
    meta = rows(10, [0, 1, 2])
    plan = plan_reshard(meta, meta)
    assert plan.buckets == () and plan.nbytes_remote == 0
    assert [(t.src_shard, t.dst_shard) for t in plan.transfers] == [(0, 0), (1, 1), (2, 2)]
    assert plan.nbytes_local == meta.nbytes


def test_replicated_source_is_read_locally_where_held():
    src = metadata_from_placements((8, 4), [0, 1, 2, 3], [Replicate()])
    dst = rows(8, [0, 1, 2, 3])
    plan = plan_reshard(src, dst)
    assert all(t.is_local for t in plan.transfers) and plan.buckets == ()


def test_remote_reads_are_spread_over_replica_holders():
    src = metadata_from_placements((16, 4), [0, 1, 2, 3], [Replicate()])
    dst = rows(16, [4, 5, 6, 7])
    plan = plan_reshard(src, dst)
    served = defaultdict(int)
    for t in plan.transfers:
        served[t.src_rank] += t.nbytes
    assert dict(served) == {0: 64, 1: 64, 2: 64, 3: 64}


def test_order_groups_local_first_then_sorted_peer_pairs():
    src = rows(12, [0, 1, 2])
    dst = rows(12, [2, 0, 1, 0])
    plan = plan_reshard(src, dst)
    pairs = [(t.src_rank, t.dst_rank, t.dst_shard) for t in plan.transfers]
    assert pairs == [(0, 0, 1), (1, 1, 2), (0, 2, 0), (1, 0, 1), (2, 0, 3), (2, 1, 2)]


def test_empty_destination_shards_get_no_transfer():
    src = rows(2, [0])
    dst = rows(2, [0, 1, 2, 3])  # two empty shards
    plan = plan_reshard(src, dst)
    assert {t.dst_shard for t in plan.transfers} == {0, 1}
    out = apply_plan(plan, shards_of(torch.arange(8.0).reshape(2, 4), src))
    assert [tuple(t.shape) for t in out] == [(1, 4), (1, 4), (0, 4), (0, 4)]


def test_large_transfer_is_split_along_outer_dim_into_buckets():
    src = rows(10, [0], cols=4)  # 16 bytes per row
    dst = rows(10, [1], cols=4)
    plan = plan_reshard(src, dst, bucket_bytes=50)
    assert [t.sizes for t in plan.transfers] == [(3, 4), (3, 4), (3, 4), (1, 4)]
    assert [t.offsets for t in plan.transfers] == [(0, 0), (3, 0), (6, 0), (9, 0)]
    assert [b.nbytes for b in plan.buckets] == [48, 48, 48, 16]


def test_rows_larger_than_a_bucket_are_split_along_the_next_dim():
    src = rows(2, [0], cols=8)  # 32 bytes per row
    dst = rows(2, [1], cols=8)
    plan = plan_reshard(src, dst, bucket_bytes=12)
    assert all(b.nbytes <= 12 for b in plan.buckets)
    assert [t.sizes for t in plan.transfers] == [(1, 3), (1, 3), (1, 2)] * 2
    x = torch.randn(2, 8)
    assert torch.equal(apply_plan(plan, [x])[0], x)


def test_split_box_keeps_c_order_and_limit():
    pieces = split_box((1, 2, 0), (2, 3, 5), 4, 40)
    assert pieces == [
        ((1, 2, 0), (1, 2, 5)),
        ((1, 4, 0), (1, 1, 5)),
        ((2, 2, 0), (1, 2, 5)),
        ((2, 4, 0), (1, 1, 5)),
    ]
    assert split_box((0,), (3,), 8, 4) == [((0,), (1,)), ((1,), (1,)), ((2,), (1,))]


def test_for_rank_partitions_the_plan():
    src = metadata_from_placements((6, 6), [[0, 1], [2, 3]], [Shard(0), Shard(1)])
    dst = metadata_from_placements((6, 6), [1, 2, 4], [Shard(1)])
    plan = plan_reshard(src, dst, bucket_bytes=16)
    parts = [plan.for_rank(r) for r in range(5)]
    assert sum(len(p.local) for p in parts) == len(plan.local_transfers)
    assert [b for p in parts for b in p.sends] == sorted(plan.buckets, key=lambda b: b.src_rank)
    assert parts[3].local == () and parts[3].recvs == () and parts[3].sends
    assert parts[4].peers == (1, 3)  # dst columns 4:6 live on ranks 1 (rows 0:3) and 3 (rows 3:6)
    assert plan.for_rank(7).is_empty
    assert plan.rank_plans() == {r: parts[r] for r in (0, 1, 2, 3, 4)}


def test_zero_dim_tensor():
    src = make_metadata((), [((), (), 0)])
    dst = make_metadata((), [((), (), 1), ((), (), 2)])
    plan = plan_reshard(src, dst)
    out = apply_plan(plan, [torch.tensor(3.5)])
    assert [t.item() for t in out] == [3.5, 3.5]


def test_many_shards_plan_matches_expected_transfer_count():
    src = rows(100_000, list(range(1000)), cols=2)
    dst = rows(100_000, list(range(999)), cols=2)
    plan = plan_reshard(src, dst)
    # row chunks against row chunks: one piece between each pair of consecutive boundaries
    bounds = {
        b
        for meta in (src, dst)
        for s in meta.shards_metadata
        for b in (s.shard_offsets[0], s.shard_offsets[0] + s.shard_sizes[0])
    }
    assert len(plan.transfers) == len(bounds) - 1 > 1900
    assert sum(t.nbytes for t in plan.transfers) == src.nbytes


@pytest.mark.parametrize("layout", ["rows", "grid"])
def test_planner_tests_few_pairs_not_all_pairs(monkeypatch, layout):
    import shardserve.core.planner as planner

    calls = 0
    real = planner.intersection

    def counting(*args):
        nonlocal calls
        calls += 1
        return real(*args)

    monkeypatch.setattr(planner, "intersection", counting)
    if layout == "rows":
        src, dst = rows(100_000, list(range(1000)), cols=2), rows(100_000, list(range(999)), cols=2)
    else:
        src = metadata_from_placements(
            (1000, 1000),
            [list(range(r * 40, r * 40 + 40)) for r in range(25)],
            [Shard(0), Shard(1)],
        )
        dst = metadata_from_placements(
            (1000, 1000),
            [list(range(r * 25, r * 25 + 25)) for r in range(40)],
            [Shard(0), Shard(1)],
        )
    plan = plan_reshard(src, dst)
    assert (
        calls
        <= 2 * len(plan.transfers)
        < len(src.shards_metadata) * len(dst.shards_metadata) // 100
    )


# ---------------------------------------------------------------- errors


def test_mismatched_size_is_named():
    with pytest.raises(ValueError, match=r"size differs: src.size=\(4, 4\) but dst.size=\(5, 4\)"):
        plan_reshard(rows(4, [0]), rows(5, [0]))


def test_mismatched_dtype_is_named():
    with pytest.raises(ValueError, match=r"tensor_properties.dtype differs"):
        plan_reshard(rows(4, [0]), rows(4, [0], dtype=torch.int32))


@pytest.mark.parametrize(
    "bucket_bytes,error", [(0, ValueError), (-5, ValueError), (1.5, TypeError), (True, TypeError)]
)
def test_bad_bucket_bytes(bucket_bytes, error):
    with pytest.raises(error, match="bucket_bytes"):
        plan_reshard(rows(4, [0]), rows(4, [1]), bucket_bytes=bucket_bytes)


def test_not_metadata_is_a_type_error():
    with pytest.raises(TypeError, match="dst must be a ShardedTensorMetadata"):
        plan_reshard(rows(4, [0]), "rank:0/cpu")


def test_source_with_a_gap_is_reported():
    src = make_metadata((4, 4), [((0, 0), (2, 4), 0)])
    with pytest.raises(ValueError, match=r"src shards do not cover dst.shards_metadata\[1\]"):
        plan_reshard(src, rows(4, [0, 1]))


def test_shard_outside_the_tensor_is_named():
    src = make_metadata((4, 4), [((0, 0), (5, 4), 0)])
    with pytest.raises(
        ValueError, match=r"src.shards_metadata\[0\] is outside the tensor in dim 0"
    ):
        plan_reshard(src, rows(4, [0]))


def test_missing_placement_is_named():
    dst = ShardedTensorMetadata((ShardMetadata((0, 0), (4, 4)),), (4, 4))
    with pytest.raises(ValueError, match=r"dst.shards_metadata\[0\].placement is missing"):
        plan_reshard(rows(4, [0]), dst)


def test_a_bad_layout_is_refused_every_time_a_good_one_is_checked_once():
    """A layout's checks are kept with the layout object only once it passed them: planning the same bad
    layout again fails again; a good one gives the same plan when planned again from the same objects."""
    bad = make_metadata((4, 4), [((0, 0), (5, 4), 0)])
    for _ in range(2):
        with pytest.raises(ValueError, match=r"src.shards_metadata\[0\] is outside the tensor"):
            plan_reshard(bad, rows(4, [0]))
    src, dst = rows(8, [0, 1]), rows(8, [1, 2, 3])
    assert src.shard_ranks() == (0, 1) and dst.shard_ranks() == (1, 2, 3)
    assert plan_reshard(src, dst) == plan_reshard(src, dst)
    assert (
        plan_reshard(src, dst).transfers
        == plan_reshard(rows(8, [0, 1]), rows(8, [1, 2, 3])).transfers
    )


def test_apply_plan_checks_shard_tensors():
    plan = plan_reshard(rows(4, [0, 1]), rows(4, [1]))
    with pytest.raises(ValueError, match="src_shards has 1 tensors"):
        apply_plan(plan, [torch.zeros(2, 4)])
    with pytest.raises(ValueError, match=r"src_shards\[1\] has shape \(3, 4\)"):
        apply_plan(plan, [torch.zeros(2, 4), torch.zeros(3, 4)])
    with pytest.raises(ValueError, match=r"src_shards\[0\] has dtype torch.float64"):
        apply_plan(plan, [torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, 4)])


def test_apply_plan_writes_into_given_tensors():
    src, dst = rows(6, [0, 1]), rows(6, [1, 2, 3])
    x = torch.arange(24.0).reshape(6, 4)
    out = [torch.full(s.shard_sizes, -1.0) for s in dst.shards_metadata]
    result = apply_plan(plan_reshard(src, dst), shards_of(x, src), out=out)
    assert all(a is b for a, b in zip(result, out))
    assert all(torch.equal(a, b) for a, b in zip(out, shards_of(x, dst)))
    with pytest.raises(ValueError, match=r"out\[0\] has shape \(3, 4\)"):
        apply_plan(plan_reshard(src, dst), shards_of(x, src), out=[torch.zeros(3, 4)] * 3)


def test_pack_and_unpack_check_buffers():
    plan = plan_reshard(rows(4, [0, 1]), rows(4, [1]))
    bucket = plan.buckets[0]
    with pytest.raises(ValueError, match="has no tensor for shard 0"):
        pack_bucket(bucket, {})
    with pytest.raises(ValueError, match="flat holds 3 bytes but the bucket has 32"):
        unpack_bucket(bucket, torch.zeros(3, dtype=torch.uint8), {0: torch.zeros(4, 4)})
    with pytest.raises(TypeError, match="flat must be a 1-D torch.uint8 tensor"):
        unpack_bucket(bucket, torch.zeros(8), {0: torch.zeros(4, 4)})
    with pytest.raises(ValueError, match=r"does not hold the transfer box"):
        pack_bucket(bucket, {0: torch.zeros(1, 4)})


def test_copy_box_copies_a_global_box_between_local_shards():
    src = torch.arange(20.0).reshape(4, 5)
    dst = torch.zeros(3, 3)
    copy_box(src, Box((2, 0), (4, 5)), dst, Box((4, 1), (3, 3)), Box((4, 2), (2, 2)))
    expected = torch.zeros(3, 3)
    expected[0:2, 1:3] = src[2:4, 2:4]
    assert torch.equal(dst, expected)


def test_plan_per_round_shares_the_round_budget_among_a_ranks_peers():
    size = (
        64,
        48,
    )  # float32: 12 KiB; row-wise over 4 ranks -> column-wise: every rank sends to and hears from 3
    src = ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(4)]).build_metadata(size)
    dst = ChunkShardingSpec(1, [f"rank:{r}/cpu" for r in range(4)]).build_metadata(size)
    round_bytes = 1536
    plan = plan_reshard_per_round(src, dst, round_bytes)
    assert plan.bucket_bytes == round_bytes // 6
    for part in plan.rank_plans().values():
        per_pair = defaultdict(list)
        for bucket in part.sends + part.recvs:
            per_pair[(bucket.src_rank, bucket.dst_rank)].append(bucket.nbytes)
        assert len(per_pair) == 6
        assert sum(sizes[0] for sizes in per_pair.values()) <= round_bytes
    full = torch.arange(64 * 48.0).view(size)
    out = apply_plan(plan, shards_of(full, src))
    assert all(torch.equal(got, want) for got, want in zip(out, shards_of(full, dst), strict=True))


def test_plan_per_round_keeps_the_bucket_when_a_rank_has_one_peer():
    size = (8, 6)
    src = ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata(size)
    dst = ChunkShardingSpec(0, ["rank:1/cpu"]).build_metadata(size)
    assert plan_reshard_per_round(src, dst, 40).bucket_bytes == 40


def test_plan_per_round_is_the_plan_of_its_bucket_size_whatever_the_layouts():
    """The ranks plan with plan_reshard at the coordinator's bucket size: the per-round plan (whose copies are
    chosen once, then cut) must be that plan exactly, for grids, replicas moved whole, a repair's unavailable
    copies, and boxes cut anew."""
    size = (24, 8)
    grid = metadata_from_placements(size, [[0, 1], [2, 3]], [Shard(0), Shard(1)])
    rows = ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(6)]).build_metadata(size)
    cols = ChunkShardingSpec(1, [f"rank:{r}/cpu" for r in (5, 4, 3)]).build_metadata(size)
    replicated = replicated_rows(size, copies=((0, 1), (1, 2), (2, 3), (3, 0)))
    moved = replicated_rows(size, copies=((2, 3), (3, 0), (0, 1), (1, 2)))
    cases = [
        (grid, cols, ()),
        (rows, grid, ()),
        (replicated, moved, ()),
        (replicated, moved, (0, 3)),
    ]
    for src, dst, unavailable in cases:
        for round_bytes in (64, 256, 1 << 20):
            plan = plan_reshard_per_round(src, dst, round_bytes, frozenset(unavailable))
            again = plan_reshard(src, dst, plan.bucket_bytes, frozenset(unavailable))
            assert plan.transfers == again.transfers and plan.buckets == again.buckets
            full = torch.arange(24 * 8.0).view(size)
            out = apply_plan(plan, shards_of(full, src))
            assert all(torch.equal(a, b) for a, b in zip(out, shards_of(full, dst), strict=True))


def replicated_rows(
    size: tuple[int, int], copies: tuple[tuple[int, int], ...]
) -> ShardedTensorMetadata:
    """Row blocks of `size`, block i held by the two ranks copies[i]."""
    step = size[0] // len(copies)
    return ShardedTensorMetadata(
        tuple(
            ShardMetadata((i * step, 0), (step, size[1]), f"rank:{rank}/cpu")
            for i, pair in enumerate(copies)
            for rank in pair
        ),
        size,
        TensorProperties(dtype=torch.float32),
    )


def test_participants_are_destination_holders_and_the_ranks_read_from():
    """A source rank whose shard is empty sends nothing and is not waited for; a destination rank whose shard is
    empty still takes part (it installs the empty shard)."""
    src = ChunkShardingSpec(
        2, ["rank:0/cpu", "rank:1/cpu", "rank:2/cpu", "rank:3/cpu"]
    ).build_metadata(
        (7, 5, 3), TensorProperties(dtype=torch.float32)
    )  # 3 along dim 2: rank 3's chunk is empty or absent
    dst = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu", "rank:2/cpu"]).build_metadata(
        (7, 5, 3), TensorProperties(dtype=torch.float32)
    )
    plan = plan_reshard(src, dst)
    assert plan.participants(dst) == (0, 1, 2)
    empty_dst = ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(8)]).build_metadata(
        (7, 5, 3), TensorProperties(dtype=torch.float32)
    )  # rank 7 gets an empty chunk
    assert 7 in plan_reshard(src, empty_dst).participants(empty_dst)
