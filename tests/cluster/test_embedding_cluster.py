"""Embedding serving end to end on a real 3-rank cluster: lookups, bags, modules, OOV, hostile requests, updates."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardserve.client import (
    Cluster,
    InvalidArgumentError,
    RemoteEmbedding,
    RemoteEmbeddingBag,
    ResourceExhaustedError,
    connect,
)
from shardserve.client.embedding.routes import Route
from shardserve.core.metadata import ShardMetadata
from shardserve.core.specs import ChunkShardingSpec, EnumerableShardingSpec
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.server.common.rank_options import RankOptions
from shardserve.server.launcher import LocalCluster

ROWS, DIM = 50, 12
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _spec(boxes: list[tuple[tuple[int, int], tuple[int, int], int]]) -> EnumerableShardingSpec:
    return EnumerableShardingSpec([ShardMetadata(o, s, f"rank:{r}/cpu") for o, s, r in boxes])


LAYOUTS = {
    "rows-uneven": _spec([((0, 0), (7, DIM), 0), ((7, 0), (23, DIM), 1), ((30, 0), (20, DIM), 2)]),
    "columns": ChunkShardingSpec(1, ["rank:0/cpu", "rank:1/cpu", "rank:2/cpu"]),
    "grid": _spec(
        [((0, 0), (20, 5), 0), ((0, 5), (20, 7), 1), ((20, 0), (30, 8), 2), ((20, 8), (30, 4), 0)]
    ),
    "table-wise": _spec([((0, 0), (ROWS, DIM), 1)]),
}


@pytest.fixture(scope="module")
def cl(cluster3: LocalCluster) -> Iterator[Cluster]:
    with connect(cluster3.address) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def tables(cl: Cluster) -> dict[tuple[str, torch.dtype], torch.Tensor]:
    """Every layout in every dtype, put on the cluster as '<layout>-<dtype>'; the local copies."""
    generator = torch.Generator().manual_seed(5)
    out = {}
    for layout, spec in LAYOUTS.items():
        for dtype in DTYPES:
            table = torch.randn(ROWS, DIM, generator=generator).to(dtype)
            cl.put(_name(layout, dtype), table, spec=spec)
            out[(layout, dtype)] = table
    return out


def _name(layout: str, dtype: torch.dtype) -> str:
    return f"{layout}-{str(dtype).removeprefix('torch.')}"


IDS = torch.tensor([3, 49, 3, 0, 17, 29, 30, 20, 19, 3, 44, 7, 6])
OFFSETS = torch.tensor([0, 3, 3, 7, 12, 13])  # an empty bag in the middle and at the end


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_lookup_is_f_embedding(cl: Cluster, tables: dict, layout: str, dtype: torch.dtype) -> None:
    table = tables[(layout, dtype)]
    remote = cl.tensor(_name(layout, dtype))
    assert torch.equal(remote.lookup(IDS), F.embedding(IDS, table))
    as_float = remote.lookup(IDS.tolist(), dtype=torch.float32)
    assert as_float.dtype == torch.float32 and torch.equal(
        as_float, F.embedding(IDS, table).float()
    )
    assert remote.lookup(torch.empty(0, dtype=torch.int64)).shape == (0, DIM)


@pytest.fixture(scope="module")
def grpc_cl(cluster3: LocalCluster) -> Iterator[Cluster]:
    with connect(cluster3.address, transport="grpc") as cluster:
        yield cluster


ID_SETS = {
    "repeats": IDS,
    "sorted-distinct": torch.tensor([0, 6, 7, 19, 20, 29, 30, 49]),
    "one": torch.tensor([33]),
    "every-row-reversed": torch.arange(ROWS).flip(0),
}


@pytest.mark.parametrize("ids", ID_SETS.values(), ids=ID_SETS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_routed_lookups_over_grpc_are_bit_for_bit(
    grpc_cl: Cluster, tables: dict, layout: str, dtype: torch.dtype, ids: torch.Tensor
) -> None:
    """The routed path (numpy plan, raw-decoded answers, one answer used whole when it holds every row)."""
    remote, expected = grpc_cl.tensor(_name(layout, dtype)), tables[(layout, dtype)][ids]
    got = remote.lookup(ids)
    assert torch.equal(got, expected) and set(grpc_cl.lookups.last_paths.values()) == {"grpc"}
    got.zero_()  # the caller's own tensor: writable, shared with nothing the next call reads
    assert torch.equal(remote.lookup(ids), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_answers_past_the_small_limit_stream(
    grpc_cl: Cluster, tables: dict, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An answer of up to SMALL_ANSWER_BYTES, counted in the table's own element size, comes as one LookupSmall
    message; one byte more and it streams (Lookup); both bit for bit."""
    import shardserve.client.paths.grpc as grpc_path

    remote, table = grpc_cl.tensor(_name("table-wise", dtype)), tables[("table-wise", dtype)]
    ids = torch.arange(ROWS)  # every row, from the one shard: one call
    used: list[str] = []
    channel = grpc_cl.session.channel
    methods = channel.shard_methods

    class Counted:
        """A multi-callable that records its use, called or as a future."""

        def __init__(self, method: object, name: str) -> None:
            self.method, self.name = method, name

        def __call__(self, *a, **k):  # type: ignore[no-untyped-def]
            used.append(self.name)
            return self.method(*a, **k)  # type: ignore[operator]

        def future(self, *a, **k):  # type: ignore[no-untyped-def]
            used.append(self.name)
            return self.method.future(*a, **k)  # type: ignore[attr-defined]

    def spy(address: str):  # type: ignore[no-untyped-def]
        real = methods(address)
        return real._replace(
            lookup_small=Counted(real.lookup_small, "small"), lookup=Counted(real.lookup, "stream")
        )

    monkeypatch.setattr(channel, "shard_methods", spy)
    answer_bytes = ROWS * DIM * dtype.itemsize
    for limit, method in ((answer_bytes, "small"), (answer_bytes - 1, "stream")):
        monkeypatch.setattr(grpc_path, "SMALL_ANSWER_BYTES", limit)
        used.clear()
        assert torch.equal(remote.lookup(ids), table[ids]) and used == [method]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_whole_row_layouts_are_read_from_mapped_shards(
    cl: Cluster, tables: dict, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same host: row-wise and table-wise tables are gathered from the mapped shards (client.embedding.mapped_rows) with
    no Lookup call, bit for bit, for one id, one band, every band and duplicates; column-split ones are routed."""
    name, table = _name(layout, torch.bfloat16), tables[(layout, torch.bfloat16)]
    remote = cl.tensor(name)
    whole_rows = layout in ("rows-uneven", "table-wise")
    if whole_rows:
        import shardserve.client.embedding.exchange as exchange

        monkeypatch.setattr(
            exchange,
            "network_call",
            lambda session, rank, receiver: pytest.fail(f"Lookup call to {rank}"),
        )
    generator = torch.Generator().manual_seed(9)
    for ids in (
        torch.tensor([49]),
        torch.tensor([8, 29, 8, 7]),
        torch.randint(0, ROWS, (500,), generator=generator),
    ):
        assert torch.equal(remote.lookup(ids), F.embedding(ids, table))
    assert cl.lookups.is_mapped(name) == whole_rows
    assert set(cl.lookups.last_paths.values()) == {"shm"}
    with pytest.raises(InvalidArgumentError, match=r"ids\[1\]=50"):
        remote.lookup([0, ROWS])  # out of range: the general path answers with its error


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bags_are_pooled_on_the_mapped_shards(
    cl: Cluster, tables: dict, layout: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same host: bags are pooled on the mapped shards with no Lookup call, bit for bit F.embedding_bag where
    one kernel call sees every row (whole-row shards stitched side by side, one row band); a grid's float32
    bags over two row bands are summed band by band, its float16/bfloat16 ones gathered and pooled whole."""
    import shardserve.client.embedding.exchange as exchange

    table, remote = tables[(layout, dtype)], cl.tensor(_name(layout, dtype))
    banded = layout == "grid"
    if not (banded and dtype != torch.float32):
        monkeypatch.setattr(
            exchange,
            "network_call",
            lambda session, rank, receiver: pytest.fail(f"Lookup call to {rank}"),
        )
    weights = torch.linspace(-1, 2, IDS.numel()).to(dtype)
    for mode, per_id in (("sum", None), ("mean", None), ("sum", weights)):
        got = remote.lookup_bag(IDS, OFFSETS, mode, per_id)
        want = F.embedding_bag(IDS, table, OFFSETS, mode=mode, per_sample_weights=per_id)
        if banded and dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(got, want), (mode, per_id is not None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_lookup_bag_is_f_embedding_bag(
    cl: Cluster, tables: dict, layout: str, dtype: torch.dtype, mode: str
) -> None:
    table = tables[(layout, dtype)]
    remote = cl.tensor(_name(layout, dtype))
    expected = F.embedding_bag(IDS, table, OFFSETS, mode=mode)
    pooled = remote.lookup_bag(IDS, OFFSETS, mode=mode)
    assert pooled.dtype == dtype and pooled.shape == (OFFSETS.numel(), DIM)
    torch.testing.assert_close(pooled, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    assert torch.equal(pooled[1], torch.zeros(DIM, dtype=dtype)) and torch.equal(
        pooled[-1], pooled[1]
    )
    assert torch.equal(remote.lookup_bag(IDS, OFFSETS, mode=mode, pooling="client"), expected)
    if (
        layout == "table-wise" and dtype != torch.bfloat16
    ):  # one shard pools every bag: torch's own kernel
        assert torch.equal(pooled, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["rows-uneven", "grid"])
def test_per_sample_weights(cl: Cluster, tables: dict, layout: str, dtype: torch.dtype) -> None:
    table = tables[(layout, dtype)]
    weights = torch.linspace(-1, 2, IDS.numel()).to(dtype)
    remote = cl.tensor(_name(layout, dtype))
    expected = F.embedding_bag(IDS, table, OFFSETS, mode="sum", per_sample_weights=weights)
    torch.testing.assert_close(
        remote.lookup_bag(IDS, OFFSETS, "sum", weights),
        expected,
        atol=4 * TOLERANCE[dtype],
        rtol=4 * TOLERANCE[dtype],
    )
    assert torch.equal(remote.lookup_bag(IDS, OFFSETS, "sum", weights, pooling="client"), expected)


def test_bags_within_one_shard_are_bit_for_bit(cl: Cluster, tables: dict) -> None:
    table = tables[("rows-uneven", torch.float32)]
    ids, offsets = torch.tensor([1, 6, 1, 8, 29, 10, 31, 49, 49]), torch.tensor([0, 3, 6])
    remote = cl.tensor(_name("rows-uneven", torch.float32))
    for mode in ("sum", "mean"):
        assert torch.equal(
            remote.lookup_bag(ids, offsets, mode), F.embedding_bag(ids, table, offsets, mode=mode)
        )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_modules_are_drop_in(cl: Cluster, tables: dict, layout: str) -> None:
    table = tables[(layout, torch.float32)]
    name = _name(layout, torch.float32)
    ids2d = IDS[:12].view(3, 4)
    assert torch.equal(RemoteEmbedding(cl, name)(ids2d), nn.Embedding.from_pretrained(table)(ids2d))
    for mode in ("sum", "mean"):
        local = nn.EmbeddingBag.from_pretrained(table, mode=mode)
        remote = RemoteEmbeddingBag(cl, name, mode=mode, pooling="client")
        assert torch.equal(remote(IDS, OFFSETS), local(IDS, OFFSETS))
        assert torch.equal(remote(ids2d), local(ids2d))
        torch.testing.assert_close(RemoteEmbeddingBag(cl, name, mode=mode)(ids2d), local(ids2d))
    weights = torch.rand(12).view(3, 4)
    local = nn.EmbeddingBag.from_pretrained(table, mode="sum")
    torch.testing.assert_close(
        RemoteEmbeddingBag(cl, name, mode="sum")(ids2d, per_sample_weights=weights),
        local(ids2d, per_sample_weights=weights),
    )


def test_modules_reject_what_torch_rejects(cl: Cluster, tables: dict) -> None:
    with pytest.raises(TypeError, match="input must hold integers"):
        RemoteEmbedding(cl, _name("grid", torch.float32))(torch.tensor([[1.0, 2.0]]))
    bag = RemoteEmbeddingBag(cl, _name("grid", torch.float32))
    with pytest.raises(ValueError, match="offsets"):
        bag(IDS)
    with pytest.raises(ValueError, match="offsets"):
        bag(IDS.view(1, -1), OFFSETS)
    with pytest.raises(ValueError, match="offsets\\[0\\]"):
        bag(IDS, torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="per_sample_weights"):
        bag(IDS, OFFSETS, torch.ones(IDS.numel()))  # mode mean
    with pytest.raises(InvalidArgumentError, match="pooling must be one of"):
        RemoteEmbeddingBag(
            cl, _name("grid", torch.float32), pooling="nearby"
        )  # at construction, not first use
    with pytest.raises(TypeError, match="cluster must be a client.Cluster"):
        RemoteEmbedding(None, "t")
    with pytest.raises(InvalidArgumentError, match="name must be a non-empty string, got 5"):
        RemoteEmbeddingBag(cl, 5)
    summing = RemoteEmbeddingBag(cl, _name("grid", torch.float32), mode="sum")
    with pytest.raises(
        ValueError, match=r"per_sample_weights must have the shape of input \(2, 2\)"
    ):
        summing(
            IDS[:4].view(2, 2), per_sample_weights=torch.ones(4)
        )  # nn.EmbeddingBag refuses it too
    with pytest.raises(ValueError, match="per_sample_weights must be a dense tensor holding data"):
        summing(IDS[:4], torch.tensor([0]), per_sample_weights=torch.ones(4, device="meta"))
    with pytest.raises(TypeError, match="default_row has dtype torch.complex64"):
        cl.put(
            "complex-default",
            torch.zeros(3, 2),
            oov="default",
            default_row=torch.ones(2, dtype=torch.complex64),
        )


def test_cluster_lookup_several_tables(cl: Cluster, tables: dict) -> None:
    names = {layout: _name(layout, torch.float16) for layout in LAYOUTS}
    answers = cl.lookup(
        {name: IDS[i:] for i, name in enumerate(names.values())}, dtype=torch.float32
    )
    for i, (layout, name) in enumerate(names.items()):
        assert torch.equal(
            answers[name], F.embedding(IDS[i:], tables[(layout, torch.float16)]).float()
        )


def test_out_of_range_ids_name_the_first_bad_id(cl: Cluster, tables: dict) -> None:
    remote = cl.tensor(_name("grid", torch.float32))
    with pytest.raises(InvalidArgumentError, match=r"ids\[2\]=50 is out of range") as info:
        remote.lookup([1, 2, 50, -1])
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(InvalidArgumentError, match=r"ids\[1\]=-3"):
        remote.lookup_bag([1, -3, 99], [0])
    assert torch.equal(remote.lookup([0]), tables[("grid", torch.float32)][:1])  # still serving


@pytest.mark.parametrize("oov", ["zero", "default"])
def test_oov_policies(cl: Cluster, oov: str) -> None:
    table = torch.randn(20, 6)
    default = torch.arange(6, dtype=torch.float32) if oov == "default" else None
    name = f"oov-{oov}"
    remote = cl.put(
        name,
        table,
        spec=ChunkShardingSpec(0, ["rank:0/cpu", "rank:2/cpu"]),
        oov=oov,
        default_row=default,
    )
    fill = default if default is not None else torch.zeros(6)
    ids = torch.tensor([3, 20, -1, 19, 3, 1000])
    padded = torch.cat([table, fill.view(1, -1)])
    mapped = torch.where((ids < 0) | (ids >= 20), torch.tensor(20), ids)
    assert torch.equal(remote.lookup(ids), F.embedding(mapped, padded))
    offsets = torch.tensor([0, 2, 4])
    for mode in ("sum", "mean"):
        assert torch.equal(
            remote.lookup_bag(ids, offsets, mode),
            F.embedding_bag(mapped, padded, offsets, mode=mode),
        )
    assert torch.equal(RemoteEmbedding(cl, name)(ids), F.embedding(mapped, padded))


def test_bad_oov_arguments(cl: Cluster) -> None:
    with pytest.raises(InvalidArgumentError, match="oov"):
        cl.put("bad-oov", torch.zeros(4, 2), oov="nearest")
    with pytest.raises(InvalidArgumentError, match="default_row"):
        cl.put("bad-oov", torch.zeros(4, 2), oov="default")
    with pytest.raises(InvalidArgumentError, match="default_row"):
        cl.create("bad-oov", (4, 2), oov="default", default_row=torch.zeros(3))
    assert "bad-oov" not in cl


# ---------------------------------------------------------------- hostile requests straight to a rank


def _rank_stub(cluster: LocalCluster, cl: Cluster, rank: int) -> pb_grpc.ShardServerStub:
    address = next(r.address for r in cl.ranks() if r.rank == rank)
    return pb_grpc.ShardServerStub(grpc.insecure_channel(address))


def _lookup_code(stub: pb_grpc.ShardServerStub, *items: pb.LookupItem) -> grpc.StatusCode:
    try:
        list(stub.Lookup(pb.LookupRequest(items=list(items)), timeout=10))
    except grpc.RpcError as err:
        return err.code(), err.details()
    return grpc.StatusCode.OK, ""


def test_hostile_lookups_get_status_codes(
    cluster3: LocalCluster, cl: Cluster, tables: dict
) -> None:
    remote = cl.tensor(_name("rows-uneven", torch.float32))
    stub = _rank_stub(cluster3, cl, 1)  # shard 1: rows 7..29
    item = dict(name=remote.name, version=remote.version, shard_index=1)
    ok = pb.LookupItem(ids=torch.tensor([7, 29]).numpy().tobytes(), **item)
    assert _lookup_code(stub, ok)[0] == grpc.StatusCode.OK
    code, details = _lookup_code(stub, ok, pb.LookupItem(ids=b"\x01" * 7, **item))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "items[1].ids has 7 bytes" in details
    code, details = _lookup_code(
        stub, pb.LookupItem(ids=torch.tensor([8, 30]).numpy().tobytes(), **item)
    )
    assert (
        code == grpc.StatusCode.INVALID_ARGUMENT
        and "items[0].ids[1]=30 is not held by shard 1" in details
    )
    code, details = _lookup_code(
        stub, pb.LookupItem(ids=torch.tensor([-5]).numpy().tobytes(), **item)
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "ids[0]=-5 is out of range" in details
    code, _ = _lookup_code(stub, pb.LookupItem(ids=b"", **{**item, "shard_index": 0}))
    assert code == grpc.StatusCode.INVALID_ARGUMENT  # shard 0 lives on rank 0
    code, _ = _lookup_code(
        stub, pb.LookupItem(ids=b"", **{**item, "version": remote.version + 1000})
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    code, _ = _lookup_code(
        stub, pb.LookupItem(name="no-such-table", version=1, shard_index=0, ids=b"")
    )
    assert code == grpc.StatusCode.NOT_FOUND
    code, details = _lookup_code(
        stub, pb.LookupItem(ids=b"", pooled=True, offsets=b"\x00" * 5, **item)
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "offsets" in details
    vector = cl.put("vector-1d", torch.arange(9.0), spec=ChunkShardingSpec(0, ["rank:1/cpu"]))
    code, details = _lookup_code(
        stub,
        pb.LookupItem(
            name="vector-1d",
            version=vector.version,
            shard_index=0,
            ids=torch.tensor([1]).numpy().tobytes(),
        ),
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "2-D" in details
    with pytest.raises(InvalidArgumentError, match="2-D"):
        vector.lookup([1])
    assert torch.equal(
        remote.lookup([7, 29]), tables[("rows-uneven", torch.float32)][[7, 29]]
    )  # still serving


def test_hostile_write_rows(cluster3: LocalCluster, cl: Cluster, tables: dict) -> None:
    remote = cl.tensor(_name("rows-uneven", torch.float32))
    stub = _rank_stub(cluster3, cl, 1)
    request = pb.WriteRowsRequest(
        name=remote.name,
        version=remote.version,
        shard_index=1,
        ids=torch.tensor([7]).numpy().tobytes(),
        values=torch.zeros(DIM).numpy().tobytes(),
    )
    with pytest.raises(grpc.RpcError) as info:
        stub.WriteRows(request, timeout=10)
    assert (
        info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    )  # committed versions are immutable
    assert torch.equal(remote.lookup([7]), tables[("rows-uneven", torch.float32)][[7]])


def test_request_over_the_limit_is_resource_exhausted(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    small = make_cluster(ranks=2, rank_options=RankOptions(max_request_bytes=4096))
    with connect(small.address) as cluster:
        table = torch.randn(1000, 4)
        remote = cluster.put("limited", table)
        with pytest.raises(ResourceExhaustedError, match="max_request_bytes"):
            remote.lookup(torch.arange(1000))
        with pytest.raises(ResourceExhaustedError, match="max_request_bytes"):
            remote.lookup_bag(torch.arange(1000), torch.arange(0, 1000, 2))
        assert torch.equal(remote.lookup([0, 999]), table[[0, 999]])


# ---------------------------------------------------------------- updates, versions and the row cache


def test_update_rows_last_duplicate_wins(cl: Cluster) -> None:
    table = torch.randn(30, 4)
    remote = cl.put(
        "updated",
        table,
        spec=LAYOUTS["grid"].__class__(
            [
                ShardMetadata((0, 0), (10, 4), "rank:0/cpu"),
                ShardMetadata((10, 0), (20, 4), "rank:1/cpu"),
                ShardMetadata((10, 0), (20, 4), "rank:2/cpu"),
            ]
        ),
    )  # rows 10..29 replicated on ranks 1 and 2
    before = remote.version
    ids = torch.tensor([3, 15, 3, 29])
    values = torch.arange(16, dtype=torch.float32).view(4, 4)
    version = remote.update_rows(ids, values)
    assert version > before and remote.version == version
    expected = table.clone()
    expected[15], expected[3], expected[29] = values[1], values[2], values[3]
    assert torch.equal(remote[:], expected)  # every replica was written
    assert torch.equal(remote.lookup(torch.arange(30)), expected)
    with pytest.raises(InvalidArgumentError, match=r"ids\[0\]=30"):
        remote.update_rows([30], torch.zeros(1, 4))
    with pytest.raises(InvalidArgumentError, match="values has shape"):
        remote.update_rows([1], torch.zeros(2, 4))
    with pytest.raises(TypeError, match="values has dtype torch.complex64"):
        remote.update_rows(
            [1], torch.zeros(1, 4, dtype=torch.complex64)
        )  # would drop the imaginary part
    with pytest.raises(TypeError, match="ids must hold integers"):
        remote.update_rows([1.5], torch.zeros(1, 4))
    assert cl.tensor("updated").version == version
    pending = cl.session.call("ListTensors", pb.ListTensorsRequest(include_pending=True)).tensors
    assert [t.version for t in pending if t.name == "updated"] == [
        version
    ]  # no copy was made for bad input
    assert (
        remote.update_rows([2], torch.full((1, 4), 7, dtype=torch.int64)) > version
    )  # widening is fine
    assert torch.equal(remote[2], torch.full((4,), 7.0))


def test_stale_client_refreshes_once(cluster3: LocalCluster, cl: Cluster) -> None:
    cl.put(
        "stale",
        torch.zeros(12, 3),
        spec=ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu", "rank:2/cpu"]),
    )
    with connect(cluster3.address) as reader:
        assert torch.equal(reader.lookup({"stale": [1, 11]})["stale"], torch.zeros(2, 3))
        cl.update_rows("stale", torch.arange(12), torch.ones(12, 3))
        assert torch.equal(reader.lookup({"stale": [1, 11]})["stale"], torch.ones(2, 3))
        assert torch.equal(
            reader.tensor("stale").lookup_bag([1, 11], [0], "sum"), torch.full((1, 3), 2.0)
        )


def test_concurrent_updates_and_lookups_never_mix_versions(
    cluster3: LocalCluster, cl: Cluster
) -> None:
    rows = 60
    spec = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu", "rank:2/cpu"])
    cl.put("versions", torch.zeros(rows, 4), spec=spec)
    ids = torch.arange(rows).flip(0)
    errors: list[str] = []
    seen: set[float] = set()
    stop = threading.Event()

    def reader() -> None:
        with connect(cluster3.address) as client:
            while not stop.is_set():
                try:
                    answer = client.lookup({"versions": ids})["versions"]
                    bag = client.tensor("versions").lookup_bag(ids, [0, 30], "sum")
                except Exception as err:  # noqa: BLE001 - collected and failed below
                    errors.append(repr(err))
                    return
                if not bool((answer == answer[0, 0]).all()):
                    errors.append(
                        f"rows of several versions in one answer: {answer[:, 0].unique().tolist()}"
                    )
                if not bool((bag == bag[0, 0]).all()):
                    errors.append(f"bags of several versions in one answer: {bag[:, 0].tolist()}")
                seen.add(float(answer[0, 0]))

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        for k in range(1, 7):
            cl.update_rows("versions", torch.arange(rows), torch.full((rows, 4), float(k)))
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a reader hung"
    assert not errors, errors[:3]
    assert seen <= {float(k) for k in range(7)} and len(seen) >= 2
    assert torch.equal(cl.lookup({"versions": ids})["versions"], torch.full((rows, 4), 6.0))


def test_row_cache_hits_and_invalidation(cluster3: LocalCluster, cl: Cluster) -> None:
    table = torch.randn(40, 8)
    cl.put("cached", table, spec=ChunkShardingSpec(1, ["rank:0/cpu", "rank:1/cpu"]))
    with connect(cluster3.address, row_cache_bytes=10 * 8 * 4, row_cache_max_age=0) as client:
        ids = torch.tensor([1, 2, 3, 1])
        assert torch.equal(client.lookup({"cached": ids})["cached"], table[ids])
        stats = client.row_cache_stats()
        assert (stats.hits, stats.misses, stats.rows) == (0, 3, 3)
        assert torch.equal(client.lookup({"cached": ids})["cached"], table[ids])
        assert client.row_cache_stats().hits == 3
        assert torch.equal(
            client.tensor("cached").lookup_bag(ids, [0, 2], "mean"),
            F.embedding_bag(ids, table, torch.tensor([0, 2]), mode="mean"),
        )
        client.lookup({"cached": torch.arange(40)})
        stats = client.row_cache_stats()
        assert stats.rows == 10 and stats.bytes == 10 * 8 * 4  # bounded: LRU evicted the rest
        cl.update_rows("cached", [39], torch.zeros(1, 8))
        assert torch.equal(
            client.lookup({"cached": [39]})["cached"], torch.zeros(1, 8)
        )  # refreshed, not stale
    with pytest.raises(ValueError, match="row_cache_bytes"):
        connect(cluster3.address, row_cache_bytes=-1)


def test_large_answers_stream_in_chunks(cluster3: LocalCluster, cl: Cluster, tables: dict) -> None:
    remote = cl.tensor(_name("rows-uneven", torch.float32))
    table = tables[("rows-uneven", torch.float32)]
    stub = _rank_stub(cluster3, cl, 1)
    ids = torch.randint(7, 30, (100_000,))  # 4.8 MB of rows, all held by shard 1
    request = pb.LookupRequest(
        items=[
            pb.LookupItem(
                name=remote.name, version=remote.version, shard_index=1, ids=ids.numpy().tobytes()
            )
        ]
    )
    with pytest.raises(grpc.RpcError) as info:
        stub.LookupSmall(request, timeout=30)
    assert (
        info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        and "streaming Lookup" in info.value.details()
    )
    chunks = list(stub.Lookup(request, timeout=30))
    assert (
        len(chunks) == 5
        and chunks[0].version == remote.version
        and chunks[0].nbytes == 100_000 * DIM * 4
    )
    data = b"".join(c.data for c in chunks)
    assert torch.equal(
        torch.frombuffer(bytearray(data), dtype=torch.float32).view(-1, DIM), table[ids]
    )
    assert torch.equal(remote.lookup(ids), table[ids])  # the client streams it too
    tiny = pb.LookupRequest(
        items=request.items, chunk_bytes=1
    )  # floored at 4 KiB, not 4.8 million messages
    assert len(list(stub.Lookup(tiny, timeout=30))) == -(-100_000 * DIM * 4 // 4096)


@pytest.mark.parametrize("pooling", ["server", "client"])
def test_ids_in_no_bag_of_a_float64_table(cl: Cluster, pooling: str) -> None:
    """Empty offsets with ids are zero bags; pooled with torch as is, a float64 table crashed the rank (or the
    client) with a segfault."""
    table = torch.randn(20, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    remote = cl.put(
        f"f64-bags-{pooling}",
        table,
        spec=ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu", "rank:2/cpu"]),
    )
    got = remote.lookup_bag([1, 2, 19], [], pooling=pooling)
    assert got.shape == (0, 4) and got.dtype == torch.float64
    assert torch.equal(
        remote.lookup_bag([1, 19], [0], pooling=pooling), (table[1] + table[19]).unsqueeze(0) / 2
    )
    cl.delete(remote.name)


def test_ids_must_be_1d_integers(cl: Cluster, tables: dict) -> None:
    remote = cl.tensor(_name("columns", torch.float32))
    with pytest.raises(TypeError, match="integers"):
        remote.lookup(torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="integers"):
        remote.lookup_bag(torch.tensor([True]), [0])
    with pytest.raises(InvalidArgumentError, match="1-D"):
        remote.lookup(torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(TypeError):
        cl.lookup([(remote.name, [1])])
    for not_ints in (
        [1.7, 2.2],
        [True, False],
        np.array([1.0, 2.0]),
        ["1"],
    ):  # never cut or taken as 0/1
        with pytest.raises(TypeError, match=r"ids\['columns-float32'\] must hold integers"):
            remote.lookup(not_ints)
    assert torch.equal(
        remote.lookup(np.array([4, 2], dtype=np.uint8)), tables[("columns", torch.float32)][[4, 2]]
    )
    assert torch.equal(
        remote.lookup(torch.tensor([4], dtype=torch.int32)), tables[("columns", torch.float32)][[4]]
    )


@pytest.mark.parametrize("transport", ["auto", "grpc"])
def test_lookups_follow_a_replaced_table(
    cluster3: LocalCluster, transport: str, monkeypatch
) -> None:
    """Ids out of the cached view's range are answered without asking a rank, so the view must not outlive the
    table: this client's own put forgets it at once, and another client's put is seen once the view is older
    than OOV_RECHECK_S."""
    import shardserve.client.embedding.views as views_module

    small, grown = torch.randn(4, 3), torch.randn(8, 3)
    name = f"replaced-{transport}"
    with connect(cluster3.address, transport=transport) as mine, connect(cluster3.address) as other:
        remote = mine.put(name, small, oov="zero")
        assert torch.equal(remote.lookup([0, 6]), torch.stack([small[0], torch.zeros(3)]))
        remote = mine.put(name, grown, overwrite=True)  # oov "error" now, and 8 rows
        assert torch.equal(remote.lookup([6]), grown[6:7])
        assert torch.equal(
            remote.lookup_bag([6, 7], [0]),
            F.embedding_bag(torch.tensor([6, 7]), grown, torch.tensor([0])),
        )
        bigger = torch.randn(12, 3)
        other.put(name, bigger, overwrite=True)  # another client: this one learns of it by age
        monkeypatch.setattr(views_module, "OOV_RECHECK_S", 0.0)
        assert torch.equal(mine.lookup({name: [10, 1]})[name], bigger[[10, 1]])
        mine.delete(name)


def test_ids_on_a_gpu_would_be_gathered_from_mapped_cpu_rows(cl, tables, cluster3) -> None:
    """The route of ids on a device, from what each rank's path maps: CPU ranks on this host are read from
    their mapped rows (the result copied up), over the network they are looked up as CPU ids are."""
    name = _name("rows-uneven", torch.float32)
    assert cl.lookups.route(name, "cuda") is Route.HOST_MAPPED
    assert cl.lookups.route(name, "cpu") is Route.HOST_MAPPED
    with connect(cluster3.address, transport="grpc") as over_grpc:
        assert over_grpc.lookups.route(name, "cuda") is Route.GENERAL


@pytest.mark.parametrize("dtype", DTYPES)
def test_lookups_on_the_ids_device_match_the_modules(cl, tables, dtype: torch.dtype) -> None:
    name, table = _name("rows-uneven", dtype), tables[("rows-uneven", dtype)]
    assert torch.equal(cl.lookups.lookup_on(name, IDS), F.embedding(IDS, table))
    for mode in ("sum", "mean"):
        pooled = cl.lookups.lookup_bag_on(name, IDS, OFFSETS, mode)
        assert torch.equal(pooled, F.embedding_bag(IDS, table, OFFSETS, mode=mode))
