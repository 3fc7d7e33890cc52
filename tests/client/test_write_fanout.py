"""write_shards (client/paths/writes.py): every rank's writes at once through the caller's run_all, except
small writes into memory their allocation opened on this host, made one rank after another on the calling
thread (their cost is per write, which threads would only make wait for each other)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from shardserve.client.info import RankStatus
from shardserve.client.paths.writes import (
    SMALL_IN_PLACE_BYTES,
    ShardWrite,
    shard_write,
    write_shards,
)
from shardserve.protos import shardserve_pb2 as pb


def _writes(count: int, nbytes: int, *, in_place: bool) -> list[tuple[int, ShardWrite]]:
    segment = pb.WritableSegment(nbytes=nbytes) if in_place else None
    data = torch.zeros(nbytes, dtype=torch.uint8)
    return [(i % 2, shard_write(f"t{i}", 1, 0, data, segment=segment)) for i in range(count)]


def _run(writes: list[tuple[int, ShardWrite]]) -> tuple[dict[str, int], set[str], int]:
    """(bytes per path, the threads that wrote, how many jobs went through run_all)."""
    threads: set[str] = set()
    through_run_all: list[int] = []

    def write_batch(rank: RankStatus, batch: list[ShardWrite]) -> tuple[str, int]:
        threads.add(threading.current_thread().name)
        return "shm", sum(w.nbytes for w in batch)

    def run_all(jobs: Sequence[Callable[[], list[tuple[str, int]]]]) -> list:
        through_run_all.append(len(jobs))
        results: list = [None] * len(jobs)

        def run(i: int) -> None:
            results[i] = jobs[i]()

        workers = [
            threading.Thread(target=run, args=(i,), name=f"pool{i}") for i in range(len(jobs))
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        return results

    def rank_of(rank: int) -> RankStatus:
        return RankStatus(rank, f"r{rank}", "cpu", "host", True, 0, 0, 0, 0.0)

    written = write_shards(write_batch, rank_of, writes, run_all)
    return written, threads, sum(through_run_all)


def test_small_in_place_writes_run_on_the_calling_thread() -> None:
    written, threads, fanned = _run(_writes(8, 8 << 10, in_place=True))
    assert written == {"shm": 8 * (8 << 10)}
    assert threads == {threading.current_thread().name} and fanned == 0


def test_large_or_network_writes_run_at_once() -> None:
    large = _writes(4, SMALL_IN_PLACE_BYTES + 8, in_place=True)
    for writes in (large, _writes(8, 8 << 10, in_place=False)):
        written, threads, fanned = _run(writes)
        assert sum(written.values()) == sum(w.nbytes for _, w in writes)
        assert threads == {"pool0", "pool1"} and fanned == 2
