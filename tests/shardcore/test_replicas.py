"""shardcore.replicas: a layout expanded to R copies per box on distinct ranks (and hosts), balanced by bytes."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.core.health import copies_by_box, layout_health
from shardserve.core.metadata import ShardMetadata, TensorProperties
from shardserve.core.replicas import CandidateRank, replicate_layout
from shardserve.core.specs import ChunkShardingSpec, EnumerableShardingSpec
from shardserve.core.validation import validate_metadata

PROPS = TensorProperties(dtype=torch.float32)


def _candidates(hosts: list[str], devices: list[str] | None = None) -> list[CandidateRank]:
    devices = devices or ["cpu"] * len(hosts)
    return [
        CandidateRank(rank, host, device) for rank, (host, device) in enumerate(zip(hosts, devices))
    ]


def _chunks(size: tuple[int, ...], ranks: list[int], dim: int = 0):
    return ChunkShardingSpec(dim, [f"rank:{r}/cpu" for r in ranks]).build_metadata(size, PROPS)


@st.composite
def grid_layouts(draw):
    """A random grid of boxes over a 1-3-D tensor, each box on a random rank, with the candidates' hosts."""
    ndim = draw(st.integers(1, 3))
    size = tuple(draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim)))
    cuts = [sorted(set(draw(st.lists(st.integers(0, n), max_size=3))) | {0, n}) for n in size]
    world = draw(st.integers(1, 6))
    hosts = draw(st.lists(st.sampled_from("abc"), min_size=world, max_size=world))
    shards = []
    for intervals in itertools.product(*(list(zip(c, c[1:])) or [(0, 0)] for c in cuts)):
        offsets, sizes = tuple(lo for lo, _ in intervals), tuple(hi - lo for lo, hi in intervals)
        shards.append(ShardMetadata(offsets, sizes, f"rank:{draw(st.integers(0, world - 1))}/cpu"))
    meta = EnumerableShardingSpec(shards).build_metadata(size, PROPS)
    replicas = draw(st.integers(1, world))
    return meta, replicas, _candidates(hosts)


@settings(max_examples=120, deadline=None)
@given(grid_layouts())
def test_every_box_gets_r_copies_on_distinct_ranks_and_hosts(case):
    meta, replicas, candidates = case
    out = replicate_layout(meta, replicas, candidates)
    validate_metadata(out)
    hosts = {c.rank: c.host for c in candidates}
    for box, copies in copies_by_box(out).items():
        ranks = [out.shards_metadata[i].rank for i in copies]
        assert len(ranks) == replicas and len(set(ranks)) == replicas
        if len(set(hosts.values())) >= replicas:
            assert len({hosts[r] for r in ranks}) == replicas
    assert layout_health(out, []).replicas == (replicas if copies_by_box(meta) else 1)
    empty = [s for s in out.shards_metadata if s.box.is_empty()]
    assert empty == [s for s in meta.shards_metadata if s.box.is_empty()]


@settings(max_examples=120, deadline=None)
@given(grid_layouts())
def test_each_original_shard_stays_first_among_its_copies(case):
    meta, replicas, candidates = case
    out = replicate_layout(meta, replicas, candidates)
    originals = iter(meta.shards_metadata)
    for box, copies in copies_by_box(out).items():
        assert all(
            b - a == 1 for a, b in zip(copies, copies[1:])
        )  # the copies follow their original
    firsts = [out.shards_metadata[copies[0]] for copies in copies_by_box(out).values()]
    assert firsts == [s for s in originals if not s.box.is_empty()]
    assert replicate_layout(meta, replicas, candidates) == out  # deterministic


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 40), st.integers(1, 6), st.data())
def test_chunk_layouts_balance_bytes_within_one_shard_of_ideal(rows, world, data):
    ranks = data.draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=world, unique=True))
    replicas = data.draw(st.integers(1, world))
    meta = _chunks((rows, 3), ranks)
    out = replicate_layout(meta, replicas, _candidates(["h"] * world))
    loads = {r: 0 for r in range(world)}
    for index, shard in enumerate(out.shards_metadata):
        loads[shard.rank] += out.shard_nbytes(index)
    ideal = out.shards_nbytes() / world
    largest = max(meta.shard_nbytes(i) for i in range(len(meta.shards_metadata)))
    assert max(loads.values()) <= ideal + largest


def test_a_ring_of_equal_chunks_is_balanced_exactly():
    out = replicate_layout(_chunks((12, 2), [0, 1, 2, 3]), 2, _candidates(["h"] * 4))
    assert [s.rank for s in out.shards_metadata] == [
        0,
        1,
        1,
        3,
        2,
        0,
        3,
        2,
    ]  # two 3-row shards on every rank


def test_copies_go_to_other_hosts_first_and_keep_their_rank_device():
    candidates = _candidates(["a", "a", "b", "b"], ["cuda:0", "cuda:1", "cuda:0", "cuda:1"])
    meta = ChunkShardingSpec(0, ["rank:0/cuda:0", "rank:1/cuda:1"]).build_metadata((4, 2), PROPS)
    out = replicate_layout(meta, 2, candidates)
    assert [str(s.placement) for s in out.shards_metadata] == [
        "rank:0/cuda:0",
        "rank:2/cuda:0",
        "rank:1/cuda:1",
        "rank:3/cuda:1",
    ]


def test_a_primary_on_a_rank_not_among_the_candidates_keeps_its_place():
    out = replicate_layout(_chunks((4, 2), [5]), 2, _candidates(["a", "b"]))
    assert [s.rank for s in out.shards_metadata] == [5, 0]


def test_one_replica_returns_the_layout_as_it_is():
    meta = _chunks((6, 2), [0, 1])
    assert replicate_layout(meta, 1, _candidates(["h"])) is meta


@pytest.mark.parametrize(
    "replicas, message",
    [
        (0, r"replicas must be at least 1, got 0"),
        (-1, r"replicas must be at least 1"),
        (4, r"replicas=4 is more than the 3 live ranks \(\[0, 1, 2\]\)"),
        (True, r"replicas must be an int"),
        (2.0, r"replicas must be an int"),
    ],
)
def test_bad_replicas_raise_naming_it(replicas, message):
    with pytest.raises(ValueError, match=message):
        replicate_layout(_chunks((6, 2), [0, 1]), replicas, _candidates(["h"] * 3))


def test_a_layout_that_already_has_replicas_takes_no_more():
    meta = EnumerableShardingSpec(
        [ShardMetadata((0,), (4,), "rank:0/cpu"), ShardMetadata((0,), (4,), "rank:1/cpu")]
    ).build_metadata((4,), PROPS)
    with pytest.raises(
        ValueError, match=r"replicas=2 asks for copies of a layout that already has replicas"
    ):
        replicate_layout(meta, 2, _candidates(["h"] * 3))
    assert replicate_layout(meta, 1, _candidates(["h"] * 3)) is meta


def test_bad_candidates_raise():
    with pytest.raises(ValueError, match="more than once"):
        replicate_layout(_chunks((6, 2), [0]), 2, [CandidateRank(0, "h"), CandidateRank(0, "h")])
    with pytest.raises(ValueError, match="placement"):
        replicate_layout(
            _chunks((6, 2), [0]), 2, [CandidateRank(0, "h"), CandidateRank(1, "h", "tpu")]
        )
