"""DCP checkpoints through a real 3-rank cluster: load what torch saved, save what torch loads, all bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from gloo_world import World
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharding_spec import ChunkShardingSpec as TorchChunkSpec

from shardserve import (
    AbortedError,
    Cluster,
    InvalidArgumentError,
    TensorExistsError,
    TensorNotFoundError,
    connect,
)
from shardserve.core.metadata import ShardMetadata
from shardserve.core.specs import ChunkShardingSpec, EnumerableShardingSpec
from shardserve.server.launcher import LocalCluster

SIZE = (61, 10)
GRID = EnumerableShardingSpec(
    [
        ShardMetadata((0, 0), (30, 4), "rank:0/cpu"),
        ShardMetadata((0, 4), (30, 6), "rank:1/cpu"),
        ShardMetadata((30, 0), (31, 10), "rank:2/cpu"),
    ]
)


def make_table(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(SIZE, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture(scope="module")
def cl(cluster3: LocalCluster) -> Iterator[Cluster]:
    with connect(cluster3.address) as cluster:
        yield cluster


def _dcp_save_plain(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    dcp.save(tensors, checkpoint_id=str(path), no_dist=True)


def _row_spec(world: int) -> TorchChunkSpec:
    return TorchChunkSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])


def save_sharded_tensor(rank: int, path: str, seed: int) -> None:
    """On a 2-rank world: a row-wise torch ShardedTensor of make_table(seed), saved with dcp.save."""
    table = make_table(seed)
    st = sharded_tensor.empty(_row_spec(2), *SIZE)
    for shard in st.local_shards():
        offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        shard.tensor.copy_(
            table[offsets[0] : offsets[0] + sizes[0], offsets[1] : offsets[1] + sizes[1]]
        )
    dcp.save({"trained": st}, checkpoint_id=path)


def load_into_sharded_tensor(
    rank: int, path: str, name: str, seed: int, dtype: torch.dtype
) -> bool:
    """On a 2-rank world: dcp.load into a row-wise ShardedTensor; True when every local shard is bit for bit."""
    table = make_table(seed, dtype)
    st = sharded_tensor.zeros(_row_spec(2), *SIZE, dtype=dtype)
    dcp.load({name: st}, checkpoint_id=path)
    for shard in st.local_shards():
        offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        if not torch.equal(
            shard.tensor,
            table[offsets[0] : offsets[0] + sizes[0], offsets[1] : offsets[1] + sizes[1]],
        ):
            return False
    return True


def load_into_dtensor(rank: int, path: str, name: str, seed: int, dtype: torch.dtype) -> bool:
    """On a 2-rank world: dcp.load into a DTensor sharded by columns; True when its local part is bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    dt = distribute_tensor(torch.zeros(SIZE, dtype=dtype), mesh, [Shard(1)])
    dcp.load({name: dt}, checkpoint_id=path)
    expected = make_table(seed, dtype).chunk(2, dim=1)[rank]
    return torch.equal(dt.to_local(), expected)


def test_plain_dcp_checkpoint_loads_with_another_layout(cl: Cluster, tmp_path: Path) -> None:
    table, vector = make_table(1), torch.arange(7, dtype=torch.float64)
    _dcp_save_plain(tmp_path / "plain", {"plain-table": table, "plain-vector": vector})
    assert cl.inspect_checkpoint(tmp_path / "plain") == {
        "plain-table": (SIZE, torch.float32),
        "plain-vector": ((7,), torch.float64),
    }
    seen = []
    loaded = cl.load_checkpoint(
        tmp_path / "plain",
        spec={"plain-table": GRID, "plain-vector": None},
        progress=lambda done, total: seen.append((done, total)),
    )
    assert sorted(loaded) == ["plain-table", "plain-vector"] and seen[-1][0] == seen[-1][1] > 0
    shard_bytes = sum(
        t.numel() * t.element_size() for t in (table, vector)
    )  # one copy each: no replicas here
    assert {total for _, total in seen} == {
        shard_bytes
    }  # the whole job's bytes from the first callback on
    assert [done for done, _ in seen] == sorted(done for done, _ in seen)
    assert torch.equal(cl["plain-table"][:], table) and torch.equal(cl["plain-vector"][:], vector)
    assert len(cl["plain-table"].metadata().shards_metadata) == 3
    ids = torch.tensor([60, 0, 31, 29, 0])
    assert torch.equal(cl["plain-table"].lookup(ids), F.embedding(ids, table))


def test_sharded_tensor_saved_on_two_ranks_loads_into_three(
    cl: Cluster, world2: World, tmp_path: Path
) -> None:
    path = str(tmp_path / "st")
    world2.run(save_sharded_tensor, path, 2)
    loaded = cl.load_checkpoint(
        path, names="trained", spec=ChunkShardingSpec(1, ["rank:2/cpu", "rank:0/cpu", "rank:1/cpu"])
    )
    assert loaded["trained"].sharding_spec().dim == 1
    assert torch.equal(cl["trained"][:], make_table(2))
    with pytest.raises(TensorExistsError):
        cl.load_checkpoint(path, names="trained")
    table = cl.load_checkpoint(path, names="trained", overwrite=True, dtype=torch.bfloat16)[
        "trained"
    ]
    assert table.dtype == torch.bfloat16 and torch.equal(table[:], make_table(2).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_save_checkpoint_loads_with_torch(
    cl: Cluster, world2: World, tmp_path: Path, dtype: torch.dtype
) -> None:
    name = f"to-save-{str(dtype)[6:]}"
    cl.put(name, make_table(3, dtype), spec=GRID)
    cl.put(f"{name}-also", torch.ones(4))
    path = tmp_path / "saved"
    assert cl.save_checkpoint(path, names=[name]) == [name]
    plain = {name: torch.zeros(SIZE, dtype=dtype)}
    dcp.load(plain, checkpoint_id=str(path), no_dist=True)
    assert torch.equal(plain[name], make_table(3, dtype))
    assert world2.run(load_into_sharded_tensor, str(path), name, 3, dtype) == {0: True, 1: True}
    assert world2.run(load_into_dtensor, str(path), name, 3, dtype) == {0: True, 1: True}
    assert set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata) == {
        name
    }  # only names saved


def test_save_everything_round_trips_through_the_cluster(cl: Cluster, tmp_path: Path) -> None:
    cl.put("round-trip", make_table(4), spec=ChunkShardingSpec(0, ["rank:1/cpu", "rank:2/cpu"]))
    saved = cl.save_checkpoint(tmp_path / "all")
    assert "round-trip" in saved and set(saved) == {t.name for t in cl.list()}
    cl.delete("round-trip")
    cl.load_checkpoint(tmp_path / "all", names=["round-trip"])
    assert torch.equal(cl["round-trip"][:], make_table(4))


def test_empty_tensors_are_saved_and_loaded(cl: Cluster, tmp_path: Path) -> None:
    """A tensor of zero elements gets one empty chunk, as dcp.save writes (its shards were all skipped, so the
    save answered its name while the checkpoint had no entry for it)."""
    cl.put("empty-rows", torch.empty(0, 3), spec=ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"]))
    cl.put("beside-empty", make_table(2))
    path = tmp_path / "with-empty"
    assert cl.save_checkpoint(path, names=("beside-empty", "empty-rows")) == [
        "beside-empty",
        "empty-rows",
    ]
    assert cl.inspect_checkpoint(path)["empty-rows"] == ((0, 3), torch.float32)
    plain = {"empty-rows": torch.zeros(0, 3)}
    dcp.load(plain, checkpoint_id=str(path))  # torch's own reader takes it too
    cl.delete("empty-rows")
    loaded = cl.load_checkpoint(path, names=["empty-rows"])
    assert loaded["empty-rows"].full_tensor().shape == (0, 3)
    for name in ("empty-rows", "beside-empty"):
        cl.delete(name)


def test_a_failed_load_leaves_nothing_visible(cl: Cluster, tmp_path: Path) -> None:
    path = tmp_path / "broken"
    _dcp_save_plain(path, {"broken-a": make_table(5), "broken-b": make_table(6)})
    for data_file in path.glob("*.distcp"):
        data_file.write_bytes(data_file.read_bytes()[:100])  # truncated: reading fails on the ranks
    before = {t.name for t in cl.list(include_pending=True)}
    with pytest.raises(AbortedError, match="checkpoint load") as info:
        cl.load_checkpoint(path)
    assert info.value.code == grpc.StatusCode.ABORTED
    assert {t.name for t in cl.list(include_pending=True)} == before
    cl.put("after-failure", torch.ones(3, 3))  # the cluster keeps working, collectives included
    _dcp_save_plain(tmp_path / "good", {"after-ok": make_table(7)})
    assert torch.equal(cl.load_checkpoint(tmp_path / "good")["after-ok"][:], make_table(7))


def test_a_save_replaces_the_checkpoint_at_its_path(cl: Cluster, tmp_path: Path) -> None:
    """Saved over a checkpoint of another tensor: only the new one loads, the old data files are gone, a file of
    the user's stays, no staging directory is left."""
    path = tmp_path / "replaced"
    _dcp_save_plain(path, {"first": make_table(10)})
    (path / "__7_0.distcp").write_bytes(b"a data file of an older, bigger world")
    (path / "README").write_text("mine")
    cl.put("second", make_table(11), spec=ChunkShardingSpec(0, ["rank:0/cpu", "rank:2/cpu"]))
    assert cl.save_checkpoint(path, names=["second"]) == ["second"]
    loaded = cl.load_checkpoint(path, overwrite=True)
    assert list(loaded) == ["second"] and torch.equal(loaded["second"][:], make_table(11))
    names = sorted(p.name for p in path.iterdir())
    assert (
        "README" in names
        and "__7_0.distcp" not in names
        and not any(n.startswith(".saving-") for n in names)
    )
    with pytest.raises(InvalidArgumentError, match="names is empty"):
        cl.save_checkpoint(path, names=[])
    with pytest.raises(
        InvalidArgumentError,
        match=r"timeout must be a number of seconds with 0 < timeout <= 3.1536e\+07",
    ):
        cl.save_checkpoint(path, timeout=float("inf"))


def test_bad_checkpoint_requests(cl: Cluster, tmp_path: Path) -> None:
    _dcp_save_plain(tmp_path / "ck", {"only": make_table(8)})
    with pytest.raises(TensorNotFoundError, match=r"^path \S+missing is not a DCP checkpoint"):
        cl.load_checkpoint(tmp_path / "missing")
    with pytest.raises(InvalidArgumentError, match=r"spec names \['typo'\], which are not among"):
        cl.load_checkpoint(tmp_path / "ck", spec={"typo": None})
    with pytest.raises(TensorNotFoundError, match="nope"):
        cl.load_checkpoint(tmp_path / "ck", names=["nope"])
    with pytest.raises(InvalidArgumentError, match="rank 7 is not a registered rank"):
        cl.load_checkpoint(tmp_path / "ck", spec=ChunkShardingSpec(0, ["rank:7/cpu"]))
    with pytest.raises(TensorNotFoundError, match="no-such-tensor"):
        cl.save_checkpoint(tmp_path / "out", names=["no-such-tensor"])
    assert "only" not in cl and not os.path.exists(tmp_path / "out" / ".metadata")


class _RunsCode:
    """Pickles as a call of os.system: what a hostile checkpoint's .metadata could hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("content", ["hostile", "empty", "garbage"])
def test_a_metadata_file_that_is_not_dcp_metadata_is_refused_unrun(
    cl: Cluster, tmp_path: Path, content: str
) -> None:
    import pickle

    marker = tmp_path / "ran"
    _dcp_save_plain(tmp_path / "ck", {"meta-victim": make_table(4)})
    data = {
        "hostile": pickle.dumps(_RunsCode(marker)),
        "empty": b"",
        "garbage": b"\x80\x04not a pickle",
    }[content]
    (tmp_path / "ck" / ".metadata").write_bytes(data)
    with pytest.raises(InvalidArgumentError, match="is not DCP metadata"):
        cl.load_checkpoint(tmp_path / "ck")
    assert not marker.exists() and "meta-victim" not in cl


def _cli(address: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardserve", "--coordinator", address, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_load_and_save(cluster3: LocalCluster, cl: Cluster, tmp_path: Path) -> None:
    _dcp_save_plain(tmp_path / "cli", {"cli-table": make_table(9)})
    done = _cli(cluster3.address, "load", str(tmp_path / "cli"), "--dim", "1", "--dtype", "float16")
    assert done.returncode == 0, done.stderr
    assert "loaded cli-table version" in done.stdout
    assert (
        torch.equal(cl["cli-table"][:], make_table(9).half())
        and cl["cli-table"].sharding_spec().dim == 1
    )
    done = _cli(cluster3.address, "save", str(tmp_path / "cli-out"), "--names", "cli-table")
    assert done.returncode == 0 and "saved cli-table" in done.stdout, done.stderr
    back = {"cli-table": torch.zeros(SIZE, dtype=torch.float16)}
    dcp.load(back, checkpoint_id=str(tmp_path / "cli-out"), no_dist=True)
    assert torch.equal(back["cli-table"], make_table(9).half())
    failed = _cli(cluster3.address, "load", str(tmp_path / "nowhere"))
    assert failed.returncode == 1 and "not a DCP checkpoint" in failed.stderr
