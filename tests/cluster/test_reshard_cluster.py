"""Coordinated resharding on real clusters (gloo on 127.0.0.1): every layout pair, bit for bit, two-phase.

One 4-rank cluster serves the happy paths; failure tests get clusters of their own
(a rank stalled by rank/jobs/reshard.STALL_ENV, then killed, left hung or stopped
with SIGSTOP), each failure followed by a reshard that succeeds in the next epoch,
and the coordinator-restart test runs the coordinator and ranks as separate processes.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from reference import shards_of
from server_processes import fork_server, rank_env, server_env, stop_all
from waiting import wait_until

from shardserve import Reason, connect
from shardserve.client.errors import (
    InvalidArgumentError,
    RankUnavailableError,
    ShardServeError,
    TensorNotFoundError,
)
from shardserve.client.ops.reshard import ReshardRefusedError, layout_from_options
from shardserve.core.metadata import ShardedTensorMetadata, ShardMetadata, TensorProperties
from shardserve.core.specs import ChunkShardingSpec, EnumerableShardingSpec
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.server.common.rank_options import RankOptions
from shardserve.server.coordinator.drivers.reshard import (
    EXIT_AFTER_COMMIT_CODE,
    EXIT_AFTER_COMMIT_ENV,
)
from shardserve.server.launcher import free_port
from shardserve.server.rank.jobs.reshard import STALL_ENV

pytestmark = pytest.mark.timeout(300)

CPU = {r: "cpu" for r in range(4)}
STOPPED_AFTER_DEAD_S = (
    2.0  # how long a stopped rank (SIGSTOP) stays stopped once marked dead, before SIGCONT
)


def chunk(dim: int, ranks) -> ChunkShardingSpec:
    return ChunkShardingSpec(dim, [f"rank:{r}/cpu" for r in ranks])


def boxes(*shards) -> EnumerableShardingSpec:
    """EnumerableShardingSpec from (offsets, sizes, rank) triples."""
    return EnumerableShardingSpec([ShardMetadata(o, s, f"rank:{r}/cpu") for o, s, r in shards])


def grid(shape, dtype, rows, cols, ranks=(0, 1, 2, 3), dims=(0, 1)) -> ShardedTensorMetadata:
    return layout_from_options(
        shape, dtype, CPU, ranks=list(ranks), grid=f"{rows}x{cols}", grid_dims=dims
    )


def replicated(shape, dtype, ranks) -> ShardedTensorMetadata:
    return layout_from_options(shape, dtype, CPU, ranks=list(ranks), replicate=True)


def source(shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=torch.int64).to(dtype)


# (id, shape, dtype, src layout, dst layout); a layout is a spec or a function (shape, dtype) -> metadata
LAYOUT_PAIRS = [
    ("row-to-column 13x21", (13, 21), torch.float32, chunk(0, range(4)), chunk(1, range(4))),
    ("column-to-row 13x21", (13, 21), torch.int64, chunk(1, range(4)), chunk(0, range(4))),
    (
        "uneven-to-even",
        (12, 5),
        torch.float64,
        boxes(((0, 0), (1, 5), 0), ((1, 0), (4, 5), 1), ((5, 0), (7, 5), 2)),
        chunk(0, range(4)),
    ),
    (
        "even-to-uneven",
        (12, 5),
        torch.int32,
        chunk(0, range(4)),
        boxes(((0, 0), (7, 5), 3), ((7, 0), (4, 5), 1), ((11, 0), (1, 5), 0)),
    ),
    (
        "chunk-to-enumerable 7x5x3",
        (7, 5, 3),
        torch.float32,
        chunk(2, range(4)),
        boxes(((0, 0, 0), (3, 5, 3), 2), ((3, 0, 0), (4, 2, 3), 0), ((3, 2, 0), (4, 3, 3), 2)),
    ),
    ("all-ranks-to-subset", (13, 21), torch.float16, chunk(0, range(4)), chunk(1, (1, 3))),
    ("subset-to-all-ranks", (13, 21), torch.bfloat16, chunk(1, (2,)), chunk(0, (3, 0, 2, 1))),
    ("1-D-to-2x2-grid", (13, 21), torch.float32, chunk(0, range(4)), lambda s, d: grid(s, d, 2, 2)),
    (
        "2x2-grid-to-1-D",
        (7, 5, 3),
        torch.int64,
        lambda s, d: grid(s, d, 2, 2, dims=(2, 0)),
        chunk(1, range(4)),
    ),
    (
        "replicated-to-sharded",
        (13, 21),
        torch.bfloat16,
        lambda s, d: replicated(s, d, (0, 2)),
        chunk(1, range(4)),
    ),
    (
        "sharded-to-replicated",
        (7, 5, 3),
        torch.bool,
        chunk(0, range(4)),
        lambda s, d: replicated(s, d, (1, 2, 3)),
    ),
    (
        "one-to-several-shards-per-rank",
        (13, 21),
        torch.float32,
        chunk(0, range(4)),
        boxes(
            ((0, 0), (13, 5), 0), ((0, 5), (13, 5), 1), ((0, 10), (13, 5), 0), ((0, 15), (13, 6), 1)
        ),
    ),
    (
        "several-to-one-shard-per-rank",
        (13, 21),
        torch.complex64,
        boxes(((0, 0), (5, 21), 3), ((5, 0), (5, 21), 3), ((10, 0), (3, 21), 2)),
        chunk(1, (0, 1, 2)),
    ),
    ("7x5x3 across dims", (7, 5, 3), torch.float64, chunk(0, range(4)), chunk(2, (3, 2, 1))),
]


def resolve(layout, shape, dtype):
    return layout(shape, dtype) if callable(layout) else layout


def random_boxes(shape, count, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        offsets, sizes = [], []
        for n in shape:
            a, b = sorted(torch.randint(0, n + 1, (2,), generator=g).tolist())
            offsets.append(a)
            sizes.append(b - a)
        out.append((tuple(offsets), tuple(sizes)))
    return out


def region(tensor, offsets, sizes):
    view = tensor
    for d, (o, s) in enumerate(zip(offsets, sizes)):
        view = view.narrow(d, o, s)
    return view


@pytest.fixture(scope="module")
def cluster4(make_cluster):
    return make_cluster(ranks=4)


@pytest.fixture(scope="module")
def client4(cluster4):
    with connect(cluster4.address) as client:
        yield client


@pytest.mark.parametrize("case", LAYOUT_PAIRS, ids=[c[0] for c in LAYOUT_PAIRS])
def test_every_layout_pair_moves_the_data_bit_for_bit(client4, case):
    name, shape, dtype, src_layout, dst_layout = case
    tensor = source(shape, dtype, seed=len(name))
    key = "pair-" + name.replace(" ", "_")
    old = client4.put(key, tensor, spec=resolve(src_layout, shape, dtype), overwrite=True)
    dst = resolve(dst_layout, shape, dtype)
    reports = []
    new = old.reshard(dst, bucket_bytes=48, progress=reports.append)
    expected_meta = (
        dst
        if isinstance(dst, ShardedTensorMetadata)
        else dst.build_metadata(shape, TensorProperties(dtype=dtype))
    )
    assert new.version == old.version + 1
    assert new.metadata() == expected_meta
    assert client4.tensor(key).version == new.version
    assert torch.equal(new.full_tensor(), tensor)
    for offsets, sizes in random_boxes(shape, 4, seed=len(name)):
        assert torch.equal(new.fetch(offsets, sizes), region(tensor, offsets, sizes))
    shards = {shard.index: shard for per_rank in new.remote_shards().values() for shard in per_rank}
    for index, part in enumerate(
        shards_of(tensor, expected_meta)
    ):  # every replica, from its own rank
        assert torch.equal(shards[index].fetch(), part)
    phases = [r.phase for r in reports]
    assert phases[0] == "preparing" and phases[-1] == "done" and "committing" in phases
    assert (
        reports[-1].bytes_done
        == reports[-1].bytes_total
        == sum(p.numel() * p.element_size() for p in shards_of(tensor, expected_meta))
    )
    assert old.full_tensor().equal(tensor)  # the old proxy refreshes onto the new version


def test_old_version_is_freed_and_memory_stays_within_new_shards_plus_buckets(client4, cluster4):
    shape, bucket = (256, 1024), 64 << 10  # 1 MiB float32
    tensor = source(shape, torch.float32, seed=7)
    old = client4.put("memory", tensor, spec=chunk(0, range(4)), overwrite=True)
    reports = []
    new = old.reshard(chunk(1, range(4)), bucket_bytes=bucket, progress=reports.append)
    done = reports[-1]
    new_shard = 256 * 256 * 4
    assert done.max_new_shard_bytes == new_shard
    # ranks of one host copy out of each other's memory: no bucket is staged or sent (over gloo, staging is
    # bounded by two rounds in flight: tests/server/rank/test_reshard_job.py)
    assert done.max_staging_bytes == 0 and done.sent_bytes == 0
    assert done.mapped_bytes == tensor.numel() * tensor.element_size() * 3 // 4
    print(
        f"\nreshard 1 MiB over 4 ranks, bucket {bucket}: new shards {done.max_new_shard_bytes} B/rank, "
        f"peak staging {done.max_staging_bytes} B/rank"
    )
    wait_until(  # the old version is dropped once the promotion is done
        lambda: all(h == [new.version] for h in _held_versions(client4, "memory").values()),
        10,
        f"every rank to hold version {new.version} of 'memory' only",
    )
    assert torch.equal(new.full_tensor(), tensor)


def test_readers_during_a_reshard_always_get_exact_data(client4):
    shape = (512, 1024)  # 2 MiB, moved in 4 KiB buckets: the reshard takes many rounds
    tensor = source(shape, torch.float32, seed=3)
    proxy = client4.put("busy", tensor, spec=chunk(0, range(4)), overwrite=True)
    stop, errors, reads = threading.Event(), [], [0]

    def read_loop(seed: int) -> None:
        reader = client4.tensor("busy")
        for offsets, sizes in random_boxes(shape, 10_000, seed):
            if stop.is_set():
                return
            try:
                if not torch.equal(reader.fetch(offsets, sizes), region(tensor, offsets, sizes)):
                    errors.append(f"wrong data at {offsets} {sizes} (version {reader.version})")
                reads[0] += 1
            except Exception as err:  # noqa: BLE001 - every failure is a test failure
                errors.append(repr(err))

    threads = [threading.Thread(target=read_loop, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        new = proxy
        for dim, ranks in ((1, range(4)), (0, (2, 3)), (1, (0, 1, 2))):
            # ranks of one host reshard this in milliseconds: the readers read between every two reshards
            before = reads[0]
            wait_until(lambda: reads[0] >= before + 3 or bool(errors), 30, "the readers to read")
            new = new.reshard(chunk(dim, ranks), bucket_bytes=4096)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not any(t.is_alive() for t in threads), "a reader hung"
    assert not errors, errors[:5]
    assert reads[0] > 0
    assert torch.equal(new.full_tensor(), tensor)


def test_bad_requests_are_refused_with_the_field_named(client4):
    tensor = source((6, 4), torch.float32)
    proxy = client4.put("bad", tensor, spec=chunk(0, range(2)), overwrite=True)
    with pytest.raises(InvalidArgumentError, match="size"):
        proxy.reshard(
            ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata((6, 5), TensorProperties())
        )
    with pytest.raises(InvalidArgumentError, match="rank 9"):
        proxy.reshard(chunk(0, (0, 9)))
    with pytest.raises(InvalidArgumentError, match="bucket_bytes"):
        proxy.reshard(chunk(1, range(2)), bucket_bytes=0)
    client4.delete("bad")
    with pytest.raises(TensorNotFoundError):
        proxy.reshard(chunk(1, range(2)))
    assert client4.put("bad", tensor, overwrite=True).full_tensor().equal(tensor)


def test_stray_jobs_and_tiny_timeouts_do_not_break_the_collectives(client4, cluster4):
    """A RunCollective whose plan needs ranks it leaves out, or a reshard whose timeout no job could meet, is
    refused before any collective starts: the world stays usable for the next reshard."""
    tensor = source((13, 21), torch.float32, seed=3)
    proxy = client4.put("stray", tensor, spec=chunk(0, range(2)), overwrite=True)
    src, dst = proxy.metadata(), chunk(1, range(2)).build_metadata((13, 21), TensorProperties())
    from shardserve.core.wire import metadata_to_proto

    rank0 = next(r for r in client4.ranks() if r.rank == 0)
    with grpc.insecure_channel(rank0.address) as channel:
        job = pb.CollectiveJob(
            seq=10**12,
            ranks=[0],
            timeout_s=5,
            epoch=1,
            reshard=pb.ReshardJob(
                name="stray",
                src_version=proxy.version,
                src=metadata_to_proto(src),
                dst_version=10**12 + 1,
                dst=metadata_to_proto(dst),
            ),
        )
        final = list(
            pb_grpc.ShardServerStub(channel).RunCollective(
                job, timeout=30, metadata=cluster4.cluster_metadata
            )
        )[-1]
    assert final.done and "leaves out ranks [1] that the reshard needs" in final.error
    request = pb.ReshardRequest(name="stray", metadata=metadata_to_proto(dst), timeout_s=1e-300)
    with pytest.raises(grpc.RpcError) as err:
        list(client4.session.channel.coordinator(client4.address).Reshard(request, timeout=30))
    assert (
        err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "timeout_s 1e-300 must be 0" in err.value.details()
    )
    new = proxy.reshard(chunk(1, range(4)))
    assert torch.equal(new.full_tensor(), tensor)
    assert not client4.session.call("ListRanks", pb.ListRanksRequest()).collectives_error


def test_cli_reshard_onto_a_grid(cluster4, client4, capsys):
    from shardserve.client.cli.main import main

    tensor = source((13, 21), torch.int32, seed=5)
    old = client4.put("cli", tensor, spec=chunk(0, range(4)), overwrite=True)
    assert main(["--coordinator", cluster4.address, "reshard", "cli", "--grid", "2x2"]) == 0
    assert f"version {old.version} -> {old.version + 1}" in capsys.readouterr().out
    new = client4.tensor("cli")
    assert new.metadata() == grid((13, 21), torch.int32, 2, 2)
    assert torch.equal(new.full_tensor(), tensor)
    assert main(["--coordinator", cluster4.address, "reshard", "cli", "--grid", "3x3"]) == 1
    assert "needs 9 ranks" in capsys.readouterr().err


# ---------------------------------------------------------------- failures


@pytest.fixture(scope="module")
def stalling_cluster(make_cluster):
    """3 ranks; rank 1 stalls 4 s in reshards of 'slow' and 'ahead', 3 s in 'cancelme' and 120 s in 'victim'."""
    previous = os.environ.get(STALL_ENV)
    os.environ[STALL_ENV] = "1:4:slow,1:4:ahead,1:3:cancelme,1:120:victim"
    try:
        return make_cluster(ranks=3)
    finally:
        if previous is None:
            del os.environ[STALL_ENV]
        else:
            os.environ[STALL_ENV] = previous


def test_a_second_reshard_of_the_same_tensor_is_refused_not_queued(stalling_cluster):
    tensor = source((13, 21), torch.float32, seed=11)
    with connect(stalling_cluster.address) as client:
        proxy = client.put("slow", tensor, spec=chunk(0, range(3)))
        moving, result = threading.Event(), {}

        def first() -> None:
            result["new"] = proxy.reshard(
                chunk(1, range(3)),
                timeout=60,
                progress=lambda r: r.phase == "moving" and moving.set(),
            )

        thread = threading.Thread(target=first)
        thread.start()
        assert moving.wait(30)
        with pytest.raises(ReshardRefusedError, match="reshard of 'slow' already in progress"):
            client.tensor("slow").reshard(chunk(1, (0, 1)))
        assert torch.equal(
            client.tensor("slow").full_tensor(), tensor
        )  # reads stay on the old version
        thread.join(60)
        assert result["new"].version == proxy.version + 1
        assert torch.equal(result["new"].full_tensor(), tensor)


def test_a_reshard_queued_behind_another_tensors_gets_its_timeout_for_its_own_run(stalling_cluster):
    """Reshards of two tensors on the same ranks run one after the other on each rank; the second's timeout
    (1 s) counts from when it starts, not from when it was sent (it waits ~4 s for the first)."""
    first, second = (
        source((13, 21), torch.float32, seed=15),
        source((7, 5, 3), torch.int64, seed=16),
    )
    with connect(stalling_cluster.address) as client:
        ahead = client.put("ahead", first, spec=chunk(0, range(3)))
        behind = client.put("behind", second, spec=chunk(0, range(3)))
        moving, result = threading.Event(), {}
        thread = threading.Thread(
            target=lambda: result.update(
                new=ahead.reshard(
                    chunk(1, range(3)),
                    timeout=60,
                    progress=lambda r: r.phase == "moving" and moving.set(),
                )
            )
        )
        thread.start()
        assert moving.wait(30)
        started = time.monotonic()
        moved = behind.reshard(chunk(1, (0, 2)), timeout=1)
        assert time.monotonic() - started > 2  # it did wait for the first
        thread.join(60)
        assert torch.equal(moved.full_tensor(), second) and torch.equal(
            result["new"].full_tensor(), first
        )
        assert client.session.call("ListRanks", pb.ListRanksRequest()).collectives_error == ""


def _held_versions(client, name: str) -> dict[int, list[int]]:
    """The versions of `name` each rank holds (staged ones included), asked of the ranks themselves."""
    held = {}
    for rank in client.ranks():
        with grpc.insecure_channel(rank.address) as channel:
            stats = pb_grpc.ShardServerStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)
        held[rank.rank] = [h.version for h in stats.held if h.name == name]
    return held


class _StopReshard(Exception):
    pass


def _stop_when_moving(report) -> None:
    if report.phase == "moving":
        raise _StopReshard()


def test_a_client_that_cancels_mid_reshard_aborts_it_and_the_world_stays_usable(stalling_cluster):
    tensor = source((13, 21), torch.int16, seed=14)
    with connect(stalling_cluster.address) as client:
        proxy = client.put("cancelme", tensor, spec=chunk(0, range(3)))
        with pytest.raises(_StopReshard):
            proxy.reshard(chunk(1, range(3)), progress=_stop_when_moving)

        def aborted() -> bool:
            rows = client.session.call(
                "ListTensors", pb.ListTensorsRequest(include_pending=True)
            ).tensors
            return [t.version for t in rows if t.name == "cancelme"] == [proxy.version]

        wait_until(aborted, 20, "the reshard to be aborted")
        assert torch.equal(client.tensor("cancelme").full_tensor(), tensor)
        wait_until(  # the ranks finish the job they had started (rank 1 stalls 3 s), then drop what it staged
            lambda: all(h == [proxy.version] for h in _held_versions(client, "cancelme").values()),
            20,
            "the ranks to drop the aborted reshard's version",
        )
        new = client.tensor("cancelme").reshard(
            chunk(1, (0, 2)), timeout=60
        )  # the world was not broken
        assert torch.equal(new.full_tensor(), tensor)


def test_kill_9_of_a_rank_mid_reshard_fails_in_bounded_time_naming_it(stalling_cluster):
    tensor = source((13, 21), torch.float64, seed=12)
    src = chunk(0, range(3)).build_metadata((13, 21), TensorProperties(dtype=torch.float64))
    with connect(stalling_cluster.address) as client:
        proxy = client.put("victim", tensor, spec=src)
        epoch = _epoch(client)
        moving, outcome = threading.Event(), {}

        def run() -> None:
            try:
                proxy.reshard(
                    chunk(1, range(3)),
                    timeout=20,
                    progress=lambda r: r.phase == "moving" and moving.set(),
                )
            except ShardServeError as err:
                outcome["error"] = err

        thread = threading.Thread(target=run)
        thread.start()
        assert moving.wait(30)
        time.sleep(0.5)
        killed = time.monotonic()
        stalling_cluster.kill_rank(1, signal.SIGKILL)
        thread.join(40)
        assert not thread.is_alive()
        elapsed = time.monotonic() - killed
        error = outcome["error"]
        assert isinstance(error, RankUnavailableError)
        assert "rank 1 is down" in str(error) and "new epoch over the live ranks" in str(error)
        assert elapsed < 20, elapsed
        after = client.tensor("victim")  # the catalog still serves the old version
        assert after.version == proxy.version
        shards = {
            shard.index: shard for per_rank in after.remote_shards().values() for shard in per_rank
        }
        for index, part in enumerate(shards_of(tensor, src)):  # readable from the surviving ranks
            if src.shards_metadata[index].rank != 1:
                assert torch.equal(shards[index].fetch(), part)
        wait_until(
            lambda: not next(r for r in client.ranks() if r.rank == 1).alive,
            20,
            "rank 1 to be shown dead",
        )
        # its shards may come back with it: refused as UNAVAILABLE (not lost), naming the rank
        with pytest.raises(RankUnavailableError, match="on rank 1:") as refused:
            after.reshard(chunk(1, (0, 2)))
        assert refused.value.reason == Reason.RANK_UNAVAILABLE
        _reshard_in_a_new_epoch(client, "survivor", (0, 2), epoch)


def _epoch(client) -> int:
    return client.session.call("ListRanks", pb.ListRanksRequest()).epoch


def _reshard_in_a_new_epoch(client, name: str, ranks, epoch_before: int) -> None:
    """A tensor put on `ranks` reshards there, bit for bit, in an epoch after `epoch_before`: no restart."""
    assert _epoch(client) > epoch_before
    tensor = source((13, 21), torch.float32, seed=len(name))
    proxy = client.put(name, tensor, spec=chunk(0, ranks), overwrite=True)
    moved = proxy.reshard(chunk(1, ranks), timeout=30)
    assert moved.version > proxy.version and torch.equal(moved.full_tensor(), tensor)
    assert client.session.call("ListRanks", pb.ListRanksRequest()).collectives_error == ""


@pytest.fixture(scope="module")
def hanging_cluster(make_cluster):
    """3 ranks; rank 1 stalls 8 s in reshards of 'hang' and 2 s in reshards of 'stopme'."""
    previous = os.environ.get(STALL_ENV)
    os.environ[STALL_ENV] = "1:8:hang,1:2:stopme"
    try:
        return make_cluster(ranks=3)
    finally:
        if previous is None:
            del os.environ[STALL_ENV]
        else:
            os.environ[STALL_ENV] = previous


def test_a_hung_rank_fails_the_reshard_within_the_timeout_naming_it(hanging_cluster):
    tensor = source((13, 21), torch.float32, seed=13)
    with connect(hanging_cluster.address) as client:
        proxy = client.put("hang", tensor, spec=chunk(0, range(2)))
        epoch = _epoch(client)
        started = time.monotonic()
        with pytest.raises(RankUnavailableError, match=r"rank 1 did not answer in time \(hung\?\)"):
            proxy.reshard(chunk(1, range(2)), timeout=2)
        assert time.monotonic() - started < 2 + 2 + 5
        assert torch.equal(
            client.tensor("hang").full_tensor(), tensor
        )  # every rank is alive: all readable
        assert client.tensor("hang").version == proxy.version
        # rank 1 still sleeps in the failed job (its thread is abandoned): the next job runs at once
        started = time.monotonic()
        _reshard_in_a_new_epoch(client, "after-hang", (0, 1), epoch)
        assert time.monotonic() - started < 6


def test_a_job_on_ranks_0_and_1_never_involves_rank_2(hanging_cluster):
    """Rank 2 is stopped (SIGSTOP) the whole time a reshard over ranks {0, 1} forms its group and runs."""
    tensor = source((13, 21), torch.int64, seed=17)
    with connect(hanging_cluster.address) as client:
        proxy = client.put("pair", tensor, spec=chunk(0, (0, 1)))
        hanging_cluster.kill_rank(2, signal.SIGSTOP)
        try:
            moved = proxy.reshard(chunk(1, (1, 0)), timeout=20)
            again = moved.reshard(chunk(0, (1,)), timeout=20)
        finally:
            hanging_cluster.kill_rank(2, signal.SIGCONT)
        assert torch.equal(moved.full_tensor(), tensor) and torch.equal(again.full_tensor(), tensor)
        wait_until(lambda: all(r.alive for r in client.ranks()), 20, "rank 2 to heartbeat again")


def test_a_rank_stopped_past_the_job_timeout_fails_it_and_later_jobs_succeed(hanging_cluster):
    tensor = source((13, 21), torch.float32, seed=18)
    with connect(hanging_cluster.address) as client:
        wait_until(lambda: all(r.alive for r in client.ranks()), 20, "every rank to be alive")
        proxy = client.put("stopme", tensor, spec=chunk(0, range(3)))
        epoch = _epoch(client)
        moving, outcome = threading.Event(), {}

        def run() -> None:
            try:
                proxy.reshard(
                    chunk(1, range(3)),
                    timeout=3,
                    progress=lambda r: r.phase == "moving" and moving.set(),
                )
            except ShardServeError as err:
                outcome["error"] = err

        thread = threading.Thread(target=run)
        thread.start()
        assert moving.wait(30)
        hanging_cluster.kill_rank(1, signal.SIGSTOP)  # inside its 2 s stall, before any byte moved
        try:
            started = time.monotonic()
            thread.join(30)
            assert not thread.is_alive()
            assert time.monotonic() - started < 3 + 2 + 5
            wait_until(
                lambda: not next(r for r in client.ranks() if r.rank == 1).alive,
                20,
                "rank 1 marked dead",
            )
            time.sleep(STOPPED_AFTER_DEAD_S)  # the coordinator acts on the death meanwhile
        finally:
            hanging_cluster.kill_rank(1, signal.SIGCONT)
        assert isinstance(outcome["error"], RankUnavailableError) and "rank 1" in str(
            outcome["error"]
        )
        wait_until(lambda: all(r.alive for r in client.ranks()), 20, "rank 1 to heartbeat again")
        assert torch.equal(client.tensor("stopme").full_tensor(), tensor)
        moved = client.tensor("stopme").reshard(
            chunk(1, range(3)), timeout=30
        )  # rank 1 stalls 2 s again
        assert torch.equal(moved.full_tensor(), tensor) and _epoch(client) > epoch
        _reshard_in_a_new_epoch(client, "after-stop", (0, 1, 2), epoch)


def test_checkpoints_run_after_failed_jobs_with_no_restart(hanging_cluster, tmp_path):
    """Checkpoint jobs (DCP on the job's ranks made the default c10d world) run in the epoch after the
    failures above: a save, then a load of what it wrote, bit for bit."""
    tensor = source((13, 21), torch.float32, seed=19)
    with connect(hanging_cluster.address) as client:
        wait_until(lambda: all(r.alive for r in client.ranks()), 20, "every rank to be alive")
        client.put("saved", tensor, spec=chunk(1, range(3)), overwrite=True)
        client.save_checkpoint(str(tmp_path / "ckpt"), ["saved"], timeout=60)
        loaded = client.load_checkpoint(
            str(tmp_path / "ckpt"), ["saved"], overwrite=True, timeout=60
        )["saved"]
        assert torch.equal(loaded.full_tensor(), tensor)


# ---------------------------------------------------------------- coordinator restart


def test_a_coordinator_restarted_after_the_catalog_commit_finishes_the_promotion(tmp_path: Path):
    port, store_port = free_port(), free_port()
    env = server_env()
    coordinator_args = [
        "coordinator",
        "--listen",
        f"127.0.0.1:{port}",
        "--state-dir",
        str(tmp_path / "state"),
        "--heartbeat-interval",
        "0.5",
        "--store-port",
        str(store_port),
    ]
    log = open(tmp_path / "log.txt", "w")
    procs = []
    try:
        coord = fork_server(coordinator_args, dict(env, **{EXIT_AFTER_COMMIT_ENV: "1"}), log)
        procs.append(coord)
        for rank in range(2):
            procs.append(
                fork_server(["--coordinator", f"127.0.0.1:{port}"], rank_env(env, rank, 2), log)
            )
        address = f"127.0.0.1:{port}"

        def two_ranks_alive() -> bool:
            with connect(address) as c:
                return len([r for r in c.ranks() if r.alive]) == 2

        wait_until(two_ranks_alive, 120, "two ranks")
        tensor = source((13, 21), torch.float32, seed=21)
        with connect(address) as client:
            old = client.put("restart", tensor, spec=chunk(0, range(2)))
            with pytest.raises(ShardServeError):
                old.reshard(chunk(1, range(2)))
        assert coord.wait(30) == EXIT_AFTER_COMMIT_CODE
        procs[0] = fork_server(coordinator_args, env, log)  # same port, same catalog, no exit hook

        def promoted() -> bool:
            with connect(address) as c:
                rows = c.session.call(
                    "ListTensors", pb.ListTensorsRequest(include_pending=True)
                ).tensors
                return [(t.version, t.promoting) for t in rows if t.name == "restart"] == [
                    (old.version + 1, False)
                ]

        wait_until(promoted, 60, "the promotion to finish")
        with connect(address) as client:
            new = client.tensor("restart")
            assert new.version == old.version + 1
            assert new.metadata() == chunk(1, range(2)).build_metadata((13, 21), TensorProperties())
            assert torch.equal(new.full_tensor(), tensor)
            stubs = [
                pb_grpc.ShardServerStub(grpc.insecure_channel(r.address)) for r in client.ranks()
            ]

            def old_dropped() -> bool:
                return all(
                    [
                        h.version
                        for h in s.GetStats(pb.GetStatsRequest(), timeout=10).held
                        if h.name == "restart"
                    ]
                    == [new.version]
                    for s in stubs
                )

            wait_until(old_dropped, 30, "the old version to be dropped")
            back = new.reshard(
                chunk(0, range(2)), timeout=30
            )  # collectives over the restarted coordinator's store
            assert torch.equal(back.full_tensor(), tensor)
    finally:
        stop_all(procs)
        log.close()


# ---------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_shards_reshard_on_the_gpu(make_cluster):
    cluster = make_cluster(ranks=1, rank_options=RankOptions(device="cuda"))
    tensor = source((13, 21), torch.float32, seed=31)
    with connect(cluster.address) as client:
        proxy = client.put("gpu", tensor, spec=ChunkShardingSpec(0, ["rank:0/cuda:0"] * 3))
        new = proxy.reshard(ChunkShardingSpec(1, ["rank:0/cuda:0"] * 2), bucket_bytes=64)
        assert new.version == proxy.version + 1
        assert torch.equal(new.full_tensor(), tensor)
