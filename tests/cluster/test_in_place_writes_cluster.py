"""Same-host writes in place: a writer maps the ranks' pending shard memory and copies each tensor in once.

On a 2-rank cluster: every dtype and strided or non-contiguous sources come back bit for bit and were written
in place; a writer SIGKILLed in the middle of its copies leaves nothing visible (the snapshot before it is still
served whole, and the next put commits); a reader of an older snapshot keeps reading exactly its bytes while
puts with keep=1 go on and reuse freed memory; a rank refuses to count a shard written in place that was not
opened for it, and refuses a writer from another host.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from typing import Any

import grpc
import pytest
import torch
from grpc_status import rpc_status
from waiting import wait_until

from shardserve import connect, spmd
from shardserve.client.cli.top import scrape, total
from shardserve.client.paths.kinds import PathKind
from shardserve.core.dtypes import dtype_to_wire
from shardserve.core.specs import ChunkShardingSpec
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.server.launcher import LocalCluster

SPEC = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"])
DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
)
WAIT_S = 60.0


@pytest.fixture(scope="module")
def cluster(cluster2: LocalCluster) -> LocalCluster:
    """The shared 2-rank cluster (conftest)."""
    return cluster2


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if dtype.is_complex or dtype.is_floating_point:
        return (torch.randn(shape, generator=generator) * 1e3).to(dtype)
    return torch.randint(0, 100, shape, generator=generator).to(dtype)


def test_every_dtype_and_strided_sources_are_written_in_place_bit_for_bit(cluster):
    state = {f"t{i}": _sample(dtype, (16, 9), i) for i, dtype in enumerate(DTYPES)}
    state["transposed"] = torch.randn(24, 16).t()  # non-contiguous
    state["stepped"] = torch.arange(400, dtype=torch.int32).reshape(20, 20)[::2, 1::3]
    state["expanded"] = torch.randn(1, 7).expand(12, 7)
    with connect(cluster.address) as client:
        mapped_before = client.session.paths.path(PathKind.SHARED_MEMORY).in_place.mapped_segments
        for _ in range(3):  # the third put fills memory the first one freed, through kept mappings
            spmd.put_state_dict(client, state, "dtypes", keep=1, durable=False)
        assert (
            client.session.paths.path(PathKind.SHARED_MEMORY).in_place.mapped_segments
            > mapped_before
        )
        into = {key: torch.zeros_like(value.contiguous()) for key, value in state.items()}
        spmd.get_state_dict(client, "dtypes", into=into)
        for key, value in state.items():
            assert into[key].dtype == value.dtype
            assert torch.equal(into[key].view(torch.uint8), value.contiguous().view(torch.uint8)), (
                key
            )
        tensor = _sample(torch.bfloat16, (33, 5), 99)
        client.put("single", tensor.t(), SPEC, durable=False)
        assert torch.equal(client.tensor("single").full_tensor(), tensor.t())


WRITER = textwrap.dedent(
    """
    import os, sys, time, torch
    from shardserve import connect, spmd
    from shardserve.client.paths import copies

    address, marker = sys.argv[1], sys.argv[2]
    copied = []
    real_copy = copies.copy_checksummed  # each shard's copy, hashed as it lands

    def copy_then_stall(*args):
        checksum = real_copy(*args)
        copied.append(1)
        if len(copied) == 3:  # some shards of the snapshot filled, the others not
            open(marker, "w").close()
            time.sleep(600)
        return checksum

    copies.copy_checksummed = copy_then_stall
    state = {f"w{i}": torch.full((64, 64), 7.0) for i in range(8)}
    with connect(address) as client:
        spmd.put_state_dict(client, state, "killed", keep=1, durable=False)
    """
)


def test_a_writer_killed_mid_copy_leaves_nothing_visible(cluster, tmp_path):
    state = {f"w{i}": torch.full((64, 64), float(i)) for i in range(8)}
    with connect(cluster.address) as client:
        first = spmd.put_state_dict(client, state, "killed", keep=1, durable=False)
        marker = tmp_path / "copying"
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, cluster.address, str(marker)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            wait_until(
                lambda: marker.exists() or writer.poll() is not None,
                WAIT_S,
                "the writer to start copying",
            )
            assert writer.poll() is None, writer.stderr.read().decode()[-2000:]
            os.kill(writer.pid, signal.SIGKILL)
        finally:
            writer.kill()
            writer.wait(timeout=30)
        into = {key: torch.zeros(64, 64) for key in state}
        assert spmd.get_state_dict(client, "killed", into=into) == first
        assert all(torch.equal(into[key], state[key]) for key in state)
        visible = {info.name for info in client.list()}
        assert not any(
            name.startswith("killed@") and name.split("/")[0] != f"killed@{first}"
            for name in visible
        ), sorted(visible)
        fresh = {key: value + 10 for key, value in state.items()}
        later = spmd.put_state_dict(client, fresh, "killed", keep=1, durable=False)
        assert later > first
        spmd.get_state_dict(client, "killed", into=into)
        assert all(torch.equal(into[key], fresh[key]) for key in state)


def test_a_reader_of_an_older_snapshot_reads_its_bytes_while_puts_reuse_memory(cluster):
    state = {f"w{i}": torch.full((128, 256), float(i)) for i in range(4)}
    wrong: list[str] = []
    reads = [0]
    with connect(cluster.address) as writer, connect(cluster.address) as reader:
        old = spmd.put_state_dict(writer, state, "pinned", keep=2, durable=False)
        tensors = {key: reader.tensor(f"pinned@{old}/{key}") for key in state}
        stop = threading.Event()

        def read_old() -> None:
            out = torch.empty(128, 256)
            while not stop.is_set():
                for i, (key, remote) in enumerate(tensors.items()):
                    try:
                        remote.fetch((0, 0), (128, 256), out=out)
                    except Exception:  # noqa: BLE001 - dropped once it leaves keep: a clean error is fine
                        continue
                    reads[0] += 1
                    if not torch.equal(out, torch.full((128, 256), float(i))):
                        wrong.append(key)

        thread = threading.Thread(target=read_old)
        thread.start()
        try:
            for step in range(1, 6):
                fresh = {key: value + 100 * step for key, value in state.items()}
                number = spmd.put_state_dict(writer, fresh, "pinned", keep=2, durable=False)
                into = {key: torch.empty(128, 256) for key in state}
                spmd.get_state_dict(writer, "pinned", into=into)
                assert all(torch.equal(into[key], fresh[key]) for key in state), step
        finally:
            stop.set()
            thread.join(timeout=WAIT_S)
        assert number > old
        assert reads[0] > 0 and not wrong, (reads[0], wrong)


def _header(name: str, version: int, shard: int, nbytes: int) -> pb.WriteShardHeader:
    return pb.WriteShardHeader(
        name=name,
        version=version,
        shard_index=shard,
        dtype=dtype_to_wire(torch.float32),
        nbytes=nbytes,
    )


def test_a_rank_refuses_unopened_in_place_shards_and_other_hosts(cluster):
    with connect(cluster.address) as client:
        client.put("served", torch.ones(8, 4), SPEC)
        version = client.tensor("served").version
        rank0 = client.session.rank_status(0).address
    stub = pb_grpc.ShardServerStub(grpc.insecure_channel(rank0))
    request = pb.WriteShardsRequest(
        shards=[_header("served", version, 0, 64)], written_in_place=True
    )
    with pytest.raises(grpc.RpcError) as caught:
        stub.WriteShards(request, timeout=10)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION or (
        caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ), caught.value.details()
    assert "shards[0]" in caught.value.details()
    status = rpc_status.from_call(caught.value)
    assert status is not None
    request = pb.OpenShardsForWriteRequest(
        shards=[_header("served", version, 0, 64)], host_id="elsewhere"
    )
    with pytest.raises(grpc.RpcError) as caught:
        stub.OpenShardsForWrite(request, timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "host_id" in caught.value.details()
    with connect(cluster.address) as client:  # still serving
        assert torch.equal(client.tensor("served").full_tensor(), torch.ones(8, 4))


def test_a_snapshot_writer_fills_the_shards_its_create_opened_with_no_call_to_the_ranks(cluster):
    """put_state_dict on one host: CreateSnapshot's answer hands out every shard's segment and the commit
    counts them written, so the writer neither opens them (OpenShardsForWrite) nor tells the ranks
    (WriteShards): one create and one commit whatever the number of tensors."""
    calls_before = _in_place_calls(cluster.address)
    state = {f"layer{i}.w": _sample(DTYPES[i % len(DTYPES)], (33, 17), i) for i in range(24)}
    with connect(cluster.address) as client:
        for step in range(3):  # new memory, then memory the snapshot before freed
            fresh = {
                key: value if value.dtype == torch.bool else value + step
                for key, value in state.items()
            }
            spmd.put_state_dict(client, fresh, "opened", keep=1, durable=False)
            into = {key: torch.empty_like(value) for key, value in fresh.items()}
            spmd.get_state_dict(client, "opened", into=into)
            assert all(torch.equal(into[key], fresh[key]) for key in fresh), step
        assert client.session.paths.path(PathKind.SHARED_MEMORY).in_place.mapped_segments > 0
    assert _in_place_calls(cluster.address) == calls_before


def _in_place_calls(address: str) -> dict[str, float]:
    """The OpenShardsForWrite and WriteShards calls every rank of the cluster at `address` has answered."""
    return _rank_calls(address, ("OpenShardsForWrite", "WriteShards"))


def _rank_calls(address: str, methods: tuple[str, ...]) -> dict[str, float]:
    """The calls of each of `methods` every rank of the cluster at `address` has answered, as its metrics
    count them."""
    with connect(address) as client:
        ranks = client.session.list_ranks().ranks
    samples = [scrape(rank.metrics_address) for rank in ranks]
    return {
        method: sum(total(s, "shardserve_rpc_requests_total", method=method) for s in samples)
        for method in methods
    }


def test_a_state_dict_read_right_after_its_put_opens_its_shards_in_one_call_per_rank(cluster):
    """The weight-sync loop: every get reads the snapshot the put before it made, whose shards this client has
    not opened yet. While their segments are new to it, it opens them with one OpenShards call per rank, not one
    OpenShard per shard; once the ranks recycle segments it maps (the third put on: the memory the snapshot
    before last freed), it finds each shard by the label the rank gave its segment and calls no rank. Every get
    reads bit for bit, and the same get again calls no rank at all. (Tensors of over 64 KiB: smaller ones are
    read in ReadRegions batches, with no shard opened.)"""
    state = {f"layer{i}.w": _sample(torch.float32, (256, 129), i) for i in range(12)}
    calls = ("OpenShard", "OpenShards")
    with connect(cluster.address) as client:
        for step in range(4):  # new memory twice, then memory the snapshot before last freed
            fresh = {key: value + step for key, value in state.items()}
            spmd.put_state_dict(client, fresh, "opens", keep=1, durable=False)
            into = {key: torch.empty_like(value) for key, value in fresh.items()}
            before = _rank_calls(cluster.address, calls)
            spmd.get_state_dict(client, "opens", into=into)
            after = _rank_calls(cluster.address, calls)
            assert all(torch.equal(into[key], fresh[key]) for key in fresh), step
            assert after["OpenShard"] == before["OpenShard"], step
            opened = after["OpenShards"] - before["OpenShards"]
            assert (1 <= opened <= 2) if step < 2 else (opened == 0), (step, opened)
            spmd.get_state_dict(client, "opens", into=into)
            assert _rank_calls(cluster.address, calls) == after, step


def test_a_restarted_writer_fills_the_memory_its_predecessor_left_in_place(cluster):
    """A trainer restarted (a new client) publishes to the prefix its predecessor published to: the ranks reuse
    memory the predecessor filled, sealed since it was served, which the new writer never mapped. It asks for
    those shards fresh (OpenShardsForWrite) and fills every shard in place from its first put: no shard's bytes
    go by the staging path (WriteShards), its later puts call no rank but the create's and commit's, and every
    get reads bit for bit."""
    state = {f"layer{i}.w": _sample(torch.float32, (256, 129), i) for i in range(8)}

    def sync(client: Any, step: int) -> None:
        fresh = {key: value + step for key, value in state.items()}
        spmd.put_state_dict(client, fresh, "restarted", keep=1, durable=False)
        into = {key: torch.empty_like(value) for key, value in fresh.items()}
        spmd.get_state_dict(client, "restarted", into=into)
        assert all(torch.equal(into[key], fresh[key]) for key in fresh), step

    with connect(cluster.address) as first:
        for step in range(3):
            sync(first, step)
    before = _in_place_calls(cluster.address)
    with connect(cluster.address) as second:
        for step in range(3, 5):  # the predecessor's memory, reserved and freed by its last puts
            sync(second, step)
        renewing = _in_place_calls(cluster.address)
        sync(second, 5)
    assert renewing["WriteShards"] == before["WriteShards"]
    assert renewing["OpenShardsForWrite"] > before["OpenShardsForWrite"]
    assert _in_place_calls(cluster.address) == renewing


def _create_request(prefix: str, writer_host_id: str) -> pb.CreateSnapshotRequest:
    from shardserve.core.metadata import TensorProperties
    from shardserve.core.wire import metadata_to_proto

    meta = SPEC.build_metadata((8, 4), TensorProperties(dtype=torch.float32))
    request = pb.CreateSnapshotRequest(prefix=prefix, keep=1, writer_host_id=writer_host_id)
    request.tensors.add(key="w", metadata=metadata_to_proto(meta))
    return request


def test_opened_shards_count_only_when_the_commit_says_they_were_written(cluster):
    """A commit without written_in_place refuses shards that CreateSnapshot opened for in-place writes (they
    are torn until then) and publishes nothing; a writer on another host is opened nothing."""
    from shardserve.protos.same_host import host_id

    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(cluster.address))
    elsewhere = stub.CreateSnapshot(_create_request("unopened", "elsewhere"), timeout=WAIT_S)
    assert [list(entry.writable) for entry in elsewhere.entries] == [[]]
    stub.AbortSnapshot(pb.AbortSnapshotRequest(prefix="unopened", number=elsewhere.number))
    created = stub.CreateSnapshot(_create_request("opened-raw", host_id()), timeout=WAIT_S)
    (entry,) = created.entries
    assert sorted(shard.shard_index for shard in entry.writable) == [0, 1]
    assert all(shard.segment.nbytes == 4 * 4 * 4 for shard in entry.writable)
    commit = pb.CommitSnapshotRequest(prefix="opened-raw", number=created.number)
    with pytest.raises(grpc.RpcError) as caught:
        stub.CommitSnapshot(commit, timeout=WAIT_S)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION, caught.value.details()
    assert rpc_status.from_call(caught.value) is not None
    assert "not fully written" in caught.value.details() or "torn" in caught.value.details()
    with connect(cluster.address) as client:
        assert not any(info.name.startswith("opened-raw@") for info in client.list())


def _segment_mappings() -> int:
    """How many mappings of rank shard segments (memfds) this process holds."""
    with open("/proc/self/maps") as maps:
        return sum("shardserve-shard" in line for line in maps)


def test_a_tensor_put_fills_the_shards_its_create_opened_with_no_call_to_the_ranks(cluster):
    """put(overwrite=True) on one host: CreateTensor's answer hands out the shards' segments and CommitTensor
    counts them written, so the writer neither opens them nor tells the ranks; every dtype, every step."""
    calls_before = _in_place_calls(cluster.address)
    with connect(cluster.address) as client:
        for step, dtype in enumerate(DTYPES):
            value = _sample(dtype, (64, 33), step)
            client.put("opened_tensor", value, overwrite=True, durable=False)
            got = client.tensor("opened_tensor").fetch((0, 0), (64, 33))
            assert got.dtype == dtype and torch.equal(got, value), dtype
    assert _in_place_calls(cluster.address) == calls_before


def test_a_tensor_create_opens_shards_only_for_a_same_host_writer_and_counts_them_when_told(
    cluster,
):
    """CreateTensor with writer_host_id answers the opened shards (none for another host); CommitTensor without
    written_in_place refuses them as not fully written and publishes nothing."""
    from shardserve.core.metadata import TensorProperties
    from shardserve.core.wire import metadata_to_proto
    from shardserve.protos.same_host import host_id

    meta = metadata_to_proto(SPEC.build_metadata((8, 4), TensorProperties(dtype=torch.float32)))
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(cluster.address))
    elsewhere = stub.CreateTensor(
        pb.CreateTensorRequest(name="raw_opened", metadata=meta, writer_host_id="elsewhere"),
        timeout=WAIT_S,
    )
    assert list(elsewhere.writable) == []
    stub.AbortTensor(pb.AbortTensorRequest(name="raw_opened", version=elsewhere.version))
    created = stub.CreateTensor(
        pb.CreateTensorRequest(name="raw_opened", metadata=meta, writer_host_id=host_id()),
        timeout=WAIT_S,
    )
    assert sorted(shard.shard_index for shard in created.writable) == [0, 1]
    assert all(shard.segment.nbytes == 4 * 4 * 4 for shard in created.writable)
    with pytest.raises(grpc.RpcError) as caught:
        stub.CommitTensor(
            pb.CommitTensorRequest(name="raw_opened", version=created.version), timeout=WAIT_S
        )
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION, caught.value.details()
    assert rpc_status.from_call(caught.value) is not None
    with connect(cluster.address) as client:
        assert "raw_opened" not in {info.name for info in client.list()}
    stub.AbortTensor(pb.AbortTensorRequest(name="raw_opened", version=created.version))


def test_a_too_long_writer_host_id_is_refused_naming_the_field(cluster):
    from shardserve.core.metadata import TensorProperties
    from shardserve.core.wire import metadata_to_proto

    meta = metadata_to_proto(SPEC.build_metadata((8, 4), TensorProperties(dtype=torch.float32)))
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(cluster.address))
    with pytest.raises(grpc.RpcError) as caught:
        stub.CreateTensor(
            pb.CreateTensorRequest(name="long_host", metadata=meta, writer_host_id="h" * 5000),
            timeout=WAIT_S,
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("writer_host_id:")


def test_a_tensor_put_every_step_cycles_through_two_sets_of_buffers(cluster):
    """put(overwrite=True) of the same tensor every step: each new version takes the memory of the version
    before the served one (its grace ends), which the writer and the reader keep mapped: no new mapping after
    the second step, and every fetch bit for bit."""
    counts = []
    with connect(cluster.address) as client:
        out = torch.empty(512, 256)
        for step in range(6):
            weights = torch.full((512, 256), float(step))
            client.put("every_step", weights, overwrite=True, durable=False)
            client.tensor("every_step").fetch((0, 0), (512, 256), out=out)
            assert torch.equal(out, weights), step
            counts.append(_segment_mappings())
    assert counts[2:] == [counts[1]] * 4, counts


def test_readers_of_a_tensor_put_every_step_read_whole_versions(cluster):
    """A reader fetching while a writer puts the tensor every step (versions reusing the memory of the one
    before last) reads one put's values whole, each time."""
    torn: list[float] = []
    reads = [0]
    with connect(cluster.address) as writer, connect(cluster.address) as reader:
        writer.put("reused", torch.zeros(512, 256), overwrite=True, durable=False)
        stop = threading.Event()

        def read() -> None:
            out = torch.empty(512, 256)
            while not stop.is_set():
                reader.tensor("reused").fetch((0, 0), (512, 256), out=out)
                reads[0] += 1
                if not torch.equal(out, torch.full_like(out, float(out[0, 0]))):
                    torn.append(float(out[0, 0]))

        thread = threading.Thread(target=read)
        thread.start()
        try:
            for step in range(1, 12):
                writer.put(
                    "reused", torch.full((512, 256), float(step)), overwrite=True, durable=False
                )
        finally:
            stop.set()
            thread.join(timeout=WAIT_S)
        assert reads[0] > 0 and not torn, (reads[0], torn)
