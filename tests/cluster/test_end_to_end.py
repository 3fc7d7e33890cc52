"""The client against a real 3-rank cluster: put every kind of layout and dtype, read it back bit for bit."""

from __future__ import annotations

import random
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch.distributed._shard import sharding_spec as torch_specs
from waiting import wait_until

from shardserve.client import (
    RankUnavailableError,
    RemoteShardedTensor,
    StaleVersionError,
    TensorExistsError,
    TensorNotFoundError,
    connect,
)
from shardserve.core.metadata import ShardMetadata
from shardserve.core.specs import ChunkShardingSpec, EnumerableShardingSpec
from shardserve.server.common.memory_limits import effective_memory
from shardserve.server.rank.memory_budget import default_memory_limit

pytestmark = pytest.mark.timeout(300)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, so float comparisons are bit for bit (NaN, -0.0)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(bits(got), bits(expected))


def random_tensor(shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 250 if dtype == torch.uint8 else 2**40, shape, generator=g).to(dtype)


def random_box(shape, rng: random.Random) -> tuple[tuple[int, ...], tuple[int, ...]]:
    offsets = [rng.randrange(n + 1) for n in shape]
    sizes = [rng.randrange(n - o + 1) for n, o in zip(shape, offsets)]
    return tuple(offsets), tuple(sizes)


def cpu(*ranks: int) -> list[str]:
    return [f"rank:{r}/cpu" for r in ranks]


def grid(rows: list[int], cols: list[int], ranks: list[int]) -> EnumerableShardingSpec:
    """An uneven 2-D grid: row cut points x column cut points, shards placed round-robin on `ranks`."""
    shards = []
    for i, (r0, r1) in enumerate(zip(rows, rows[1:])):
        for j, (c0, c1) in enumerate(zip(cols, cols[1:])):
            rank = ranks[(i * (len(cols) - 1) + j) % len(ranks)]
            shards.append(ShardMetadata((r0, c0), (r1 - r0, c1 - c0), f"rank:{rank}/cpu"))
    return EnumerableShardingSpec(shards)


LAYOUTS = {
    "chunk-dim0-uneven": ((10, 7), ChunkShardingSpec(0, cpu(0, 1, 2))),
    "chunk-dim1-uneven": ((5, 11), ChunkShardingSpec(1, cpu(2, 0, 1))),
    "chunk-dim-1-3d": ((3, 4, 13), ChunkShardingSpec(-1, cpu(0, 1, 2))),
    "grid-2d": ((9, 10), grid([0, 4, 9], [0, 3, 7, 10], [0, 1, 2])),
    "several-per-rank": ((20, 3), ChunkShardingSpec(0, cpu(0, 1, 2, 0, 1, 2, 0))),
    "more-ranks-than-rows": ((2, 5), ChunkShardingSpec(0, cpu(0, 1, 2))),
    "torch-chunk": ((8, 6), torch_specs.ChunkShardingSpec(dim=1, placements=cpu(1, 2))),
    "torch-enumerable": (
        (6, 6),
        torch_specs.EnumerableShardingSpec(
            [
                torch_specs.ShardMetadata([0, 0], [6, 2], "rank:0/cpu"),
                torch_specs.ShardMetadata([0, 2], [3, 4], "rank:1/cpu"),
                torch_specs.ShardMetadata([3, 2], [3, 4], "rank:2/cpu"),
            ]
        ),
    ),
}


@pytest.fixture(scope="module")
def cl(cluster3):
    with connect(cluster3.address, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def layouts(cl) -> dict[str, tuple[torch.Tensor, RemoteShardedTensor]]:
    """Every layout put once, with its source tensor."""
    out = {}
    for i, (name, (shape, spec)) in enumerate(LAYOUTS.items()):
        source = random_tensor(shape, torch.float32, seed=i)
        out[name] = (source, cl.put(name, source, spec))
    return out


def test_cluster_has_three_live_ranks(cl):
    ranks = cl.ranks()
    assert [r.rank for r in ranks] == [0, 1, 2] and all(r.alive and r.address for r in ranks)


def test_ranks_sharing_a_host_split_its_memory_by_default(cl):
    """No --memory-limit: each of the 3 local ranks may hold 0.8 of the memory left after the reserve / 3,
    and says where that came from."""
    share = default_memory_limit("cpu", effective_memory().nbytes, 3)
    assert [r.memory_limit_bytes for r in cl.ranks()] == [share] * 3
    assert all(r.memory_limit_source.endswith("over 3 rank(s) on this host") for r in cl.ranks())


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_put_then_read_everything_back(cl, layouts, name):
    source, remote = layouts[name]
    assert (
        remote.shape == source.shape and remote.dtype == source.dtype and remote.ndim == source.ndim
    )
    assert_same(remote.full_tensor(), source)
    assert_same(cl.tensor(name).full_tensor(), source)
    rng = random.Random(name)
    for _ in range(200 if name in ("grid-2d", "chunk-dim0-uneven") else 40):
        offsets, sizes = random_box(source.shape, rng)
        expected = source[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        assert_same(remote.fetch(offsets, sizes), expected)


@pytest.mark.parametrize("name", ["grid-2d", "chunk-dim1-uneven", "chunk-dim-1-3d"])
def test_indexing_matches_torch(layouts, name):
    source, remote = layouts[name]
    indices = [
        0,
        -1,
        (1,),
        (slice(-3, None),),
        (slice(None, -1), -2),
        (-1, slice(1, -1)),
        (slice(2, 2),),
        (slice(-100, 100),),
        (..., -1),
        (1, ..., slice(-2, None)),
    ]
    for index in indices:
        assert_same(remote[index], source[index])
    if source.ndim == 2:
        assert_same(remote[2, 3], source[2, 3])


@pytest.mark.parametrize("name", ["grid-2d", "several-per-rank", "torch-enumerable"])
def test_remote_shards_fetch_each_shard(layouts, name):
    source, remote = layouts[name]
    by_rank = remote.remote_shards()
    meta = remote.metadata()
    assert sorted(s.index for shards in by_rank.values() for s in shards) == list(
        range(len(meta.shards_metadata))
    )
    for rank, shards in by_rank.items():
        for shard in shards:
            assert shard.metadata.rank == rank and shard.version == remote.version
            box = shard.metadata.box
            expected = source[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
            assert_same(shard.fetch(), expected)


def test_metadata_and_sharding_spec(layouts):
    shape, spec = LAYOUTS["chunk-dim0-uneven"]
    _, remote = layouts["chunk-dim0-uneven"]
    assert remote.metadata() == spec.build_metadata(shape, remote.metadata().tensor_properties)
    assert [s.shard_sizes[0] for s in remote.metadata().shards_metadata] == [4, 4, 2]
    assert remote.sharding_spec() == spec
    _, grid_remote = layouts["grid-2d"]
    assert isinstance(grid_remote.sharding_spec(), EnumerableShardingSpec)
    assert grid_remote.sharding_spec().shards == grid_remote.metadata().shards_metadata


def test_fetch_into_strided_out(layouts):
    source, remote = layouts["grid-2d"]
    out = torch.full((10, 9), -1.0).t()  # 9x10, not contiguous: every part arrives via a buffer
    assert remote.fetch((0, 0), (9, 10), out=out) is out
    assert_same(out, source)
    wide = torch.full((5, 20), -1.0)
    remote.fetch((2, 1), (5, 8), out=wide[:, 3:11])
    assert_same(wide[:, 3:11], source[2:7, 1:9])
    assert (wide[:, :3] == -1).all() and (wide[:, 11:] == -1).all()


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool]
)
def test_dtypes_round_trip(cl, dtype):
    source = random_tensor((13, 6), dtype, seed=7)
    name = f"dtype-{str(dtype).removeprefix('torch.')}"
    remote = cl.put(name, source, grid([0, 5, 13], [0, 4, 6], [2, 0, 1]))
    assert remote.dtype == dtype
    assert_same(remote.full_tensor(), source)
    assert_same(remote[3:11, 1:5], source[3:11, 1:5])
    assert_same(remote[-1], source[-1])
    cl.delete(name)


def test_special_float_bits_survive(cl):
    source = torch.tensor(
        [[0.0, -0.0, float("nan"), float("inf")], [-float("inf"), 1e-45, -1.5, 3.0]]
    )
    remote = cl.put("specials", source, ChunkShardingSpec(1, cpu(0, 1)))
    assert_same(remote.full_tensor(), source)
    cl.delete("specials")


@pytest.mark.parametrize(
    "init, expected",
    [
        ("zeros", lambda n: torch.zeros(n)),
        ("ones", lambda n: torch.ones(n)),
        ("arange", lambda n: torch.arange(n, dtype=torch.float32)),
    ],
)
def test_create_with_init(cl, init, expected):
    remote = cl.create(f"init-{init}", (7, 5), spec=ChunkShardingSpec(0, cpu(0, 1, 2)), init=init)
    assert_same(remote.full_tensor(), expected(35).reshape(7, 5))
    cl.delete(f"init-{init}")


def test_create_normal_is_seeded_and_default_spec_is_row_wise(cl):
    a = cl.create("normal-a", (9, 4), init="normal", seed=3)
    b = cl.create("normal-b", (9, 4), init="normal", seed=3)
    c = cl.create("normal-c", (9, 4), init="normal", seed=4)
    assert [s.rank for s in a.metadata().shards_metadata] == [0, 1, 2]
    assert a.sharding_spec() == ChunkShardingSpec(0, cpu(0, 1, 2))
    assert_same(a.full_tensor(), b.full_tensor())
    assert not torch.equal(a.full_tensor(), c.full_tensor())
    assert a.full_tensor().std() > 0.3
    for name in ("normal-a", "normal-b", "normal-c"):
        cl.delete(name)


def test_list_and_delete(cl):
    cl.put("listed", torch.arange(6.0).reshape(3, 2))
    summary = {t.name: t for t in cl.list()}["listed"]
    assert summary.shape == (3, 2) and summary.dtype == torch.float32 and summary.nbytes == 24
    assert summary.state == "READY" and "listed" in cl
    cl.delete("listed")
    assert "listed" not in [t.name for t in cl.list()]
    with pytest.raises(TensorNotFoundError):
        cl.tensor("listed")


def test_overwrite_while_holding_old_proxy_refreshes_once(cl):
    first = torch.arange(24.0).reshape(6, 4)
    old = cl.put("stale", first, ChunkShardingSpec(0, cpu(0, 1, 2)))
    old_shard = old.remote_shards()[1][0]
    second = -torch.arange(40.0).reshape(8, 5)
    new = cl.put("stale", second, ChunkShardingSpec(1, cpu(2, 1)), overwrite=True)
    assert new.version > old.version
    held_version = old.version
    assert_same(old[1:7, 0:5], second[1:7, 0:5])  # the read refreshed the proxy and retried whole
    assert old.version == new.version and old.shape == second.shape
    assert old.version > held_version
    try:  # a shard pinned to the replaced version: still served in the ranks' grace period, whole, or gone
        assert_same(old_shard.fetch(), first[2:4])
    except (StaleVersionError, TensorNotFoundError):
        pass
    cl.delete("stale")
    with pytest.raises((StaleVersionError, TensorNotFoundError)):  # a delete ends the grace at once
        old_shard.fetch()


def test_put_existing_name_needs_overwrite(cl):
    cl.put("exists", torch.zeros(4))
    with pytest.raises(TensorExistsError):
        cl.put("exists", torch.ones(4))
    with pytest.raises(TensorExistsError):
        cl.create("exists", (4,))
    assert_same(cl.tensor("exists").full_tensor(), torch.zeros(4))
    cl.delete("exists")


def test_empty_and_zero_sized(cl):
    remote = cl.put("rowless", torch.empty(0, 3), ChunkShardingSpec(0, cpu(0, 1)))
    assert_same(remote.full_tensor(), torch.empty(0, 3))
    cl.delete("rowless")
    source = torch.arange(12).reshape(4, 3)
    remote = cl.put("boxes", source)
    assert_same(remote.fetch((2, 1), (0, 2)), source[2:2, 1:3])
    cl.delete("boxes")


def test_a_0d_tensor_goes_whole_to_the_first_live_rank_by_default(cl):
    for value in (torch.tensor(3.5, dtype=torch.float64), torch.tensor(-7)):
        remote = cl.put("scalar", value, overwrite=True)
        assert [s.placement.rank() for s in remote.metadata().shards_metadata] == [
            min(r.rank for r in cl.ranks() if r.alive)
        ]
        assert_same(remote.full_tensor(), value)
        assert_same(remote[()], value)
    cl.delete("scalar")


def test_256_mib_round_trip(cl):
    source = torch.randint(-(2**31), 2**31 - 1, (65536, 1024), dtype=torch.int32)  # 256 MiB
    remote = cl.put("big", source)
    assert remote.nbytes == 256 << 20
    assert_same(remote.full_tensor(), source)
    cl.delete("big")


def test_reads_from_many_threads_at_once(layouts):
    source, remote = layouts["grid-2d"]
    rng = random.Random(5)
    boxes = [random_box(source.shape, rng) for _ in range(64)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda box: remote.fetch(*box), boxes))
    for (offsets, sizes), got in zip(boxes, results):
        assert_same(got, source[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))])


def test_proxy_of_a_deleted_tensor_raises_key_error(cl):
    remote = cl.put("gone", torch.ones(6, 2))
    cl.delete("gone")
    with pytest.raises(TensorNotFoundError, match="gone"):
        remote.full_tensor()


def test_dead_rank_is_connection_error_and_others_keep_serving(cl, cluster3, layouts):
    """Last test of the module: it kills rank 2 of the shared cluster."""
    source, remote = layouts[
        "chunk-dim0-uneven"
    ]  # rows 0-3 on rank 0, 4-7 on rank 1, 8-9 on rank 2
    cluster3.kill_rank(2, signal.SIGKILL)
    with connect(
        cluster3.address, timeout=2.0
    ) as short:  # a read waits its deadline for rank 2 to return
        dead = short.tensor(remote.name)
        with pytest.raises(RankUnavailableError, match="rank"):
            dead[8:10]
        with pytest.raises(ConnectionError):
            dead.full_tensor()
        assert_same(dead[0:8], source[0:8])
    assert_same(remote[0:8], source[0:8])
    wait_until(lambda: not cl.ranks()[2].alive, 30, "rank 2 to be reported dead")
    assert [r.alive for r in cl.ranks()] == [True, True, False]


def test_a_put_whose_version_another_overwrite_aborted_says_so(cl, cluster3):
    """Another client's put(overwrite=True) aborts this put's pending version while it writes: the writes fail
    with "version not held", and the put names the cause instead."""
    from shardserve import AbortedError, connect

    with connect(cluster3.address) as other:
        write, raced = cl.session.write_shards, []

        def write_after_another_put(writes):  # type: ignore[no-untyped-def]
            if not raced:
                raced.append(other.put("contested", torch.ones(6, 2), overwrite=True))
            return write(writes)

        cl.session.write_shards = write_after_another_put  # type: ignore[method-assign]
        try:
            with pytest.raises(
                AbortedError, match="another put or create of 'contested' with overwrite=True"
            ):
                cl.put("contested", torch.zeros(6, 2), overwrite=True)
        finally:
            del cl.session.write_shards
    assert torch.equal(cl.tensor("contested").full_tensor(), torch.ones(6, 2))
    cl.delete("contested")
