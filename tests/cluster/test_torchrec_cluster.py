"""shardserve.torchrec on a real 3-rank cluster: RemoteEmbeddingBagCollection and RemoteEmbeddingCollection
answer as TorchRec's own EmbeddingBagCollection / EmbeddingCollection holding the same weights.

Tables row-wise, column-wise, table-wise and in a grid over the 3 ranks; features shared by tables and tables
shared by features; SUM and MEAN; per-id weights; empty bags; batches of 1 and 1,000; int32 and int64 ids,
lengths and offsets; out-of-range ids; from a snapshot that spmd.put_state_dict wrote; every forward one call
per rank. Read over shared memory (pooled here), gRPC and the bulk port (pooled by the ranks). A 2-rank
cluster of its own loses a rank to SIGKILL under replicas=2 tables.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from waiting import wait_until

from shardserve import Cluster, InvalidArgumentError, connect, spmd
from shardserve.client.embedding import lookup as lookup_module
from shardserve.core.metadata import ShardMetadata
from shardserve.core.specs import ChunkShardingSpec, EnumerableShardingSpec
from shardserve.server.launcher import LocalCluster

torchrec = pytest.importorskip("torchrec")

from torchrec import (  # noqa: E402 - after the skip
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    PoolingType,
)

from shardserve.torchrec import (  # noqa: E402
    RemoteEmbeddingBagCollection,
    RemoteEmbeddingCollection,
)

TRANSPORTS = ["auto", "grpc", "bulk"]  # auto: shared memory on this host, bags pooled here
RANKS = ["rank:0/cpu", "rank:1/cpu", "rank:2/cpu"]
WAIT_S = 30.0


def _grid(rows: int, dim: int) -> EnumerableShardingSpec:
    """Table-column-wise: two row bands, each cut in two column blocks, over the 3 ranks."""
    top, left = rows // 2, dim // 2
    return EnumerableShardingSpec(
        [
            ShardMetadata((0, 0), (top, left), "rank:0/cpu"),
            ShardMetadata((0, left), (top, dim - left), "rank:1/cpu"),
            ShardMetadata((top, 0), (rows - top, left), "rank:2/cpu"),
            ShardMetadata((top, left), (rows - top, dim - left), "rank:0/cpu"),
        ]
    )


def _configs() -> list[EmbeddingBagConfig]:
    """Four tables: f_a is looked up in two tables, t_rows serves two features."""
    return [
        EmbeddingBagConfig(
            name="t_rows", num_embeddings=1000, embedding_dim=16, feature_names=["f_a", "f_b"]
        ),
        EmbeddingBagConfig(
            name="t_cols",
            num_embeddings=500,
            embedding_dim=12,
            feature_names=["f_c"],
            pooling=PoolingType.MEAN,
        ),
        EmbeddingBagConfig(
            name="t_table", num_embeddings=300, embedding_dim=8, feature_names=["f_d", "f_a"]
        ),
        EmbeddingBagConfig(
            name="t_grid",
            num_embeddings=200,
            embedding_dim=10,
            feature_names=["f_e"],
            pooling=PoolingType.MEAN,
        ),
    ]


SPECS = {
    "t_rows": None,  # the default: rows over every rank
    "t_cols": ChunkShardingSpec(1, RANKS),
    "t_table": ChunkShardingSpec(0, ["rank:2/cpu"]),
    "t_grid": _grid(200, 10),
}


def _ebc(configs: list, seed: int, is_weighted: bool = False) -> EmbeddingBagCollection:
    torch.manual_seed(seed)
    return EmbeddingBagCollection(tables=configs, is_weighted=is_weighted)


def _kjt(
    ebc: EmbeddingBagCollection,
    batch: int,
    seed: int,
    *,
    id_dtype: torch.dtype = torch.int64,
    max_length: int = 6,
    weighted: bool = False,
) -> KeyedJaggedTensor:
    """A batch of every feature of `ebc` (keys in reverse order, so a table's features are not neighbours),
    lengths 0..max_length (empty bags included), ids in range of every table holding the feature."""
    generator = torch.Generator().manual_seed(seed)
    rows: dict[str, int] = {}
    for config in ebc.embedding_bag_configs():
        for feature in config.feature_names:
            rows[feature] = min(rows.get(feature, config.num_embeddings), config.num_embeddings)
    keys = sorted(rows, reverse=True)
    lengths = torch.randint(0, max_length + 1, (len(keys) * batch,), generator=generator)
    values = torch.cat(
        [
            torch.randint(0, rows[key], (int(lengths[i * batch : (i + 1) * batch].sum()),))
            for i, key in enumerate(keys)
        ]
    )
    weights = torch.rand(values.numel(), generator=generator) if weighted else None
    return KeyedJaggedTensor(
        keys=keys,
        values=values.to(id_dtype),
        lengths=lengths.to(id_dtype),
        weights=weights,
    )


def _assert_same(remote: object, local: object) -> None:
    """KeyedTensors alike: keys and widths equal, values allclose (sums over shards may add in another order),
    and the bags of one id bit for bit."""
    assert remote.keys() == local.keys()
    assert remote.length_per_key() == local.length_per_key()
    assert remote.values().dtype == local.values().dtype == torch.float32
    torch.testing.assert_close(remote.values(), local.values(), rtol=1e-6, atol=1e-7)


def _assert_single_id_bags_exact(remote: object, local: object, kjt: KeyedJaggedTensor) -> None:
    lengths = {key: kjt[key].lengths() for key in kjt.keys()}
    for key in remote.keys():
        single = lengths[key.split("@")[0]] == 1
        assert torch.equal(remote[key][single], local[key][single]), key


@pytest.fixture(scope="module")
def clients(cluster3: LocalCluster) -> Iterator[dict[str, Cluster]]:
    opened = {t: connect(cluster3.address, transport=t) for t in TRANSPORTS}
    yield opened
    for client in opened.values():
        client.close()


@pytest.fixture(scope="module")
def served(clients: dict[str, Cluster]) -> dict:
    """The unweighted and weighted models, each uploaded once (unweighted by from_module, weighted by
    from_module(upload=False) after cluster.put of its tables)."""
    writer = clients["auto"]
    plain = _ebc(_configs(), seed=1)
    RemoteEmbeddingBagCollection.from_module(writer, plain, "plain", spec=SPECS)
    sums = [c for c in _configs() if c.pooling == PoolingType.SUM]
    weighted = _ebc(sums, seed=2, is_weighted=True)
    for config in sums:
        writer.put(f"weighted/{config.name}", weighted.embedding_bags[config.name].weight.detach())
    return {"plain": plain, "weighted": weighted}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("batch", [1, 1000])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32], ids=str)
def test_ebc_forward_equals_torchrec(
    clients: dict[str, Cluster], served: dict, transport: str, batch: int, id_dtype: torch.dtype
) -> None:
    local = served["plain"]
    remote = RemoteEmbeddingBagCollection(clients[transport], _configs(), "plain")
    for seed in range(3):
        kjt = _kjt(local, batch, seed, id_dtype=id_dtype)
        want, got = local(kjt), remote(kjt)
        _assert_same(got, want)
        _assert_single_id_bags_exact(got, want, kjt)
    assert got.keys() == ["f_a@t_rows", "f_b", "f_c", "f_d", "f_a@t_table", "f_e"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_weighted_ebc_forward_equals_torchrec(
    clients: dict[str, Cluster], served: dict, transport: str
) -> None:
    local = served["weighted"]
    remote = RemoteEmbeddingBagCollection.from_module(
        clients[transport], local, "weighted", upload=False
    )
    assert remote.is_weighted
    for batch in (1, 1000):
        kjt = _kjt(local, batch, seed=batch, weighted=True)
        _assert_same(remote(kjt), local(kjt))


def test_empty_bags_and_an_empty_batch_of_ids(clients: dict[str, Cluster], served: dict) -> None:
    local = served["plain"]
    remote = RemoteEmbeddingBagCollection(clients["grpc"], _configs(), "plain")
    kjt = _kjt(local, 7, seed=3, max_length=0)
    assert kjt.values().numel() == 0
    got = remote(kjt)
    _assert_same(got, local(kjt))
    assert not got.values().any()


@pytest.mark.parametrize("transport", ["auto", "grpc"])
def test_one_call_per_rank_per_forward(
    clients: dict[str, Cluster], served: dict, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every table's bags of a batch leave in one round: one send_calls, each rank at most once."""
    rounds: list[list[int]] = []
    send_calls = lookup_module.send_calls

    def counting(session, items, last_paths):  # type: ignore[no-untyped-def]
        rounds.append(sorted({item.rank for item in items}))
        return send_calls(session, items, last_paths)

    monkeypatch.setattr(lookup_module, "send_calls", counting)
    remote = RemoteEmbeddingBagCollection(clients[transport], _configs(), "plain")
    remote(_kjt(served["plain"], 64, seed=4))
    if transport == "grpc":
        assert rounds == [[0, 1, 2]]
    else:
        assert len(rounds) <= 1  # shared memory: the rows are read here, no call at all


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_out_of_range_ids_follow_the_table_policy(
    clients: dict[str, Cluster], transport: str
) -> None:
    config = EmbeddingBagConfig(
        name="t", num_embeddings=20, embedding_dim=4, feature_names=["f"], pooling=PoolingType.MEAN
    )
    local = _ebc([config], seed=5)
    weight = local.embedding_bags["t"].weight.detach()
    cluster = clients[transport]
    if transport == "auto":
        RemoteEmbeddingBagCollection.from_module(cluster, local, "oov-zero", oov="zero")
        RemoteEmbeddingBagCollection.from_module(cluster, local, "oov-error")
    kjt = KeyedJaggedTensor(
        keys=["f"], values=torch.tensor([3, 25, 4, 99, 1]), lengths=torch.tensor([2, 1, 2])
    )
    got = RemoteEmbeddingBagCollection(cluster, [config], "oov-zero")(kjt)
    padded = torch.cat([weight, torch.zeros(1, 4)])
    ids = torch.tensor([3, 20, 4, 20, 1])  # out of range -> the zero row, still counted by MEAN
    want = F.embedding_bag(ids, padded, torch.tensor([0, 2, 3]), mode="mean")
    torch.testing.assert_close(got.values(), want, rtol=1e-6, atol=1e-7)
    with pytest.raises(InvalidArgumentError, match="out of range"):
        RemoteEmbeddingBagCollection(cluster, [config], "oov-error")(kjt)


def test_configs_that_do_not_match_the_tables_are_refused(clients: dict[str, Cluster]) -> None:
    cluster = clients["auto"]
    wider = EmbeddingBagConfig(
        name="t_rows", num_embeddings=1000, embedding_dim=32, feature_names=["f_a"]
    )
    with pytest.raises(InvalidArgumentError, match="t_rows"):
        RemoteEmbeddingBagCollection(cluster, [wider], "plain")
    remote = RemoteEmbeddingBagCollection(cluster, _configs(), "plain")
    kjt = KeyedJaggedTensor(keys=["f_a"], values=torch.tensor([1]), lengths=torch.tensor([1]))
    with pytest.raises(InvalidArgumentError, match="f_b"):
        remote(kjt)


@pytest.mark.parametrize("transport", ["auto", "grpc"])
def test_ec_forward_equals_torchrec(clients: dict[str, Cluster], transport: str) -> None:
    configs = [
        EmbeddingConfig(
            name="e_rows", num_embeddings=400, embedding_dim=8, feature_names=["u", "v"]
        ),
        EmbeddingConfig(name="e_cols", num_embeddings=100, embedding_dim=8, feature_names=["w"]),
    ]
    torch.manual_seed(6)
    local = EmbeddingCollection(tables=configs, need_indices=True)
    cluster = clients[transport]
    if transport == "auto":
        RemoteEmbeddingCollection.from_module(
            cluster, local, "ec", spec={"e_cols": ChunkShardingSpec(1, RANKS)}
        )
    remote = RemoteEmbeddingCollection(cluster, configs, "ec", need_indices=True)
    generator = torch.Generator().manual_seed(7)
    lengths = torch.randint(0, 4, (3 * 50,), generator=generator)
    kjt = KeyedJaggedTensor(
        keys=["w", "v", "u"],
        values=torch.randint(0, 100, (int(lengths.sum()),), generator=generator),
        lengths=lengths,
    )
    want, got = local(kjt), remote(kjt)
    assert list(got) == list(want)
    for key in want:
        assert torch.equal(got[key].values(), want[key].values()), key
        assert torch.equal(got[key].lengths(), want[key].lengths())
        assert torch.equal(got[key].weights(), want[key].weights())


def test_from_snapshot_serves_what_put_state_dict_wrote(clients: dict[str, Cluster]) -> None:
    cluster = clients["auto"]
    local = _ebc(_configs(), seed=8)
    model = torch.nn.ModuleDict({"sparse": local})
    number = spmd.put_state_dict(cluster, model.state_dict(), "trained")
    remote = RemoteEmbeddingBagCollection.from_snapshot(cluster, "trained", _configs())
    assert all(t.name.startswith(f"trained@{number}/") for t in remote.tables)
    kjt = _kjt(local, 100, seed=9)
    _assert_same(remote(kjt), local(kjt))
    with pytest.raises(InvalidArgumentError, match="no tensor for table 'nope'"):
        RemoteEmbeddingBagCollection.from_snapshot(
            cluster,
            "trained",
            [EmbeddingBagConfig(name="nope", num_embeddings=1, embedding_dim=1)],
        )


# ---------------------------------------------------------------- replicas=2, a rank SIGKILLed

DEAD = 1


@pytest.fixture(scope="module")
def survivor(make_cluster: Callable[..., LocalCluster]) -> Iterator[dict]:
    """A 2-rank cluster holding the model with replicas=2, and a client per transport that served a batch before
    rank 1 was SIGKILLed."""
    cluster = make_cluster(ranks=2)
    local = _ebc(_configs(), seed=10)
    clients = {t: connect(cluster.address, transport=t) for t in TRANSPORTS}
    try:
        RemoteEmbeddingBagCollection.from_module(clients["auto"], local, "r2", replicas=2)
        remotes = {t: RemoteEmbeddingBagCollection(c, _configs(), "r2") for t, c in clients.items()}
        kjt = _kjt(local, 50, seed=11)
        for remote in remotes.values():
            _assert_same(remote(kjt), local(kjt))
        cluster.kill_rank(DEAD, signal.SIGKILL)
        coordinator = cluster.coordinator
        assert coordinator is not None
        wait_until(
            lambda: not coordinator.registry.rank_alive(DEAD),
            WAIT_S,
            "the coordinator to mark rank 1 dead",
        )
        yield {"local": local, "remotes": remotes}
    finally:
        for client in clients.values():
            client.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_replicated_tables_serve_after_a_rank_is_killed(survivor: dict, transport: str) -> None:
    local, remote = survivor["local"], survivor["remotes"][transport]
    for seed in range(2):
        kjt = _kjt(local, 200, seed=20 + seed)
        _assert_same(remote(kjt), local(kjt))


# ---------------------------------------------------------------- the example: train with DMP, serve from the cluster

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchrec_serving.py"
EXAMPLE_TIMEOUT_S = 400


@pytest.mark.slow
def test_the_dmp_example_serves_what_it_trained(cluster3: LocalCluster) -> None:
    """examples/torchrec_serving.py: a 2-process DMP trainer (table-wise, column-wise, table-column-wise) puts
    its state dict; an inference process serves the trainer's batches from the cluster, equal to its forward."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), cluster3.address, "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=EXAMPLE_TIMEOUT_S,
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-3000:]}"
    assert result.stdout.count("equal to the trainer's forward") == 2, result.stdout
    assert "MISMATCH" not in result.stdout
