"""Packed state dicts against a real 2-rank cluster: spmd.put_state_dict(..., pack=True) stores the small plain
tensors in packs, and every reader (get_state_dict, Snapshot, its asyncio twin, the CLI) reads them bit for bit.

The coordinator holds one tensor per pack; casts, delta puts and steady puts with reservations work through
packs; a skeleton whose packs do not match its snapshot is refused naming the field (raw gRPC).
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import torch
from error_reasons import assert_status

from shardserve import aio, connect, spmd
from shardserve.client.cli.status import show_snapshots
from shardserve.client.errors import InvalidArgumentError
from shardserve.client.ops.snapshots import commit_snapshot, create_snapshot
from shardserve.client.packed_tensor import PackedTensor
from shardserve.client.spmd_group import SpmdError
from shardserve.core.wire import metadata_to_proto
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.protos.errors import Reason
from shardserve.server.launcher import LocalCluster

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32]
DTYPES += [torch.uint8, torch.bool]


def value(i: int, step: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Tensor `i` of step `step`: distinct per tensor and step, exact in every dtype."""
    base = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape) / 4
    base = base + i + step * 100
    if dtype == torch.bool:
        return base.to(torch.int64) % 2 == 1
    return (base.to(torch.int64) % 251).to(dtype) if not dtype.is_floating_point else base.to(dtype)


SHAPES = [(8, 4), (), (3,), (2, 3, 2), (0, 4), (33,)]


def state(step: int) -> dict:
    """Small tensors of every dtype and shape (a scalar, an empty one), one that is too large to pack, and an
    optimizer-like tree of plain values."""
    small = {
        f"layer{i}.p": value(i, step, DTYPES[i % len(DTYPES)], SHAPES[i % len(SHAPES)])
        for i in range(40)
    }
    return {
        **small,
        "embed": value(99, step, torch.float32, (256, 128)),  # 128 KiB: stored by itself
        "opt": {"step": torch.tensor(step), "lr": 0.01 * step, "betas": (0.9, 0.95)},
    }


def flat(tree: dict, path: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, v in tree.items():
        name = f"{path}{key}"
        if isinstance(v, dict):
            out.update(flat(v, f"{name}."))
        elif isinstance(v, torch.Tensor):
            out[name] = v
    return out


def zeros_like(tree: dict, dtype: torch.dtype | None = None) -> dict:
    return {
        key: zeros_like(v, dtype)
        if isinstance(v, dict)
        else torch.zeros_like(v, dtype=dtype if dtype and v.is_floating_point() else None)
        if isinstance(v, torch.Tensor)
        else None
        for key, v in tree.items()
    }


def stored_keys(client, prefix: str) -> set[str]:
    answer = client.session.call("GetSnapshot", pb.GetSnapshotRequest(prefix=prefix))
    return {entry.key for entry in answer.entries}


@pytest.fixture(scope="module")
def cluster(cluster2: LocalCluster) -> LocalCluster:
    return cluster2


def test_small_plain_tensors_are_stored_in_one_pack_and_read_back_bit_for_bit(cluster):
    with connect(cluster.address) as client:
        for step in (1, 2, 3):  # the first put, then the reserved snapshots filled in place
            number = spmd.put_state_dict(client, state(step), "packed", keep=1, pack=True)
            into = zeros_like(state(0))
            assert spmd.get_state_dict(client, "packed", into) == number
            for key, want in flat(state(step)).items():
                got = flat(into)[key]
                assert got.dtype == want.dtype and torch.equal(got, want), (step, key)
            assert into["opt"]["lr"] == 0.01 * step and into["opt"]["betas"] == (0.9, 0.95)
        assert stored_keys(client, "packed") == {"embed", "_packed.0"}


def test_a_packed_put_casts_floating_tensors_and_a_get_converts_them_as_unpacked_ones(cluster):
    with connect(cluster.address) as client:
        spmd.put_state_dict(client, state(4), "cast", keep=1, pack=True, dtype=torch.bfloat16)
        into = zeros_like(state(0), torch.float32)
        spmd.get_state_dict(client, "cast", into)
        for key, want in flat(state(4)).items():
            got = flat(into)[key]
            expected = (
                want.to(torch.bfloat16).to(torch.float32) if want.is_floating_point() else want
            )
            assert torch.equal(got, expected), key
        snapshot = client.snapshot("cast")
        assert (
            snapshot["layer0.p"].dtype == torch.bfloat16
            and snapshot["layer4.p"].dtype == torch.int64
        )
        wrong = zeros_like(state(0))
        wrong["layer4.p"] = torch.zeros(
            SHAPES[4], dtype=torch.float32
        )  # an int64 tensor read as float
        with pytest.raises(SpmdError, match="'layer4.p'"):
            spmd.get_state_dict(client, "cast", wrong)


def test_a_snapshot_reads_each_packed_tensor_whole_by_box_by_index_and_verified(cluster, capsys):
    with connect(cluster.address) as client:
        spmd.put_state_dict(client, state(5), "read", keep=1, pack=True)
        snapshot = client.snapshot("read")
        want = flat(state(5))
        assert sorted(snapshot.keys()) == sorted(want)
        packed = snapshot["layer0.p"]
        assert isinstance(packed, PackedTensor) and packed.shape == torch.Size((8, 4))
        assert torch.equal(packed.full_tensor(verify=True), want["layer0.p"])
        assert torch.equal(packed.fetch((2, 1), (3, 2)), want["layer0.p"][2:5, 1:3])
        assert torch.equal(packed[5], want["layer0.p"][5])
        out = torch.zeros(3, 2, dtype=torch.float64)
        packed.fetch((2, 1), (3, 2), out=out)
        assert torch.equal(out, want["layer0.p"][2:5, 1:3].to(torch.float64))
        with pytest.raises(InvalidArgumentError, match="exceeds"):
            packed.fetch((7, 0), (2, 4))
        whole = snapshot.read()
        assert all(torch.equal(whole[key], v) for key, v in want.items())
        show_snapshots(client, "read", tensors=True)
    shown = capsys.readouterr().out
    assert "42 tensors (41 in 1 pack)" in shown
    assert "  layer0.p\t(8, 4)\ttorch.float32\t128 bytes\tpacked in _packed.0" in shown


def test_the_asyncio_client_puts_packed_and_its_snapshot_reads_packed_tensors(cluster):
    async def put_and_read() -> tuple:
        client = await aio.connect(cluster.address)
        try:
            await client.put_state_dict(state(6), "aio", keep=1, pack=True)
            snapshot = await client.snapshot("aio")
            return (
                await snapshot["layer3.p"].full_tensor(),
                await snapshot["layer0.p"].fetch((0, 0), (2, 2)),
                await snapshot.read(),
            )
        finally:
            await client.close()

    one, part, whole = asyncio.run(put_and_read())
    want = flat(state(6))
    assert torch.equal(one, want["layer3.p"]) and torch.equal(part, want["layer0.p"][:2, :2])
    assert all(torch.equal(whole[key], v) for key, v in want.items())
    with connect(cluster.address) as client:
        assert stored_keys(client, "aio") == {"embed", "_packed.0"}


@pytest.mark.parametrize("delta", [True, "version_counters"])
def test_a_delta_put_of_a_packed_state_dict_sends_the_changed_blocks_and_reads_whole(
    cluster, delta
):
    """A pack counts as written at every put (its buffer is filled each time), so even trusting version
    counters its blocks are hashed: the changed one is sent, the rest shared."""
    prefix = f"delta-{delta}"
    with connect(cluster.address) as client:
        current = state(7)
        numbers = [
            spmd.put_state_dict(client, current, prefix, keep=2, pack=True, delta=delta)
            for _ in range(2)
        ]
        current["layer0.p"].add_(1)
        number = spmd.put_state_dict(client, current, prefix, keep=2, pack=True, delta=delta)
        last = client.snapshots(prefix)[-1]
        assert last.number == number and last.delta_of == numbers[-1]
        assert (
            0 < last.nbytes - last.shared_nbytes < last.nbytes // 2
        )  # the changed pack block, not all
        into = zeros_like(state(0))
        spmd.get_state_dict(client, prefix, into)
        assert all(torch.equal(flat(into)[key], v) for key, v in flat(current).items())


def _skeleton_with(packs: list) -> str:
    return json.dumps(
        {
            "format": 2,
            "tree": {"dict": [["a", {"tensor": "a"}], ["b", {"tensor": "b"}]]},
            "packs": packs,
        }
    )


@pytest.mark.parametrize(
    "packs, message",
    [
        (
            [
                {
                    "key": "p",
                    "nbytes": 16,
                    "items": [["a", 0, "float32", [2]], ["b", 4, "float32", []]],
                }
            ],
            "overlaps",
        ),
        (
            [{"key": "p", "nbytes": 16, "items": [["a", 0, "float32", [2]]]}],
            "refers to tensors ['b'] the snapshot lacks",
        ),
        (
            [
                {
                    "key": "p",
                    "nbytes": 12,
                    "items": [["a", 0, "float32", [2]], ["b", 8, "float32", []]],
                }
            ],
            "stored as uint8 (16,); a pack is uint8 (12,)",
        ),
    ],
)
def test_a_snapshot_whose_packs_do_not_match_it_is_refused_naming_the_skeleton(
    cluster, packs, message
):
    """CreateSnapshot (raw gRPC) and CommitSnapshot refuse the skeleton, nothing is visible, the cluster serves."""
    skeleton = _skeleton_with(packs)
    with connect(cluster.address) as client:
        layout = client.session.layouts.layout((16,), torch.uint8, None, 1)
        request = pb.CreateSnapshotRequest(prefix="badpacks", keep=1, skeleton=skeleton)
        request.tensors.add(key="p", metadata=metadata_to_proto(layout))
        with grpc.insecure_channel(cluster.address) as channel:
            with pytest.raises(grpc.RpcError) as raised:
                pb_grpc.CoordinatorStub(channel).CreateSnapshot(request, timeout=30)
        assert_status(
            raised.value,
            grpc.StatusCode.INVALID_ARGUMENT,
            Reason.INVALID_ARGUMENT,
            field="skeleton",
        )
        assert message in raised.value.details()
        created = create_snapshot(client.session, "badpacks", {"p": layout}, keep=1)
        with pytest.raises(InvalidArgumentError, match="skeleton") as refused:
            commit_snapshot(client.session, created, skeleton=skeleton)
        assert refused.value.metadata.get("field") == "skeleton" and message in str(refused.value)
        assert not client.snapshots("badpacks")
        spmd.put_state_dict(client, state(8), "after", keep=1, pack=True)  # still serving
        assert stored_keys(client, "after") == {"embed", "_packed.0"}
