"""Online row updates on a real 3-rank cluster: ordered writers, group commit, reads during updates and
reshards, memory of copy-on-write blocks."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import group_commit_writer as group_writer
import grpc
import pytest
import torch
from server_processes import fork_client, run_together

from shardserve import Cluster, connect
from shardserve.core.specs import ChunkShardingSpec
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.server.common.rank_options import RankOptions
from shardserve.server.launcher import LocalCluster
from shardserve.server.rank.blocks import BLOCK_BYTES
from shardserve.server.rank.shared_memory import HEADER_BYTES

ROWS, COLUMNS = 240, 8
ROW_WISE = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu", "rank:2/cpu"])
TWO_RANKS = ChunkShardingSpec(0, ["rank:2/cpu", "rank:0/cpu"])
RUN_S = 2.0  # each concurrent run: readers and writers for this long (correctness, not timing, is asserted)
WRITER_PROCESSES, UPDATES_PER_WRITER = 4, 12
PROCESS_TIMEOUT_S = 240.0  # processes connecting on a busy 2-core host


@pytest.fixture(scope="module")
def cluster(make_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    """A long grace period, so that a test can read a replaced version without racing its end."""
    return make_cluster(ranks=3, rank_options=RankOptions(version_grace=60.0))


def _states(
    initial: torch.Tensor, calls: list[tuple[int, int, torch.Tensor, torch.Tensor]]
) -> dict[int, torch.Tensor]:
    """The table after every committed version: calls (version, order, ids, values) applied by version, then by
    call order within a version (group commit)."""
    states, table = {0: initial.clone()}, initial.clone()
    for version, _, ids, values in sorted(calls, key=lambda c: (c[0], c[1])):
        table[ids] = values
        states[version] = table.clone()
    return states


def _matches_a_state(
    answer: torch.Tensor, ids: torch.Tensor | None, states: dict[int, torch.Tensor]
) -> bool:
    return any(
        torch.equal(answer, state if ids is None else state[ids]) for state in states.values()
    )


def test_writers_readers_and_reshards_agree_on_one_order(cluster: LocalCluster) -> None:
    """Several clients update overlapping rows while others look up (mapped path and gRPC) and fetch and the
    table is resharded: no update is aborted or lost, every read equals one committed version bit for bit,
    and the final table equals the updates applied in the order of the versions they returned."""
    initial = torch.zeros(ROWS, COLUMNS)
    with connect(cluster.address) as admin:
        admin.put("upd-order", initial, spec=ROW_WISE)
    calls: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
    reads: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    errors: list[str] = []
    stop = time.monotonic() + RUN_S
    guard = threading.Lock()

    def writer(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        with connect(cluster.address) as client:
            while time.monotonic() < stop:
                ids = torch.randint(
                    0, ROWS // 4, (6,), generator=generator
                )  # a quarter of the rows: overlaps
                values = torch.randn(ids.numel(), COLUMNS, generator=generator)
                try:
                    landed = client.update_rows_ordered("upd-order", ids, values)
                except Exception as err:  # noqa: BLE001 - collected and failed below
                    errors.append(f"update: {err!r}")
                    continue
                with guard:  # a seeded duplicate id keeps its last value, as update_rows does
                    calls.append((landed.version, landed.order, ids, values))

    def reader(transport: str, fetch: bool) -> None:
        generator = torch.Generator().manual_seed(99)
        with connect(cluster.address, transport=transport) as client:
            table = client.tensor("upd-order")
            while time.monotonic() < stop:
                try:
                    if fetch:
                        reads.append((table.full_tensor(), None))
                    else:
                        ids = torch.randint(0, ROWS, (32,), generator=generator)
                        reads.append((client.lookup({"upd-order": ids})["upd-order"], ids))
                except Exception as err:  # noqa: BLE001 - collected and failed below
                    errors.append(f"read ({transport}): {err!r}")

    def resharder() -> None:
        with connect(cluster.address) as client:
            for spec in (TWO_RANKS, ROW_WISE):
                time.sleep(RUN_S / 3)
                try:
                    client.tensor("upd-order").reshard(spec)
                except Exception as err:  # noqa: BLE001 - collected and failed below
                    errors.append(f"reshard: {err!r}")

    threads = [threading.Thread(target=writer, args=(seed,)) for seed in range(3)]
    threads += [
        threading.Thread(target=reader, args=args)
        for args in (("auto", False), ("grpc", False), ("auto", True))
    ]
    threads.append(threading.Thread(target=resharder))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert calls and reads
    places = [(c[0], c[1]) for c in calls]
    assert len(set(places)) == len(
        places
    )  # one client per writer: every call its own place in the order
    states = _states(initial, calls)
    with connect(cluster.address) as admin:
        final = admin.tensor("upd-order").full_tensor()
        admin.delete("upd-order")
    assert torch.equal(final, states[max(states)])
    wrong = [
        i for i, (answer, ids) in enumerate(reads) if not _matches_a_state(answer, ids, states)
    ]
    assert wrong == []


def test_calls_of_one_client_are_grouped_and_each_is_told_its_version(
    cluster: LocalCluster,
) -> None:
    """Threads of one client updating one table at once: calls queued during an update go into one version
    together; each returns a version whose table holds its rows, and the final table holds every call."""
    with connect(cluster.address) as client:
        client.put("upd-group", torch.zeros(ROWS, COLUMNS), spec=ROW_WISE)
        results: dict[int, int] = {}

        def call(k: int) -> None:  # disjoint rows per call: every order gives the same final table
            results[k] = client.update_rows(
                "upd-group", torch.tensor([k]), torch.full((1, COLUMNS), float(k))
            )

        threads = [threading.Thread(target=call, args=(k,)) for k in range(1, 17)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert sorted(results) == list(range(1, 17))
        final = client.tensor("upd-group").full_tensor()
        expected = torch.zeros(ROWS, COLUMNS)
        expected[1:17] = torch.arange(1, 17, dtype=torch.float32).view(-1, 1)
        assert torch.equal(final, expected)
        assert max(results.values()) == client.tensor("upd-group").version
        client.delete("upd-group")


def _run_writers(address: str, folder: Path) -> list[dict]:
    """Start the writer processes, let them go together once all are connected, and collect what each did."""
    processes = [
        fork_client(
            folder / f"log-{k}.txt", group_writer.main, address, folder, k, UPDATES_PER_WRITER
        )
        for k in range(WRITER_PROCESSES)
    ]
    run_together(processes, folder, PROCESS_TIMEOUT_S)
    return [torch.load(folder / f"result-{k}.pt") for k in range(WRITER_PROCESSES)]


def _version_copies(client: object, name: str, version: int) -> list[tuple[int, torch.Tensor]]:
    """(first row, rows) of every copy of every shard of the table at `version` (replaced, still in its grace
    period), read with raw Lookup calls naming that version on the rank holding the copy."""
    copies = []
    for index, shard in enumerate(client.tensor(name).metadata().shards_metadata):
        start, count = shard.shard_offsets[0], shard.shard_sizes[0]
        item = pb.LookupItem(
            name=name,
            version=version,
            shard_index=index,
            ids=torch.arange(start, start + count, dtype=torch.int64).numpy().tobytes(),
        )
        with grpc.insecure_channel(client.session.address_of(shard.rank)) as channel:
            chunks = list(
                pb_grpc.ShardServerStub(channel).Lookup(pb.LookupRequest(items=[item]), timeout=30)
            )
        assert chunks[0].version == version
        data = bytearray(b"".join(chunk.data for chunk in chunks))
        copies.append(
            (start, torch.frombuffer(data, dtype=torch.float32).view(count, shard.shard_sizes[1]))
        )
    return copies


def test_writer_processes_are_grouped_into_versions_in_one_order(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """Several client processes update overlapping rows of one table at once: none is aborted, each is told a
    (version, order) of its own, and every version read back equals the updates applied in (version, order)
    order up to it, bit for bit, on every copy (replicas=2): a caller's version holds its rows unless a later
    member of the same version overwrote them."""
    initial = torch.zeros(group_writer.HOT_ROWS * 2, COLUMNS)
    with connect(cluster.address) as admin:
        admin.put(group_writer.TABLE, initial, replicas=2)
        results = _run_writers(cluster.address, tmp_path)
        assert [r["errors"] for r in results] == [
            []
        ] * WRITER_PROCESSES  # nothing aborted, nothing failed
        calls = [call for r in results for call in r["calls"]]
        assert len(calls) == WRITER_PROCESSES * UPDATES_PER_WRITER
        members: dict[int, list[int]] = {}
        for version, order, _, _ in calls:
            members.setdefault(version, []).append(order)
        for orders in (
            members.values()
        ):  # members of a version are numbered 0, 1, ... in the order they wrote
            assert sorted(orders) == list(range(len(orders)))
        states = _states(initial, calls)
        for version in sorted(members):
            copies = _version_copies(admin, group_writer.TABLE, version)
            assert (
                sum(rows.shape[0] for _, rows in copies) == 2 * initial.shape[0]
            )  # both copies of every row
            for start, rows in copies:
                assert torch.equal(rows, states[version][start : start + rows.shape[0]]), (
                    version,
                    start,
                )
        final = admin.tensor(group_writer.TABLE)
        assert final.version == max(members)
        assert torch.equal(final.full_tensor(), states[max(members)])
        admin.delete(group_writer.TABLE)


def test_a_replaced_version_stays_readable_for_the_grace_period(cluster: LocalCluster) -> None:
    """A read at the version an update replaced still gets that version, whole (a read in flight finishes where
    it began); a delete ends the grace at once."""
    table = torch.arange(ROWS * COLUMNS, dtype=torch.float32).view(ROWS, COLUMNS)
    with connect(cluster.address) as client:
        old = client.put("upd-grace", table, spec=ROW_WISE)
        shard = old.remote_shards()[1][0]
        client.update_rows("upd-grace", torch.arange(ROWS), torch.zeros(ROWS, COLUMNS))
        assert torch.equal(
            shard.fetch(), table[ROWS // 3 : 2 * ROWS // 3]
        )  # version old.version, on rank 1
        assert torch.equal(client.tensor("upd-grace").full_tensor(), torch.zeros(ROWS, COLUMNS))
        client.delete("upd-grace")
        with pytest.raises(Exception, match="not found|no longer|not held"):
            shard.fetch()


def _shard_memory(pid: int) -> int:
    """Bytes the shared-memory files a rank process holds open have allocated (each file once): its shards'
    memory as the kernel counts it, whatever the rank's own accounting says."""
    files: dict[tuple[int, int], int] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{fd}"
        with contextlib.suppress(OSError):
            if os.readlink(path).startswith("/memfd:shardserve"):
                stat = os.stat(path)
                files[(stat.st_dev, stat.st_ino)] = stat.st_blocks * 512
    return sum(files.values())


def _memory_used(client: Cluster, rank: int) -> int:
    """The bytes rank `rank` accounts as used (GetStats)."""
    with grpc.insecure_channel(client.session.address_of(rank)) as channel:
        stats = pb_grpc.ShardServerStub(channel).GetStats(pb.GetStatsRequest(), timeout=30)
    return stats.memory_used_bytes


def test_memory_during_100_updates_of_a_256_mib_table_is_the_table_plus_the_grace_windows_blocks(
    cluster: LocalCluster,
) -> None:
    """Updates share the blocks they do not change: during 100 updates of 64 random rows of a 256 MiB table,
    each rank holds (as the kernel counts its shared-memory files, and as it accounts) its shard plus the blocks
    copied by the versions in their grace period (here all of them), never a copy per update. The kernel's
    count is read after every tenth update (each read visits every file the rank holds open: thousands of
    copied blocks by the end), where a copy per update would stand out by ten shards."""
    columns, rows = 64, (256 << 20) // (64 * 4)
    pids = cluster.rank_pids
    baseline = [_shard_memory(pid) for pid in pids]
    with connect(cluster.address) as client:
        accounted = [
            _memory_used(client, rank) for rank in range(len(pids))
        ]  # earlier tests' versions
        shards = (
            client.put("upd-memory", torch.zeros(rows, columns), spec=ROW_WISE)
            .metadata()
            .shards_metadata
        )
        generator = torch.Generator().manual_seed(5)
        copied = [0, 0, 0]
        for update in range(1, 101):
            ids = torch.randint(0, rows, (64,), generator=generator)
            client.update_rows("upd-memory", ids, torch.ones(64, columns))
            for shard in shards:
                rank, (start, count) = shard.rank, (shard.shard_offsets[0], shard.shard_sizes[0])
                local = ids[(ids >= start) & (ids < start + count)] - start
                copied[rank] += (local * columns * 4 // BLOCK_BYTES).unique().numel() * BLOCK_BYTES
                if update % 10:
                    continue
                shard_bytes = (
                    -(-count * columns * 4 // mmap.PAGESIZE) * mmap.PAGESIZE
                )  # its memfd, in whole pages
                assert (
                    _shard_memory(pids[rank]) - baseline[rank]
                    <= HEADER_BYTES + shard_bytes + copied[rank]
                )
        for shard in shards:
            rank = shard.rank
            assert (
                _memory_used(client, rank) - accounted[rank]
                <= shard.shard_sizes[0] * columns * 4 + copied[rank]
            )
        client.delete("upd-memory")
