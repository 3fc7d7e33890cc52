"""Casts in flight on a real cluster: fetch(out=...) and spmd.get_state_dict into outputs of another floating
dtype over every transport, puts that store floating tensors cast (Cluster.put and put_state_dict with dtype=,
steady puts included), integer and bool tensors never cast, refused casts naming the key; every value bit for
bit `src.to(dtype)`."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from gloo_world import World

from shardserve import InvalidArgumentError, connect, spmd
from shardserve.server.launcher import LocalCluster

FLOATING = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
PAIRS = [(a, b) for a, b in itertools.product(FLOATING, FLOATING) if a != b]
TRANSPORTS = ("shm", "bulk", "grpc")


def floats(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values spread over many magnitudes (under- and overflowing the narrower dtypes), signed zeros and infs."""
    torch.manual_seed(seed)
    wide = (
        torch.randn(shape, dtype=torch.float64)
        * torch.logspace(-45, 45, 31, dtype=torch.float64)[torch.randint(0, 31, shape)]
    )
    flat = wide.view(-1)
    flat[: min(5, flat.numel())] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 65519.0])[
        : min(5, flat.numel())
    ]
    return wide.to(dtype)


def same_bits(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Bit for bit: the same dtype, shape and bytes (so -0.0, NaN payloads and rounding all count)."""
    return (
        got.dtype == expected.dtype
        and got.shape == expected.shape
        and torch.equal(got.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8))
    )


def stored_bytes(client: Any, name: str) -> torch.Tensor:
    """Every shard of `name` read from its own rank, stitched: the bytes the ranks hold."""
    proxy = client.tensor(name)
    whole = torch.empty(tuple(proxy.shape), dtype=proxy.dtype)
    for shards in proxy.remote_shards().values():
        for shard in shards:
            box = shard.metadata.box
            view = whole
            for d, (o, n) in enumerate(zip(box.offsets, box.sizes)):
                view = view.narrow(d, o, n)
            view.copy_(shard.fetch())
    return whole


@pytest.fixture(scope="module")
def cluster(cluster2: LocalCluster) -> LocalCluster:
    """The shared 2-rank cluster (conftest)."""
    return cluster2


@pytest.fixture(scope="module")
def sources(cluster: LocalCluster) -> dict[torch.dtype, torch.Tensor]:
    """One tensor of each floating dtype, row shards on both ranks."""
    tensors = {dtype: floats((48, 37), dtype, seed=i) for i, dtype in enumerate(FLOATING)}
    with connect(cluster.address) as client:
        for dtype, tensor in tensors.items():
            client.put(f"src-{str(dtype)[6:]}", tensor)
    return tensors


# ---------------------------------------------------------------- fetch into another dtype


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_fetch_converts_into_out_of_every_other_floating_dtype(
    cluster: LocalCluster, sources: dict, transport: str
) -> None:
    with connect(cluster.address, transport=transport) as client:
        for source, target in PAIRS:
            proxy = client.tensor(f"src-{str(source)[6:]}")
            whole = torch.empty(48, 37, dtype=target)
            proxy.fetch((0, 0), (48, 37), out=whole)
            assert proxy.last_transport == transport
            assert same_bits(whole, sources[source].to(target)), (source, target)
            region = torch.empty(20, 41, dtype=target).t()  # strided, across both shards
            proxy.fetch((3, 15), (41, 20), out=region)
            assert same_bits(region, sources[source][3:44, 15:35].to(target)), (source, target)


@pytest.mark.parametrize("transport", ["bulk", "grpc"])
def test_a_large_part_over_the_network_converts_band_by_band(
    cluster: LocalCluster, transport: str
) -> None:
    source = floats(
        (6144, 512), torch.float32, seed=9
    )  # 12 MiB: 6 MiB parts, the whole in 2 bands each
    with connect(cluster.address, transport=transport) as client:
        client.put("large", source, overwrite=True)
        out = torch.empty(6144, 512, dtype=torch.bfloat16)
        client.tensor("large").fetch((0, 0), (6144, 512), out=out)
        rows = torch.empty(
            4000, 512, dtype=torch.float16
        )  # one shard's part of 8 MiB: staged bands
        client.tensor("large").fetch((10, 0), (4000, 512), out=rows)
    assert same_bits(out, source.to(torch.bfloat16))
    assert same_bits(rows, source[10:4010].to(torch.float16))


def test_a_fetch_into_a_non_floating_out_is_refused_naming_the_tensor(
    cluster: LocalCluster, sources: dict
) -> None:
    with connect(cluster.address) as client:
        client.put("ints", torch.arange(12), overwrite=True)
        with pytest.raises(InvalidArgumentError, match="'src-float32'.*float32"):
            client.tensor("src-float32").fetch(
                (0, 0), (2, 2), out=torch.empty(2, 2, dtype=torch.int32)
            )
        with pytest.raises(InvalidArgumentError, match="'ints'"):
            client.tensor("ints").fetch((0,), (12,), out=torch.empty(12, dtype=torch.float32))


# ---------------------------------------------------------------- get_state_dict into another dtype


def state() -> dict[str, Any]:
    """Small tensors (batched reads) and large ones (read alone) of every floating dtype, ints and bools."""
    tensors: dict[str, Any] = {
        f"{kind}.{str(dtype)[6:]}": floats(shape, dtype, seed=i)
        for i, (dtype, (kind, shape)) in enumerate(
            itertools.product(FLOATING, [("small", (5, 7)), ("large", (128, 160))])
        )
    }
    tensors["steps"] = torch.arange(10, dtype=torch.int64) * 7
    tensors["mask"] = torch.arange(10) % 3 == 0
    tensors["lr"] = 0.5
    return tensors


def into_of(dtype: torch.dtype) -> dict[str, Any]:
    """A target for state(): floating tensors of `dtype`, the others of their own."""
    return {
        key: torch.empty(value.shape, dtype=dtype if value.is_floating_point() else value.dtype)
        for key, value in state().items()
        if isinstance(value, torch.Tensor)
    }


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_get_state_dict_converts_into_every_floating_dtype(
    cluster: LocalCluster, transport: str
) -> None:
    source = state()
    with connect(cluster.address) as writer:
        spmd.put_state_dict(writer, source, f"mixed-{transport}", durable=False)
    with connect(cluster.address, transport=transport) as client:
        for dtype in FLOATING:
            into = into_of(dtype)
            spmd.get_state_dict(client, f"mixed-{transport}", into=into)
            assert into.pop("lr") == 0.5
            for key, tensor in into.items():
                expected = source[key].to(dtype) if source[key].is_floating_point() else source[key]
                assert same_bits(tensor, expected), (transport, dtype, key)


def test_a_get_into_a_non_floating_tensor_is_refused_naming_the_key(cluster: LocalCluster) -> None:
    with connect(cluster.address) as client:
        spmd.put_state_dict(
            client, {"w": torch.ones(3), "n": torch.ones(3, dtype=torch.int32)}, "refused-get"
        )
        for into in (
            {"w": torch.empty(3, dtype=torch.int64)},
            {"n": torch.empty(3, dtype=torch.float32)},
        ):
            (key,) = into
            with pytest.raises(spmd.SpmdError, match=f"'{key}' is torch.*in the snapshot"):
                spmd.get_state_dict(client, "refused-get", into=into)


# ---------------------------------------------------------------- puts that store a cast copy


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_put_state_dict_with_dtype_stores_floating_tensors_cast(
    cluster: LocalCluster, transport: str, creates: list[str]
) -> None:
    prefix = f"halves-{transport}"
    with connect(cluster.address, transport=transport) as client:
        for step in range(3):  # the second and third fill the snapshot the commit before reserved
            source = {
                key: value * (step + 1)
                if isinstance(value, torch.Tensor) and not value.dtype == torch.bool
                else value
                for key, value in state().items()
            }
            number = spmd.put_state_dict(
                client, source, prefix, dtype=torch.bfloat16, durable=False
            )
            snapshot = client.snapshot(prefix, number)
            for key, value in source.items():
                if not isinstance(value, torch.Tensor):
                    continue
                expected = value.to(torch.bfloat16) if value.is_floating_point() else value
                assert snapshot[key].dtype == expected.dtype, key
                assert same_bits(stored_bytes(client, snapshot[key].name), expected), (step, key)
            floating = sum(
                v.numel()
                for v in source.values()
                if isinstance(v, torch.Tensor) and v.is_floating_point()
            )
            others = sum(
                v.numel() * v.element_size()
                for v in source.values()
                if isinstance(v, torch.Tensor) and not v.is_floating_point()
            )
            assert client.snapshots(prefix)[-1].nbytes == floating * 2 + others
            into = into_of(torch.float32)
            spmd.get_state_dict(client, prefix, into=into)
            assert same_bits(
                into["large.float64"], source["large.float64"].to(torch.bfloat16).float()
            )
        assert creates == [prefix]  # the steady puts filled the reservations
        spmd.put_state_dict(client, state(), prefix, durable=False)  # no dtype: another layout
        assert creates == [prefix, prefix]
        assert client.snapshot(prefix)["large.float64"].dtype == torch.float64


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_cluster_put_with_dtype_stores_the_cast_and_keeps_ints(
    cluster: LocalCluster, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with connect(cluster.address, transport=transport) as client:
        moved: list[dict[str, int]] = []
        real = client.session.write_shards
        monkeypatch.setattr(
            client.session, "write_shards", lambda w: moved.append(real(w)) or moved[-1]
        )
        for source, target in PAIRS:
            tensor = floats((40, 33), source, seed=3)
            put = client.put(f"cast-{transport}", tensor.t(), dtype=target, overwrite=True)
            assert put.dtype == target
            assert moved.pop() == {transport: 40 * 33 * target.itemsize}  # the stored bytes moved
            assert same_bits(stored_bytes(client, put.name), tensor.t().to(target)), (
                source,
                target,
            )
        ints = client.put(
            f"ints-{transport}", torch.arange(50), dtype=torch.float16, overwrite=True
        )
        assert ints.dtype == torch.int64 and same_bits(
            stored_bytes(client, ints.name), torch.arange(50)
        )


def test_refused_casts_name_the_key(cluster: LocalCluster) -> None:
    with connect(cluster.address) as client:
        with pytest.raises(InvalidArgumentError, match="'waves'.*complex64"):
            client.put("waves", torch.ones(4, dtype=torch.complex64), dtype=torch.float32)
        for dtype in (torch.int32, torch.bool, torch.complex64, "float8"):
            with pytest.raises(InvalidArgumentError, match="dtype"):
                client.put("w", torch.ones(4), dtype=dtype)
            with pytest.raises(InvalidArgumentError, match="dtype"):
                spmd.put_state_dict(client, {"w": torch.ones(4)}, "refused", dtype=dtype)
        with pytest.raises(spmd.SpmdError, match="'layer.waves'.*complex64"):
            spmd.put_state_dict(
                client,
                {"layer": {"w": torch.ones(4), "waves": torch.ones(4, dtype=torch.complex64)}},
                "refused",
                dtype=torch.bfloat16,
            )
        assert client.snapshots("refused") == []


# ---------------------------------------------------------------- sharded DTensor targets


def job_rows_to_bf16_columns(rank: int, address: str) -> list[str]:
    """Put fp32 DTensors as Shard(0) of 2 ranks (one prefix as it is, one with dtype=float16), get both as bf16
    and fp64 Shard(1) DTensors; the keys whose local shard is not bit for bit the expected cast."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh("cpu", [0, 1])
    full = {f"w{i}": floats((96, 70 + i), torch.float32, seed=i) for i in range(3)}
    full["big"] = floats((256, 300), torch.float32, seed=7)
    wrong = []
    with connect(address) as cluster:
        put = {k: distribute_tensor(t, mesh, [Shard(0)]) for k, t in full.items()}
        spmd.put_state_dict(cluster, put, "rows32")
        spmd.put_state_dict(cluster, put, "rows16", dtype=torch.float16)
        for prefix, stored in (("rows32", torch.float32), ("rows16", torch.float16)):
            for dtype in (torch.bfloat16, torch.float64):
                into = {
                    k: distribute_tensor(torch.zeros(t.shape, dtype=dtype), mesh, [Shard(1)])
                    for k, t in full.items()
                }
                spmd.get_state_dict(cluster, prefix, into=into)
                for key, tensor in into.items():
                    cols = full[key].shape[1]
                    width = (cols + 1) // 2
                    expected = full[key][:, rank * width : (rank + 1) * width].to(stored).to(dtype)
                    if not same_bits(tensor.to_local(), expected):
                        wrong.append(f"{prefix} {dtype} {key}")
    return wrong


def test_a_two_process_job_gets_its_column_shards_cast(
    cluster: LocalCluster, world2: World
) -> None:
    answers = world2.run(job_rows_to_bf16_columns, cluster.address, timeout=180)
    assert answers == {0: [], 1: []}
