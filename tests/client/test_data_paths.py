"""Data plane: shared-memory, bulk TCP and gRPC reads bit for bit, path choice, fallback, safety.

Real 2-rank clusters on 127.0.0.1 (one with shared memory on, one with shared
memory off by SHARDSERVE_SHARED_MEMORY=0 and no bulk port); store and lease
logic checked in-process. The bulk port's own protocol: tests/server/rank/test_bulk_reads.py.
"""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial

import grpc
import pytest
import torch
from fake_clock import FakeClock
from server_helpers import Aborted, ServicerContext

import shardserve.client.paths.segments as segments
from shardserve import connect
from shardserve.client import metrics as client_metrics
from shardserve.client.errors import StaleVersionError, TensorNotFoundError
from shardserve.client.info import RankStatus
from shardserve.client.paths.bands import bands
from shardserve.client.paths.bulk import BulkReadError
from shardserve.client.paths.kinds import PathKind, parse_transport
from shardserve.client.paths.pipeline import NetworkCall
from shardserve.client.paths.policy import PathPolicy
from shardserve.client.paths.shm import SharedMemoryError
from shardserve.core.metadata import Box, TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.errors import Reason
from shardserve.server.common.rank_options import RankOptions
from shardserve.server.launcher import LocalCluster
from shardserve.server.rank.errors import InvalidState
from shardserve.server.rank.reads.open_leases import Leases
from shardserve.server.rank.reads.shm import SharedMemoryService
from shardserve.server.rank.shard_fill import InitFill
from shardserve.server.rank.shared_memory import ENV_SWITCH
from shardserve.server.rank.store import ShardStore

SPEC = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"])
DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.complex64,
    torch.complex128,
]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


@contextmanager
def env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@pytest.fixture(scope="module")
def cluster(cluster2: LocalCluster) -> LocalCluster:
    """The shared 2-rank cluster (conftest)."""
    return cluster2


@pytest.fixture(scope="module")
def no_shm_cluster(make_cluster):
    with env(ENV_SWITCH, "0"):
        return make_cluster(ranks=2, rank_options=RankOptions(bulk_reads=False))


@pytest.fixture(scope="module")
def tables(cluster):
    """One odd-shaped tensor per dtype, put once; {dtype: (source, name)}."""
    out = {}
    with connect(cluster.address, transport="grpc") as c:
        for i, dtype in enumerate(DTYPES):
            source = random_tensor((7, 5, 3), dtype, seed=i)
            name = f"dp-{str(dtype).removeprefix('torch.')}"
            c.put(name, source, SPEC)
            out[dtype] = (source, name)
    return out


@pytest.mark.parametrize("transport", ["shm", "grpc", "bulk", "auto"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_every_path_bit_for_bit(cluster, tables, transport, dtype):
    source, name = tables[dtype]
    with connect(cluster.address, transport=transport) as c:
        remote = c.tensor(name)
        assert torch.equal(remote.full_tensor(), source)
        assert remote.last_transport == ("shm" if transport == "auto" else transport)
        assert torch.equal(
            remote.fetch((2, 1, 0), (4, 3, 2)), source[2:6, 1:4, 0:2]
        )  # crosses both shards
        assert torch.equal(remote[3:5, :, 1], source[3:5, :, 1])
        out = torch.empty(3, 5, 7, dtype=dtype).transpose(0, 2)  # a non-contiguous output
        remote.fetch((0, 0, 0), (7, 5, 3), out=out)
        assert torch.equal(out, source)
        for shards in remote.remote_shards().values():
            for shard in shards:
                box = shard.metadata.box
                expected = source[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))]
                assert torch.equal(shard.fetch(), expected)


def test_larger_tensor_through_shared_memory(cluster):
    source = random_tensor((1023, 257), torch.float32, seed=99)
    with connect(cluster.address, transport="shm") as c:
        remote = c.put("dp-large", source, SPEC)
        opens = []
        for _ in range(2):  # the second read reuses the cached mapping (no lease)
            assert torch.equal(remote.fetch((100, 3), (900, 250)), source[100:1000, 3:253])
            assert remote.last_transport == "shm"
            opens.append(client_metrics()["shm_opens"])
        assert opens[1] == opens[0] > 0  # each shard opened once, by the first read


def test_large_parts_over_grpc_in_parallel_bands(cluster):
    source = random_tensor((4096, 1024), torch.float32, seed=7)  # 8 MiB per shard: two bands each
    assert len(bands(Box((0, 0), (2048, 1024)), 4)) == 2
    with connect(cluster.address, transport="grpc") as c:
        remote = c.put("dp-bands", source, SPEC)
        streams: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
        stream = c.session.paths.path(PathKind.GRPC).read_stream

        def spy(address, request, dest, cancel=None):  # type: ignore[no-untyped-def]
            streams.append((request.shard_index, tuple(request.offsets), tuple(request.sizes)))
            return stream(address, request, dest)

        c.session.paths.path(PathKind.GRPC).read_stream = spy  # type: ignore[method-assign]
        assert torch.equal(
            remote.fetch((0, 0), (2048, 1024)), source[:2048]
        )  # one 8 MiB part: two bands
        assert sorted(streams) == [(0, (0, 0), (1024, 1024)), (0, (1024, 0), (1024, 1024))]
        streams.clear()
        assert torch.equal(
            remote.fetch((1, 0), (2040, 1024)), source[1:2041]
        )  # under 2 x 4 MiB: one stream
        assert streams == [(0, (1, 0), (2040, 1024))]
        streams.clear()
        assert torch.equal(
            remote.fetch((1, 0), (4090, 1024)), source[1:4091]
        )  # two parts: one stream each
        assert sorted(streams) == [(0, (1, 0), (2047, 1024)), (1, (2048, 0), (2043, 1024))]
        assert remote.last_transport == "grpc"
        c.delete("dp-bands")


def test_read_region_small_refuses_large_boxes(cluster):
    source = random_tensor((600, 1024), torch.float32, seed=8)  # 1.2 MiB per shard
    with connect(cluster.address, transport="grpc") as c:
        remote = c.put("dp-small-limit", source, SPEC)
        stub = c.session.channel.shard_server(c.session.address_of(0))
        request = pb.ReadRegionRequest(
            name="dp-small-limit",
            version=remote.version,
            shard_index=0,
            offsets=(0, 0),
            sizes=(300, 1024),
        )
        with pytest.raises(grpc.RpcError) as err:
            stub.ReadRegionSmall(request, timeout=30)
        assert (
            err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "offsets/sizes" in err.value.details()
        )
        assert torch.equal(remote.fetch((0, 0), (600, 1024)), source)  # streamed, not small
        c.delete("dp-small-limit")


def test_bands_cover_the_part_exactly():
    part = Box((3, 1), (513, 4096))
    cut = bands(part, 4, streams=2, min_bytes=4 << 20)
    assert [b.sizes for b in cut] == [(257, 4096), (256, 4096)]
    assert cut[0].offsets == (3, 1) and cut[1].offsets == (260, 1)
    assert bands(Box((0, 0), (1, 1 << 24)), 4) == [Box((0, 0), (1, 1 << 24))]
    assert bands(Box((0, 0), (10, 10)), 4) == [Box((0, 0), (10, 10))]


def test_auto_is_the_default_and_logs_the_path(cluster, tables, caplog):
    source, name = tables[torch.float32]
    with (
        caplog.at_level(logging.DEBUG, logger="shardserve.client.paths.policy"),
        connect(cluster.address) as c,
    ):
        remote = c.tensor(name)
        assert torch.equal(remote.full_tensor(), source)
    assert remote.last_transport == "shm"
    assert "through shared memory" in caplog.text


@pytest.mark.parametrize("transport", ["auto", "grpc"])
def test_large_lookups_through_shared_memory(cluster, transport, caplog):
    table = random_tensor((5000, 64), torch.bfloat16, seed=21)
    ids = torch.randint(0, 5000, (6000,), generator=torch.Generator().manual_seed(1))
    with (
        caplog.at_level(logging.DEBUG, logger="shardserve.client.embedding.mapped_rows"),
        connect(cluster.address, transport=transport) as c,
    ):
        remote = c.put(f"dp-table-{transport}", table, SPEC)
        for batch in (ids, ids[:5], ids[:1]):
            assert torch.equal(remote.lookup(batch), torch.nn.functional.embedding(batch, table))
            assert set(c.lookups.last_paths.values()) == {"shm" if transport == "auto" else "grpc"}
        c.delete(f"dp-table-{transport}")
    assert ("rows of 'dp-table-auto' from mapped shards" in caplog.text) == (transport == "auto")


def test_process_watch_sees_a_rank_process_exit():
    """Cached mapped reads ask a pidfd whether the rank still lives (a killed rank's header still says served)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watch = segments.ProcessWatch()
    try:
        rank = watch.watch(process.pid)
        assert rank.alive() is True
        assert watch.watch(process.pid) is rank  # one pidfd per live process
    finally:
        process.kill()
        process.wait(timeout=30)
    assert rank.alive() is False


def test_process_watch_replaces_an_exited_process_and_closes_its_pidfd():
    """A pid seen again after its process exited (a rank restarted under a reused pid) gets a fresh pidfd, while
    mappings of the old process keep seeing it dead; the old pidfd closes once nothing refers to it."""
    watch = segments.ProcessWatch()
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        old = watch.watch(process.pid)
    finally:
        process.kill()
        process.wait(timeout=30)
    if old.alive() is None:
        pytest.skip("no pidfd_open on this kernel")
    assert old.alive() is False
    new = watch.watch(process.pid)
    assert new is not old and old.alive() is False
    # the pidfd is open while the old process object is held
    assert (
        old.pidfd is not None and os.readlink(f"/proc/self/fd/{old.pidfd}") == "anon_inode:[pidfd]"
    )
    held = weakref.ref(old)
    del old, new
    watch.watch(os.getpid())  # forgets exited processes
    gc.collect()
    assert held() is None  # nothing refers to it: its finalizer closed the pidfd


def test_bad_transport_is_refused(cluster):
    with pytest.raises(ValueError, match="transport must be one of"):
        connect(cluster.address, transport="rdma")


def test_rank_without_shared_memory_or_bulk_port_uses_grpc(no_shm_cluster, caplog):
    source = random_tensor((900, 1024), torch.bfloat16, seed=5)
    with (
        caplog.at_level(logging.WARNING, logger="shardserve.client.paths.policy"),
        connect(no_shm_cluster.address) as c,
    ):
        remote = c.put("plain", source, SPEC)
        assert not any(r.shared_memory for r in c.ranks())
        assert torch.equal(remote.full_tensor(), source)
        assert remote.last_transport == "grpc"
        ids = torch.tensor([899, 0, 450, 451])
        assert torch.equal(remote.lookup(ids), source[ids]) and c.lookups.last_paths == {
            0: "grpc",
            1: "grpc",
        }
    assert "serves no bulk port: turned off (--no-bulk-reads)" in caplog.text
    with connect(no_shm_cluster.address, transport="shm") as c:
        with pytest.raises(
            SharedMemoryError, match="transport='shm' is impossible: rank 0 does not offer"
        ):
            c.tensor("plain").full_tensor()
    with connect(no_shm_cluster.address, transport="bulk") as c:
        with pytest.raises(BulkReadError, match="serves no bulk port: turned off") as err:
            c.tensor("plain").full_tensor()
        assert err.value.code == grpc.StatusCode.UNIMPLEMENTED


def test_another_host_reads_and_looks_up_over_the_bulk_port(cluster, tables, monkeypatch):
    source, name = tables[torch.int64]
    table = random_tensor((1100, 512), torch.float32, seed=12)
    ids = torch.tensor([0, 1099, 549, 550, 550, 3])
    with connect(cluster.address) as c:
        monkeypatch.setattr(
            c.session.paths.path(PathKind.SHARED_MEMORY), "host", ("elsewhere", "another-boot-id")
        )
        remote = c.tensor(name)
        assert torch.equal(remote.full_tensor(), source)
        assert remote.last_transport == "bulk"
        remote = c.put("dp-remote", table, SPEC)
        assert torch.equal(remote.full_tensor(), table) and remote.last_transport == "bulk"
        assert torch.equal(remote.lookup(ids), table[ids])
        assert c.lookups.last_paths == {0: "bulk", 1: "bulk"}
        bags = remote.lookup_bag(ids, torch.tensor([0, 2, 5]), mode="sum", pooling="server")
        torch.testing.assert_close(
            bags, torch.nn.functional.embedding_bag(ids, table, torch.tensor([0, 2, 5]), mode="sum")
        )
        assert c.lookups.last_paths == {0: "bulk", 1: "bulk"}
        c.delete("dp-remote")


def test_unopenable_segment_falls_back_once_and_logs(cluster, tables, monkeypatch, caplog):
    source, name = tables[torch.complex64]
    real_open = os.open
    calls = []

    def refuse_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/") and "/fd/" in str(path):
            calls.append(path)
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(segments.os, "open", refuse_proc)
    with (
        caplog.at_level(logging.WARNING, logger="shardserve.client.paths.policy"),
        connect(cluster.address) as c,
    ):
        remote = c.tensor(name)
        assert torch.equal(remote.full_tensor(), source)
        assert remote.last_transport == "bulk"
        tried = len(calls)
        assert tried >= 1
        assert torch.equal(remote.full_tensor(), source)  # later reads go straight to the bulk port
        assert len(calls) == tried
    assert "reading it over the bulk port or gRPC" in caplog.text
    assert "Permission denied" in caplog.text
    with connect(cluster.address, transport="shm") as c:
        with pytest.raises(SharedMemoryError, match="Permission denied"):
            c.tensor(name).full_tensor()


def test_unreachable_bulk_port_falls_back_to_grpc_once_and_logs(cluster, monkeypatch, caplog):
    import shardserve.client.paths.bulk as tcp_reads

    large = random_tensor((2200, 512), torch.float32, seed=13)  # 2.1 MiB per shard
    dialed = []

    def refuse(address, *args, **kwargs):
        dialed.append(address)
        raise ConnectionRefusedError(111, "Connection refused")

    with connect(cluster.address, transport="grpc") as c:
        c.put("dp-firewalled", large, SPEC)
    monkeypatch.setattr(tcp_reads.socket, "create_connection", refuse)
    with (
        caplog.at_level(logging.WARNING, logger="shardserve.client.paths.policy"),
        connect(cluster.address) as c,
    ):
        monkeypatch.setattr(
            c.session.paths.path(PathKind.SHARED_MEMORY), "host", ("elsewhere", "another-boot-id")
        )
        remote = c.tensor("dp-firewalled")
        assert torch.equal(remote.full_tensor(), large) and remote.last_transport == "grpc"
        tried = len(dialed)
        assert tried == 2  # once per rank
        assert (
            torch.equal(remote.full_tensor(), large) and len(dialed) == tried
        )  # not tried again meanwhile
        ids = torch.tensor([2199, 0, 1100, 1099])
        assert torch.equal(remote.lookup(ids), large[ids]) and len(dialed) == tried
        assert c.lookups.last_paths == {0: "grpc", 1: "grpc"}
    assert "bulk TCP read from rank 0 failed; reading it over gRPC for 30 s" in caplog.text
    assert "Connection refused" in caplog.text
    with connect(cluster.address, transport="bulk") as c:
        with pytest.raises(BulkReadError, match="Connection refused"):
            c.tensor("dp-firewalled").full_tensor()
        c.delete("dp-firewalled")


def test_broken_kept_bulk_connection_is_replaced(cluster, tables):
    import socket

    source, name = tables[torch.int32]
    with connect(cluster.address, transport="bulk") as c:
        remote = c.tensor(name)
        assert torch.equal(remote.full_tensor(), source)
        kept = c.session.paths.path(PathKind.BULK).idle.kept()
        assert len(kept) == 2  # one per rank, kept for the next read
        for conn in kept:
            conn.sock.shutdown(socket.SHUT_RDWR)  # as if the rank had closed it
        assert torch.equal(remote.full_tensor(), source)
        assert remote.last_transport == "bulk"
        assert all(conn.sock.fileno() == -1 for conn in kept)  # replaced and closed
        assert len(c.session.paths.path(PathKind.BULK).idle.kept()) == 2


def _rank(number: int) -> RankStatus:
    return RankStatus(number, f"10.0.0.{number}:1", "cpu", "elsewhere", True, 0, 0, 1, 0.0)


def _calls(events: list[str], fail: dict[int, str]) -> list[NetworkCall]:
    """Two ranks' calls recording what happens; `fail` maps a rank to the step whose bulk port fails
    ("send" or "answer")."""

    def send_bulk(number: int, path: object, cancel: object = None):  # type: ignore[no-untyped-def]
        if fail.get(number) == "send":
            raise BulkReadError(f"rank {number}: no bulk port")
        events.append(f"send {number}")

        def answer() -> None:
            if fail.get(number) == "answer":
                raise BulkReadError(f"rank {number}: connection reset")
            events.append(f"answer {number}")

        return answer

    def over_grpc(number: int, path: object, cancel: object = None) -> None:
        events.append(f"grpc {number}")

    return [NetworkCall(_rank(n), partial(send_bulk, n), partial(over_grpc, n)) for n in (0, 1)]


def _run_now(job):  # type: ignore[no-untyped-def]
    future: Future = Future()
    future.set_result(job())
    return future


def test_bulk_requests_all_go_out_before_any_answer_is_taken():
    events: list[str] = []
    plane = PathPolicy(parse_transport("auto"), channel=None)
    sent = plane.send_all(_calls(events, {}), _run_now)
    assert events == ["send 0", "send 1"]  # nothing awaited yet
    assert sent.wait() == ["bulk", "bulk"]
    assert events == ["send 0", "send 1", "answer 0", "answer 1"]


@pytest.mark.parametrize("step", ["send", "answer"])
def test_a_failed_bulk_call_falls_back_to_grpc_for_its_rank_only(step, caplog):
    events: list[str] = []
    plane = PathPolicy(parse_transport("auto"), channel=None)
    with caplog.at_level(logging.WARNING, logger="shardserve.client.paths.policy"):
        assert plane.send_all(_calls(events, {1: step}), _run_now).wait() == ["bulk", "grpc"]
    assert "grpc 1" in events and "answer 0" in events and "grpc 0" not in events
    assert "bulk TCP read from rank 1 failed" in caplog.text
    events.clear()
    assert plane.send_all(_calls(events, {}), _run_now).wait() == [
        "bulk",
        "grpc",
    ]  # rank 1 backs off
    assert sorted(events) == ["answer 0", "grpc 1", "send 0"]


@pytest.mark.parametrize("step", ["send", "answer"])
def test_forced_tcp_raises_after_the_other_ranks_answered(step):
    events: list[str] = []
    plane = PathPolicy(parse_transport("bulk"), channel=None)
    with pytest.raises(BulkReadError, match="rank 0"):
        plane.send_all(_calls(events, {0: step}), _run_now).wait()
    assert "answer 1" in events and not any(event.startswith("grpc") for event in events)


def test_an_error_sending_one_call_is_raised_after_the_others_answered():
    events: list[str] = []
    calls = _calls(events, {})

    def refused(path: object, cancel: object = None):  # type: ignore[no-untyped-def]
        raise StaleVersionError("rank 0: ticket refused")

    calls[0] = NetworkCall(calls[0].rank, refused, calls[0].call)
    plane = PathPolicy(parse_transport("auto"), channel=None)
    sent = plane.send_all(calls, _run_now)
    with pytest.raises(StaleVersionError, match="ticket refused"):
        sent.wait()
    assert events == ["send 1", "answer 1"]  # rank 1's answer was taken, not left on its connection


def test_grpc_only_calls_run_the_first_on_this_thread():
    threads: dict[int, str] = {}
    plane = PathPolicy(parse_transport("grpc"), channel=None)

    def record(n: int, path: object, cancel: object = None) -> None:
        threads[n] = threading.current_thread().name

    calls = [NetworkCall(_rank(n), None, partial(record, n)) for n in (0, 1)]
    with ThreadPoolExecutor(1, thread_name_prefix="pool") as pool:
        assert plane.send_all(calls, pool.submit).wait() == ["grpc", "grpc"]
    assert threads[0] == threading.current_thread().name and threads[1].startswith("pool")


@pytest.mark.parametrize("what", ["lookup", "read"])
def test_a_bulk_answer_failing_midway_falls_back_for_that_rank(cluster, monkeypatch, caplog, what):
    import shardserve.client.paths.bulk as tcp_reads

    table = random_tensor((300, 16), torch.float32, seed=14)
    ids = torch.tensor([0, 299, 150, 149, 7])
    name = f"dp-mid-{what}"

    def run(remote) -> tuple[torch.Tensor, torch.Tensor, object]:  # type: ignore[no-untyped-def]
        if what == "lookup":
            return remote.lookup(ids), table[ids], c.lookups.last_paths
        return remote.fetch((100, 3), (120, 9)), table[100:220, 3:12], remote.last_transport

    with connect(cluster.address, transport="grpc") as c:
        c.put(name, table, SPEC)
    with (
        caplog.at_level(logging.WARNING, logger="shardserve.client.paths.policy"),
        connect(cluster.address) as c,
    ):
        monkeypatch.setattr(
            c.session.paths.path(PathKind.SHARED_MEMORY), "host", ("elsewhere", "another-boot-id")
        )
        remote = c.tensor(name)
        got, expected, paths = run(remote)
        assert torch.equal(got, expected) and paths in ({0: "bulk", 1: "bulk"}, "bulk")
        real_recv = tcp_reads.recv_exactly
        kept = c.session.paths.path(PathKind.BULK).idle.kept(c.session.address_of(1))
        rank1_port = kept[0].sock.getpeername()[1]

        def reset_rank1(sock, view, deadline):  # type: ignore[no-untyped-def]
            if sock.getpeername()[1] == rank1_port:
                raise ConnectionResetError(104, "Connection reset by peer")
            return real_recv(sock, view, deadline)

        monkeypatch.setattr(tcp_reads, "recv_exactly", reset_rank1)
        got, expected, paths = run(remote)
        assert torch.equal(got, expected)
        assert paths in (
            {0: "bulk", 1: "grpc"},
            "grpc",
        )  # a read reports its last part's path: rank 1's
        c.delete(name)
    assert "bulk TCP read from rank 1 failed" in caplog.text and "Connection reset" in caplog.text


def _record_bulk_reads(c, monkeypatch) -> list[str]:  # type: ignore[no-untyped-def]
    """Events "send PORT" / "answer PORT" of the client's bulk-port reads, in the order they happen."""
    events: list[str] = []
    real_send = c.session.paths.path(PathKind.BULK).send_read

    def send_read(address, request, dest, cancel=None):  # type: ignore[no-untyped-def]
        answer = real_send(address, request, dest)
        events.append(f"send {address}")

        def take() -> None:
            answer()
            events.append(f"answer {address}")

        return take

    monkeypatch.setattr(c.session.paths.path(PathKind.BULK), "send_read", send_read)
    return events


def test_a_read_across_ranks_sends_every_request_before_taking_an_answer(
    cluster, tables, monkeypatch
):
    source, name = tables[torch.float64]
    with connect(cluster.address, transport="bulk") as c:
        events = _record_bulk_reads(c, monkeypatch)
        remote = c.tensor(name)
        out = torch.empty(3, 5, 7, dtype=torch.float64).transpose(
            0, 2
        )  # each part lands through a buffer
        remote.fetch((0, 0, 0), (7, 5, 3), out=out)
        assert torch.equal(out, source)
        ranks = [c.session.address_of(0), c.session.address_of(1)]
        assert events == [
            f"send {ranks[0]}",
            f"send {ranks[1]}",
            f"answer {ranks[0]}",
            f"answer {ranks[1]}",
        ]
        assert remote.last_transport == "bulk"


def test_a_read_of_one_mapped_and_one_remote_rank(cluster, tables, monkeypatch):
    source, name = tables[torch.int16]
    with connect(cluster.address) as c:
        events = _record_bulk_reads(c, monkeypatch)
        rank1 = c.session.address_of(1)
        maps, reads = c.session.paths.maps, c.session.paths.path(PathKind.SHARED_MEMORY).read
        monkeypatch.setattr(
            c.session.paths, "maps", lambda rank: rank.address != rank1 and maps(rank)
        )
        monkeypatch.setattr(
            c.session.paths.path(PathKind.SHARED_MEMORY),
            "supports",
            lambda rank, summary=None: rank.address != rank1,
        )
        mapped: list[str] = []
        monkeypatch.setattr(
            c.session.paths.path(PathKind.SHARED_MEMORY),
            "read",
            lambda address, *args: mapped.append(address) or reads(address, *args),
        )
        assert torch.equal(c.tensor(name).fetch((1, 2, 0), (6, 3, 3)), source[1:7, 2:5])
        assert mapped == [c.session.address_of(0)] and events == [
            f"send {rank1}",
            f"answer {rank1}",
        ]


def test_deleted_tensor_is_not_found_on_shm(cluster):
    with connect(cluster.address, transport="shm") as c:
        remote = c.put("dp-gone", torch.arange(20.0).reshape(10, 2), SPEC)
        remote.full_tensor()
        c.delete("dp-gone")
        with pytest.raises(TensorNotFoundError):
            remote.full_tensor()


def test_overwrite_seen_through_a_cached_mapping(cluster):
    """A mapping cached by an earlier read sees its version dropped (segment header) and the read refreshes."""
    first, second = torch.arange(40.0).reshape(20, 2), -torch.arange(40.0).reshape(20, 2)
    with connect(cluster.address, transport="shm") as c:
        remote = c.put("dp-over", first, SPEC)
        assert torch.equal(remote.full_tensor(), first) and torch.equal(remote.full_tensor(), first)
        c.put("dp-over", second, SPEC, overwrite=True)
        assert torch.equal(remote.full_tensor(), second)
        assert remote.last_transport == "shm" and remote.version > 1
        c.delete("dp-over")


def test_cached_mapping_of_a_replaced_version_is_not_read_for_new_reads(cluster):
    """update_rows makes versions that share blocks with the one before (server/rank/blocks.py): a client still
    holding mappings of the old version sees its header say replaced (then dropped) and reads the new one."""
    table = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)
    ids = torch.tensor([0, 63, 31, 32, 5])
    with connect(cluster.address) as writer, connect(cluster.address) as reader:
        writer.put("dp-recycle", table, SPEC)
        remote = reader.tensor("dp-recycle")
        assert torch.equal(remote.lookup(ids), table[ids]) and torch.equal(remote[:], table)
        mappings = list(
            reader.session.paths.path(PathKind.SHARED_MEMORY).cached("dp-recycle").values()
        )
        assert mappings and all(int(m.state[2]) == m.generation for m in mappings)
        first = remote.version
        for k in (1, 2):
            writer.update_rows("dp-recycle", torch.arange(64), torch.full((64, 16), float(k)))
        assert all(
            int(m.state[1]) != 1 and int(m.state[2]) == m.generation for m in mappings
        )  # not served now
        assert torch.equal(
            remote.lookup(ids), torch.full((5, 16), 2.0)
        )  # stale, refreshed: the new rows
        latest = writer.tensor("dp-recycle").version
        assert (
            latest > first and reader.lookups.views.view("dp-recycle").version == latest
        )  # not new rows as old ones
        assert torch.equal(reader.tensor("dp-recycle")[:], torch.full((64, 16), 2.0))
        writer.delete("dp-recycle")


def test_a_mapping_whose_header_turns_between_openshard_and_its_use_is_never_read(
    cluster, monkeypatch
):
    """OpenShard keeps no lease when the client already maps the segment; if that segment's header says the
    version went between the reply and its use, the client does not map it again unleased: the read refreshes."""

    table = random_tensor((12, 4), torch.float32, seed=18)
    with connect(cluster.address) as c:
        remote = c.put("dp-turned", table, SPEC)
        assert torch.equal(remote[:], table) and remote.last_transport == "shm"
        reader = c.session.paths.path(PathKind.SHARED_MEMORY)
        first = reader.cached("dp-turned")
        answers = iter(
            [True, False]
        )  # serving at the first check, gone by the time the reply is used
        turned = next(iter(first.values()))
        monkeypatch.setattr(
            segments, "still_held", lambda mapping: False
        )  # so the read asks OpenShard
        monkeypatch.setattr(turned, "serves", lambda: next(answers, True))
        leases: list[int] = []
        real_map = segments.map_segment
        monkeypatch.setattr(
            segments, "map_segment", lambda reply: leases.append(reply.lease_id) or real_map(reply)
        )
        assert torch.equal(remote[:], table)
        assert leases and all(
            leases
        )  # every segment mapped again was mapped while a lease held its version
        again = reader.cached("dp-turned")
        key = next(k for k, m in first.items() if m is turned)
        assert again[key] is not turned  # mapped anew, under a lease
        c.delete("dp-turned")


def test_segment_header_follows_promote_and_drop():
    from shardserve.protos.same_host import HEADER_MAGIC, STATE_DROPPED, STATE_SERVED
    from shardserve.server.rank.shared_memory import HEADER_BYTES

    store = _served_store()
    with store.leases.lease("t", 1) as entry:
        segment = store.leases.shared_segment(entry, 0)
    assert segment.data_offset == HEADER_BYTES

    def header() -> list[int]:
        with open(f"/proc/{segment.pid}/fd/{segment.fd}", "rb") as f:
            return torch.frombuffer(bytearray(f.read(24)), dtype=torch.int64).tolist()

    assert header() == [HEADER_MAGIC, STATE_SERVED, 0]
    with store.leases.lease("t", 1):
        store.drop("t", 1)
        assert header() == [HEADER_MAGIC, STATE_DROPPED, 0]


def _versions_of(base: torch.Tensor, count: int) -> dict[float, torch.Tensor]:
    return {float(k): base + 1000 * k for k in range(count)}


@pytest.mark.parametrize("transport", ["shm", "bulk"])
def test_reads_during_overwrite_delete_and_reshard_never_mix(cluster, transport):
    """Readers hammer same-host (or bulk TCP) reads while the tensor is overwritten, resharded and deleted."""
    base = torch.arange(64 * 48, dtype=torch.float64).reshape(64, 48)
    versions = _versions_of(base, 6)
    errors: list[BaseException] = []
    seen = {"data": 0, "gone": 0}
    stop = threading.Event()

    def reader() -> None:
        with connect(cluster.address, transport=transport) as c:
            while not stop.is_set():
                try:
                    got = c.tensor(f"hot-{transport}").fetch((5, 3), (50, 40))
                except (TensorNotFoundError, StaleVersionError):
                    seen["gone"] += 1
                    continue
                except BaseException as err:  # noqa: BLE001 - reported by the main thread
                    errors.append(err)
                    return
                k = float(got[0, 0] - base[5, 3]) / 1000
                if k not in versions or not torch.equal(got, versions[k][5:55, 3:43]):
                    errors.append(
                        AssertionError(f"read mixed or wrong data (first element says version {k})")
                    )
                    return
                seen["data"] += 1

    with connect(cluster.address, transport="grpc") as writer:
        writer.put(f"hot-{transport}", versions[0.0], SPEC)
        threads = [threading.Thread(target=reader, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            for k in range(1, 6):
                remote = writer.put(f"hot-{transport}", versions[float(k)], SPEC, overwrite=True)
                if k % 2 == 0:
                    remote.reshard(ChunkShardingSpec(1, ["rank:1/cpu", "rank:0/cpu"]))
                time.sleep(0.1)
                if k == 3:
                    writer.delete(f"hot-{transport}")
                    time.sleep(0.1)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a reader hung"
    assert not errors, errors[0]
    assert seen["data"] > 0


# ---------------------------------------------------------------- store and leases, in-process


def _served_store(dtype: torch.dtype = torch.float32) -> ShardStore:
    store = ShardStore(0, shared_memory=True)
    meta = ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata(
        (6, 4), TensorProperties(dtype=dtype)
    )
    store.allocate("t", 1, meta, fill=InitFill.ARANGE)
    store.promote("t", 1)
    return store


def test_open_shard_lease_keeps_a_dropped_version_until_released():
    store = _served_store()
    service = SharedMemoryService(store)
    reply = service.OpenShard(pb.OpenShardRequest(name="t", version=1, shard_index=0), None)
    assert reply.lease_id and reply.nbytes == 6 * 4 * 4 and reply.pid == os.getpid()
    path = f"/proc/{reply.pid}/fd/{reply.fd}"
    assert os.stat(path).st_ino == reply.inode
    store.drop("t", 1)
    assert store.memory_used == reply.nbytes  # held by the lease
    assert os.stat(path).st_ino == reply.inode  # the fd still names the segment
    assert (
        service.ReleaseShard(pb.ReleaseShardRequest(lease_ids=[reply.lease_id]), None).released == 1
    )
    assert store.memory_used == 0


def test_open_shard_without_lease_when_client_maps_it():
    store = _served_store()
    service = SharedMemoryService(store)
    first = service.OpenShard(pb.OpenShardRequest(name="t", version=1, shard_index=0), None)
    again = service.OpenShard(
        pb.OpenShardRequest(name="t", version=1, shard_index=0, cached_inode=first.inode), None
    )
    assert again.lease_id == 0 and again.inode == first.inode
    assert len(service.leases) == 1


def test_leases_expire():
    now = [0.0]
    leases = Leases(clock=lambda: now[0])
    store = _served_store()
    lease = store.leases.lease("t", 1)
    lease.__enter__()
    leases.hold(lease, 5.0)
    store.drop("t", 1)
    assert leases.expire() == 0 and store.memory_used > 0
    now[0] = 6.0
    assert leases.expire() == 1 and store.memory_used == 0


def test_lease_ids_cannot_be_guessed():
    """ReleaseShard ends any lease whose id it is given: ids are random 63-bit numbers, not a sequence another
    client could walk."""
    leases, store = Leases(), _served_store()
    ids = []
    for _ in range(3):
        lease = store.leases.lease("t", 1)
        lease.__enter__()
        ids.append(leases.hold(lease, 30.0))
    assert (
        len(set(ids)) == 3
        and all(0 < i < 1 << 63 for i in ids)
        and sorted(ids) != list(range(ids[0], ids[0] + 3))
    )
    assert leases.release([ids[0] + 1, ids[0] - 1]) == 0 and leases.release(ids) == 3


def test_leases_are_capped_and_a_refused_one_holds_nothing(monkeypatch):
    """Never-released OpenShard leases would grow the table (and its expiry scan) without bound: past
    MAX_LEASES, OpenShard is RESOURCE_EXHAUSTED and the version it leased is let go again."""
    from shardserve.server.rank.reads import open_leases

    monkeypatch.setattr(open_leases, "MAX_LEASES", 2)
    store = _served_store()
    service = SharedMemoryService(store)
    request = pb.OpenShardRequest(name="t", version=1, shard_index=0)
    for _ in range(2):
        assert service.OpenShard(request, ServicerContext()).lease_id
    with pytest.raises(
        Aborted, match="RESOURCE_EXHAUSTED: this rank holds 2 shared-memory leases already"
    ) as refused:
        service.OpenShard(request, ServicerContext())
    assert refused.value.reason == Reason.OVERLOADED
    store.drop("t", 1)
    assert store.memory_used > 0  # the two leases granted still hold it
    service.leases.release(service.leases.held_ids())
    assert store.memory_used == 0  # the refused one left no hold behind


def test_served_versions_are_immutable():
    store = _served_store()
    with pytest.raises(InvalidState, match="already committed"):
        with store.leases.write("t", 1, 0, torch.float32, 6 * 4 * 4):
            pass
    with pytest.raises(InvalidState, match="already committed"):
        with store.leases.lease("t", 1, served=False):
            pass


def test_shards_built_elsewhere_move_to_shared_memory_with_the_same_bytes():
    store = ShardStore(0, shared_memory=True)
    meta = ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata(
        (3, 2), TensorProperties(dtype=torch.bfloat16)
    )
    built = random_tensor((3, 2), torch.bfloat16, seed=3)
    store.install("t", 1, meta, {0: built.clone()})
    store.promote("t", 1)
    with store.leases.lease("t", 1) as entry:
        segment = store.leases.shared_segment(entry, 0)
        assert segment is not None
        assert torch.equal(store.leases.shard_of(entry, 0), built)
        assert store.shared.segment_of(store.leases.shard_of(entry, 0)) == segment


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_shards_through_ipc_and_grpc(make_cluster):
    gpu = make_cluster(ranks=1, rank_options=RankOptions(device="cuda"))
    spec = ChunkShardingSpec(0, ["rank:0/cuda:0", "rank:0/cuda:0"])
    source = random_tensor((33, 17), torch.bfloat16, seed=11)
    with connect(gpu.address, transport="grpc") as c:
        c.put("gpu", source, spec)
        assert torch.equal(c.tensor("gpu").fetch((3, 2), (25, 10)), source[3:28, 2:12])
    with connect(gpu.address, transport="bulk") as c:  # staged through pinned memory on the rank
        remote = c.tensor("gpu")
        assert (
            torch.equal(remote.fetch((3, 2), (25, 10)), source[3:28, 2:12])
            and remote.last_transport == "bulk"
        )
        out = torch.empty(33, 17, dtype=torch.bfloat16, device="cuda")
        remote.fetch((0, 0), (33, 17), out=out)
        assert torch.equal(out.cpu(), source)
    with connect(gpu.address, transport="shm") as c:
        remote = c.tensor("gpu")
        assert torch.equal(remote.fetch((3, 2), (25, 10)), source[3:28, 2:12])
        assert remote.last_transport == "shm"
        out = torch.empty(33, 17, dtype=torch.bfloat16, device="cuda")
        remote.fetch((0, 0), (33, 17), out=out)
        assert torch.equal(out.cpu(), source)
        opens = client_metrics()["shm_opens"]
        assert torch.equal(remote.fetch((0, 0), (33, 17)), source)
        # cached IPC mappings: the header page says "served", no OpenShard
        assert client_metrics()["shm_opens"] == opens
        newer = source.flip(0).contiguous()
        c.put("gpu", newer, spec, overwrite=True)  # drops the mapped version: its header says so
        assert torch.equal(remote.fetch((0, 0), (33, 17)), newer)
        assert client_metrics()["shm_opens"] > opens


def test_a_lookup_answer_of_exactly_the_small_limit_comes_over_the_bulk_port(cluster):
    """4 MiB of rows is what LookupSmall answers in one message; the reply around them is a few bytes more."""
    from shardserve.client.paths.grpc import SMALL_ANSWER_BYTES

    table = random_tensor((1024, 1024), torch.float32, seed=15)  # one rank, 4 MiB
    ids = torch.randperm(1024)
    assert ids.numel() * 1024 * 4 == SMALL_ANSWER_BYTES
    with connect(cluster.address, transport="bulk") as c:
        remote = c.put("dp-exact-small", table, ChunkShardingSpec(0, ["rank:0/cpu"]))
        assert torch.equal(remote.lookup(ids), table[ids]) and c.lookups.last_paths == {0: "bulk"}
        c.delete("dp-exact-small")


def test_pooled_answers_are_sized_in_the_accumulation_dtype(cluster):
    """1024 bags of 1024 float32 columns are 4 MiB of sums: LookupSmall's limit, so one message over the bulk
    port (counted as float64 sums, they used to stream over gRPC); bit for bit F.embedding_bag in one shard."""
    import torch.nn.functional as F

    table = random_tensor((64, 1024), torch.float32, seed=16)
    ids = torch.arange(64).repeat(32)
    offsets = torch.arange(0, 2048, 2)
    with connect(cluster.address, transport="bulk") as c:
        c.put("dp-bags-4mib", table, ChunkShardingSpec(0, ["rank:0/cpu"]))
        got = c.tensor("dp-bags-4mib").lookup_bag(ids, offsets, mode="sum", pooling="server")
        assert torch.equal(got, F.embedding_bag(ids, table, offsets, mode="sum"))
        assert c.lookups.last_paths == {0: "bulk"}
        c.delete("dp-bags-4mib")


def test_mapped_tables_falling_back_to_grpc_calls_do_not_deadlock(cluster, monkeypatch):
    """All ranks mapped, yet the rows come over gRPC (the mapped read declines, no bulk port): the calls on the
    client's pool threads take the CPU turn, so the caller must not hold it while it waits for them."""
    from shardserve.client.embedding.mapped_rows import MappedRows

    table = random_tensor((40, 8), torch.float32, seed=17)
    ids = torch.tensor([0, 39, 20, 19])
    with connect(cluster.address) as c:
        remote = c.put("dp-mapped-fallback", table, SPEC)
        monkeypatch.setattr(MappedRows, "rows", lambda self, ids, pinned=False: None)
        monkeypatch.setattr(c.session.paths, "lookup_rows", lambda *args: None)
        monkeypatch.setattr(
            c.session.paths.path(PathKind.BULK), "supports", lambda rank, summary=None: False
        )
        result: list[torch.Tensor] = []
        worker = threading.Thread(target=lambda: result.append(remote.lookup(ids)), daemon=True)
        worker.start()
        worker.join(timeout=30)
        assert not worker.is_alive(), "the lookup deadlocked"
        assert torch.equal(result[0], table[ids]) and c.lookups.last_paths == {0: "grpc", 1: "grpc"}
        c.delete("dp-mapped-fallback")


def test_expired_idle_connections_are_closed_oldest_first():
    import socket

    from shardserve.client.paths.bulk_connections import IDLE_KEEP_S, Connection, IdleConnections

    clock = FakeClock()
    idle = IdleConnections(clock=clock)
    pairs = [socket.socketpair() for _ in range(3)]
    connections = [Connection(a) for a, _ in pairs]
    for connection, wait in zip(connections, (1.0, IDLE_KEEP_S, 0.0)):
        idle.give_back("rank", connection)
        clock.advance(wait)  # ages IDLE_KEEP_S + 1, IDLE_KEEP_S and 0 at the take
    taken = idle.take("rank")
    assert taken is connections[2] and taken.kept
    assert [c.sock.fileno() for c in connections[:2]] == [-1, -1]  # closed, though under the newest
    assert idle.take("rank") is None
    for a, b in pairs:
        a.close()
        b.close()


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.INVALID_ARGUMENT,
    ],
)
def test_a_rank_without_a_ticket_to_spare_is_read_another_way(code):
    """OpenBulkSession answering UNIMPLEMENTED (no bulk port) or RESOURCE_EXHAUSTED (its tickets all out) is a
    failure of the path, so the data plane falls back to gRPC; other errors are the read's own."""
    from shardserve.client.errors import ShardServeError
    from shardserve.client.paths.bulk import BulkPath

    class Refusing:
        timeout = 5.0

        def data_timeout(self, nbytes):  # type: ignore[no-untyped-def]
            return self.timeout

        def shard_server(self, address):  # type: ignore[no-untyped-def]
            return type("Stub", (), {"OpenBulkSession": None})()

        def unary(self, method, request, where):  # type: ignore[no-untyped-def]
            raise ShardServeError(f"{where}: refused", code)

    path_failure = code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.RESOURCE_EXHAUSTED)
    with pytest.raises(ShardServeError, match="refused") as raised:
        BulkPath(Refusing()).read_regions(  # type: ignore[arg-type]
            "127.0.0.1:1", pb.ReadRegionsRequest(), 1 << 20
        )  # refused at its session's opening, before any frame
    assert isinstance(raised.value, BulkReadError) == path_failure


# ---------------------------------------------------------------- writes (WriteShards by each path)


def write_state() -> dict[str, torch.Tensor]:
    """Every dtype in odd shapes, a 0-d and an empty tensor, and one over the 1 MiB inline batch."""
    state = {
        f"w.{str(dtype).removeprefix('torch.')}": random_tensor((5, 7), dtype, seed=i)
        for i, dtype in enumerate(DTYPES)
    }
    state["w.scalar"] = torch.tensor(2.5)
    state["w.empty"] = torch.zeros((0, 3))
    state["w.big"] = random_tensor(
        (640, 1024), torch.float32, seed=99
    )  # 2.5 MiB: streamed on the gRPC path
    return state


def put_and_check(client, prefix: str, spec=None) -> dict[str, int]:
    """spmd.put_state_dict of write_state() (column shards when `spec`: strided sources), read back bit for bit;
    returns the bytes each path wrote."""
    from shardserve import spmd

    seen: list[dict[str, int]] = []
    write = client.session.write_shards
    client.session.write_shards = lambda writes: seen.append(write(writes)) or seen[-1]
    state = write_state()
    layout = (
        None
        if spec is None
        else {
            key: spec if value.dim() == 2 and value.shape[1] > 1 else None
            for key, value in state.items()
        }
    )  # None: the default layout
    spmd.put_state_dict(client, state, prefix, spec=layout)
    into = {key: torch.empty_like(value) for key, value in state.items()}
    spmd.get_state_dict(client, prefix, into=into)
    for key, value in state.items():
        assert torch.equal(into[key], value), key
    return seen[0]


@pytest.mark.parametrize(
    "transport, path", [("auto", "shm"), ("shm", "shm"), ("bulk", "bulk"), ("grpc", "grpc")]
)
def test_state_dict_writes_go_by_each_path_bit_for_bit(cluster, transport, path):
    with connect(cluster.address, transport=transport) as client:
        written = put_and_check(client, f"paths-{transport}")
        assert set(written) == {path}
        assert written[path] == sum(v.numel() * v.element_size() for v in write_state().values())
        strided = put_and_check(
            client, f"strided-{transport}", spec=ChunkShardingSpec(1, ["rank:0/cpu", "rank:1/cpu"])
        )
        assert set(strided) == {path}


def test_writes_fall_back_when_the_rank_refuses_the_memfd(cluster, monkeypatch, caplog):
    import shardserve.client.paths.staging as staging

    real = staging.StagingFile.source
    monkeypatch.setattr(
        staging.StagingFile, "source", lambda self, host_id: real(self, "another-host")
    )  # the rank refuses: UNIMPLEMENTED
    with connect(cluster.address) as client, caplog.at_level(logging.WARNING):
        client.session.paths.path(
            PathKind.SHARED_MEMORY
        ).in_place.host_id = "another-host"  # refused in place too
        assert set(put_and_check(client, "refused-memfd")) == {"bulk"}
    assert "shared-memory write to rank" in caplog.text and "not on this rank's host" in caplog.text


def test_writes_stage_their_bytes_when_the_rank_refuses_to_be_written_in_place(cluster):
    with connect(cluster.address) as client:
        client.session.paths.path(PathKind.SHARED_MEMORY).in_place.host_id = "another-host"
        assert set(put_and_check(client, "staged")) == {"shm"}
        assert client.session.paths.path(PathKind.SHARED_MEMORY).in_place.mapped_segments == 0


def test_writes_go_over_grpc_without_shared_memory_or_bulk_port(no_shm_cluster):
    with connect(no_shm_cluster.address) as client:
        assert set(put_and_check(client, "plain")) == {"grpc"}


def test_staging_files_are_kept_within_their_budget_and_closed_when_idle():
    from shardserve.client.paths.staging import StagingFiles

    clock = FakeClock()
    files = StagingFiles(kept_bytes=1 << 20, idle_s=5.0, clock=clock)
    first = files.take(1000)
    files.give_back(first)
    assert files.take(500) is first  # kept and big enough: reused
    files.give_back(first)
    big = files.take(2 << 20)  # over the budget: a new file, closed when given back
    files.give_back(big)
    assert big.closed and not first.closed
    clock.advance(10.0)
    again = files.take(10)  # the kept one idled past idle_s: closed, a new one made
    assert first.closed and again is not first
    files.give_back(again)
    files.close()
    assert again.closed
