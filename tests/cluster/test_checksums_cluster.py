"""Checksums on a real cluster: every version carries its shards' xxh3-64, reads with verify=True check what
arrived, fail over from a corrupted copy to a healthy replica or raise DATA_LOSS / CHECKSUM_MISMATCH naming the
copy, `shardserve verify` finds a corrupted copy, and a shard file corrupted on disk is never served again.

Rank 2 is restarted once for the module, over a persist dir where one byte was flipped in four shard files: in two
of them its manifest's checksum was rewritten to match (the byte flipped in memory before the rank wrote the file:
the restore accepts it and the rank serves bytes that differ from the catalog's checksum), in the other two not
(the restore refuses the file).
"""

from __future__ import annotations

import json
import signal
import struct
from pathlib import Path

import grpc
import pytest
import torch
import xxhash
from loaded_host import coordinator_options
from waiting import wait_until

from shardserve import ShardsLostError, connect, spmd
from shardserve.client.cli.main import main as cli_main
from shardserve.client.errors import ChecksumMismatchError
from shardserve.core.checksums import tensor_checksum
from shardserve.core.metadata import Box, ShardMetadata
from shardserve.core.specs import ChunkShardingSpec, EnumerableShardingSpec
from shardserve.protos.errors import Reason
from shardserve.server.common.names import file_name
from shardserve.server.common.rank_options import RankOptions
from shardserve.server.supervisor import RestartPolicy

ROWS, DIM = 64, 16
ROWWISE = ChunkShardingSpec(0, ["rank:0/cpu", "rank:2/cpu"])
COLUMNS = ChunkShardingSpec(1, ["rank:1/cpu", "rank:2/cpu"])
MIRRORED = EnumerableShardingSpec(  # the first listed copy, on rank 2, is the one reads pick
    [ShardMetadata((0, 0), (ROWS, DIM), f"rank:{r}/cpu") for r in (2, 0)]
)
WAIT_S = 120.0
TABLES = {
    name: torch.randn(ROWS, DIM)
    for name in ("mirrored", "single", "on-disk-copies", "on-disk-alone")
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tmp_path_factory.mktemp("persist")


@pytest.fixture(scope="module")
def cluster(make_cluster, data):
    """Copies on a dead rank are not repaired while it restarts (repair_after); copies it lost are, at once."""
    return make_cluster(
        ranks=3,
        restart_policy=RestartPolicy(max_restarts=2, initial_backoff=0.2),
        coordinator_options=coordinator_options(heartbeat_interval=0.5, repair_after=3600),
        rank_options=RankOptions(persist_dir=data),
    )


@pytest.fixture(scope="module")
def client(cluster):
    with connect(cluster.address, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def corrupted(cluster, client, data):
    """The four tensors put, one byte of each of rank 2's shard files flipped, rank 2 restarted; the put versions."""
    layouts = {"mirrored": MIRRORED, "single": ROWWISE, "on-disk-alone": ROWWISE}
    layouts["on-disk-copies"] = MIRRORED
    puts = {name: client.put(name, TABLES[name], spec=layouts[name]).version for name in TABLES}
    for name in TABLES:
        shard_file = next((data / "rank-2" / file_name(name)).glob("v*.s*.safetensors"))
        _flip_last_byte(shard_file)
        if name in ("mirrored", "single"):
            _match_manifest(shard_file)
    old_pid = cluster.rank_pids[2]
    cluster.kill_rank(2, signal.SIGKILL)
    wait_until(
        lambda: client.ranks()[2].alive and client.ranks()[2].pid != old_pid,
        WAIT_S,
        "rank 2 to come back",
    )
    wait_until(
        lambda: (
            client.tensor("on-disk-copies").health == "healthy"
            and client.tensor("mirrored").health == "healthy"
        ),
        WAIT_S,
        "rank 2's copies to be served or repaired",
    )
    return puts


def _flip_last_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0x01]))


def _match_manifest(shard_file: Path) -> None:
    """Rewrite the checksum the manifest gives `shard_file` to the file's own (as if the byte had flipped in
    memory before the rank hashed and wrote it)."""
    raw = shard_file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    version = shard_file.name.split(".")[0]
    manifest_path = shard_file.parent / f"{version}.json"
    manifest = json.loads(manifest_path.read_text())
    for entry in manifest["shards"].values():
        if entry["file"] == shard_file.name:
            entry["xxh3_64"] = f"{xxhash.xxh3_64_intdigest(raw[8 + length :]):016x}"
    manifest_path.write_text(json.dumps(manifest))


def _boxes(table: torch.Tensor, proxy) -> dict[int, torch.Tensor]:
    """The expected bytes of each shard of `proxy`, cut from `table`."""
    out = {}
    for shards in proxy.remote_shards().values():
        for shard in shards:
            view = table
            for dim, (offset, size) in enumerate(
                zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes)
            ):
                view = view.narrow(dim, offset, size)
            out[shard.index] = view
    return out


def _copy(proxy, index: int):
    return next(s for shards in proxy.remote_shards().values() for s in shards if s.index == index)


def test_every_version_carries_its_shards_checksums_through_a_reshard(client):
    table = torch.randn(ROWS, DIM)
    client.put("kept", table, spec=ROWWISE)
    proxy = client.tensor("kept")
    for index, expected in _boxes(table, proxy).items():
        assert _copy(proxy, index).checksum == tensor_checksum(expected) != 0
    before = proxy.version
    proxy.reshard(COLUMNS)
    moved = client.tensor("kept")
    assert moved.version > before
    sums = {s.index: s.checksum for ss in moved.remote_shards().values() for s in ss}
    assert sums == {i: tensor_checksum(v) for i, v in _boxes(table, moved).items()}
    assert torch.equal(moved.fetch((0, 0), (ROWS, DIM), verify=True), table)


def test_a_state_dict_gets_with_verify_bit_for_bit(client):
    state = {"w": torch.randn(ROWS, DIM), "b": torch.arange(DIM, dtype=torch.int64)}
    spmd.put_state_dict(client, state, "verified", durable=False)
    into = {key: torch.empty_like(value) for key, value in state.items()}
    spmd.get_state_dict(client, "verified", into=into, verify=True)
    assert all(torch.equal(into[key], state[key]) for key in state)


def test_whole_shards_read_through_shared_memory_are_hashed_as_they_land(client):
    """A verified read's copy out of mapped memory hashes each whole shard as it copies it: the checksums it
    keeps are the xxh3-64 of the shards' bytes; a part of a shard is not hashed there (its checksum is over
    the whole shard)."""
    table = torch.randn(ROWS, DIM)
    client.put("landed", table, spec=ROWWISE)
    proxy = client.tensor("landed")
    whole, out = Box((0, 0), (ROWS, DIM)), torch.empty(ROWS, DIM)
    summary, parts = proxy.read_plan(whole, out)
    landed: dict[int, int] = {}
    proxy.reader.read_parts(summary, parts, whole, out, checksums=landed)
    assert proxy.last_transport == "shm"
    assert torch.equal(out, table)
    assert landed == {i: tensor_checksum(v) for i, v in _boxes(table, proxy).items()}
    half, top = Box((0, 0), (ROWS // 2 + 1, DIM)), torch.empty(ROWS // 2 + 1, DIM)
    summary, parts = proxy.read_plan(half, top)
    partial: dict[int, int] = {}
    proxy.reader.read_parts(summary, parts, half, top, checksums=partial)
    assert torch.equal(top, table[: ROWS // 2 + 1])
    assert set(partial) == {0}  # shard 0 whole, one row of shard 1: not hashed as it landed
    assert torch.equal(proxy.fetch((0, 0), (ROWS, DIM), verify=True), table)


def test_a_verify_read_fails_over_from_a_corrupted_copy_to_its_replica(cluster, corrupted):
    table = TABLES["mirrored"]
    with connect(cluster.address, timeout=30) as fresh:
        proxy = fresh.tensor("mirrored")
        assert proxy.version == corrupted["mirrored"]  # restored as it was, no repair
        out = torch.empty(ROWS, DIM)
        _, parts = proxy.read_plan(Box((0, 0), (ROWS, DIM)), out)
        assert [index for index, _ in parts] == [0]  # the copy on rank 2
        assert not torch.equal(
            proxy.fetch((0, 0), (ROWS, DIM)), table
        )  # a plain read gets the flipped byte
        assert torch.equal(proxy.fetch((0, 0), (ROWS, DIM), out=out, verify=True), table)
        assert torch.equal(proxy.fetch((0, 0), (ROWS // 2, DIM), verify=True), table[: ROWS // 2])


def test_a_verify_read_of_a_corrupted_copy_without_replica_is_data_loss(client, corrupted):
    table = TABLES["single"]
    proxy = client.tensor("single")
    with pytest.raises(ChecksumMismatchError) as raised:
        proxy.fetch((0, 0), (ROWS, DIM), verify=True)
    err = raised.value
    assert err.code == grpc.StatusCode.DATA_LOSS and err.reason == Reason.CHECKSUM_MISMATCH
    assert (err.tensor, err.shard, err.rank) == ("single", 1, 2)
    assert err.metadata == {"tensor": "single", "shard": "1", "rank": "2"}
    assert torch.equal(proxy.fetch((0, 0), (ROWS // 2, DIM), verify=True), table[: ROWS // 2])


def test_shardserve_verify_passes_a_healthy_tensor_and_names_a_corrupted_copy(
    client, corrupted, capsys
):
    client.put("healthy", TABLES["single"], spec=ROWWISE)
    assert cli_main(["--coordinator", client.address, "verify", "healthy"]) == 0
    shown = capsys.readouterr()
    assert shown.out.startswith("ok healthy version") and "2 copies checked" in shown.out
    assert cli_main(["--coordinator", client.address, "verify", "mirrored"]) == 1
    shown = capsys.readouterr()
    assert "CORRUPT mirrored version" in shown.out and "shard 0 on rank 2" in shown.out
    assert "shardserve verify: error:" in shown.err and "shard 0 on rank 2" in shown.err


def test_a_shard_file_corrupted_on_disk_is_repaired_from_a_replica(client, corrupted):
    repaired = client.tensor("on-disk-copies")
    assert repaired.version > corrupted["on-disk-copies"]
    table = TABLES["on-disk-copies"]
    assert torch.equal(repaired.fetch((0, 0), (ROWS, DIM), verify=True), table)
    assert [s.checksum for ss in repaired.remote_shards().values() for s in ss] == [
        tensor_checksum(table)
    ] * 2
    assert all(
        torch.equal(s.fetch(), table) for ss in repaired.remote_shards().values() for s in ss
    )


def test_a_shard_file_corrupted_on_disk_without_replica_is_reported_lost(client, corrupted):
    lost = client.tensor("on-disk-alone")
    assert lost.health == "lost"
    with pytest.raises(ShardsLostError) as raised:
        lost.fetch((0, 0), (ROWS, DIM), verify=True)
    assert raised.value.code == grpc.StatusCode.DATA_LOSS and raised.value.ranks == (2,)
    assert torch.equal(
        lost.fetch((0, 0), (ROWS // 2, DIM), verify=True), TABLES["on-disk-alone"][: ROWS // 2]
    )
