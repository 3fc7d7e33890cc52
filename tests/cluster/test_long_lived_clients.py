"""Long-lived clients of a `shardserve up` process across real faults: one reader per transport (auto = shared memory,
bulk = the bulk port, grpc) keeps reading rank 1's rows of a row-wise table every READ_EVERY_S while rank 1 is
stopped (SIGSTOP for STOP_S, then SIGCONT) and while it is killed (kill -9) and restarted by the supervisor, which
restores its shards from its persistence folder. During a fault a read may fail, but only with RankUnavailableError
(UNAVAILABLE, reason RANK_UNAVAILABLE): never DATA_LOSS for a rank whose data is intact, never wrong data. After
it, every reader reads rank 1's rows again within RECOVERY_S of the coordinator seeing rank 1 alive, without a new
connect(). The recovery time per transport and fault is printed (pytest -s shows it).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch
from server_processes import start_up, stop_all
from waiting import wait_until

from shardserve import Cluster, RankUnavailableError, Reason, ShardServeError, connect
from shardserve.client.info import RankStatus
from shardserve.core.specs import ChunkShardingSpec

ROWS, DIM = 20_000, 16
RANK1_ROWS = (10_000, 10_000)  # rows of rank 1: offset, count
TABLE = torch.arange(ROWS * DIM, dtype=torch.float32).reshape(ROWS, DIM)
TRANSPORTS = ("auto", "bulk", "grpc")
HEARTBEAT_S = 0.5
READ_EVERY_S = 0.05
CALL_TIMEOUT_S = 3.0  # each reader's deadline per call
STOP_S = 6.0
RECOVERY_S = (
    2.0 + HEARTBEAT_S
)  # from the coordinator seeing the rank alive to each reader's first good read
FAULT_WAIT_S = 120.0  # a restarted rank imports torch again on a busy 2-core machine


@dataclass
class Reads:
    """What one long-lived reader saw: (monotonic time, None for a good read or the exception)."""

    transport: str
    events: list[tuple[float, BaseException | None]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, error: BaseException | None) -> None:
        with self.lock:
            self.events.append((time.monotonic(), error))

    def since(self, start: float) -> list[tuple[float, BaseException | None]]:
        with self.lock:
            return [event for event in self.events if event[0] >= start]

    def first_good_after(self, start: float) -> float | None:
        return next((t for t, error in self.since(start) if error is None), None)


class Reader(threading.Thread):
    """A client connected once, reading rank 1's rows until stopped; every answer is checked bit for bit."""

    def __init__(self, address: str, transport: str, stop: threading.Event) -> None:
        super().__init__(name=f"reader-{transport}", daemon=True)
        self.reads = Reads(transport)
        self.client: Cluster = connect(address, transport=transport, timeout=CALL_TIMEOUT_S)
        self._stop_reading = stop

    def run(self) -> None:
        offset, count = RANK1_ROWS
        expected = TABLE[offset : offset + count]
        remote = self.client.tensor("long-lived")
        while not self._stop_reading.is_set():
            try:
                rows = remote.fetch((offset, 0), (count, DIM))
                if not torch.equal(rows, expected):
                    raise AssertionError(f"{self.reads.transport}: wrong data")
                self.reads.add(None)
            except (ShardServeError, AssertionError) as err:
                self.reads.add(err)
            self._stop_reading.wait(READ_EVERY_S)
        self.client.close()


@pytest.fixture(scope="module")
def address(tmp_path_factory) -> Iterator[str]:
    """A 2-rank `shardserve up` in its own process, as users run it (its coordinator shares no interpreter with
    the readers), ranks persisting their shards and restarted when they die; the table put in it."""
    state = tmp_path_factory.mktemp("long-lived")
    with open(state / "up.log", "w") as log:
        proc, address = start_up(
            ["--ranks", "2", "--heartbeat-interval", str(HEARTBEAT_S), "--max-restarts", "2"]
            + ["--restart-backoff", "0.2"],
            state,
            log,
            timeout=FAULT_WAIT_S,
        )
        try:
            with connect(address) as client:
                client.put("long-lived", TABLE, ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"]))
            yield address
        finally:
            stop_all([proc])


@pytest.fixture
def readers(address: str) -> Iterator[dict[str, Reads]]:
    stop = threading.Event()
    threads = [Reader(address, transport, stop) for transport in TRANSPORTS]
    for thread in threads:
        thread.start()
    try:
        wait_until(
            lambda: all(t.reads.first_good_after(0.0) is not None for t in threads),
            60,
            "every reader's first good read",
        )
        yield {t.reads.transport: t.reads for t in threads}
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=CALL_TIMEOUT_S * 4)


def _rank(address: str, rank: int) -> RankStatus:
    with connect(address, timeout=5) as client:
        return client.ranks()[rank]


def _check_recovery(
    readers: dict[str, Reads], *, fault_start: float, alive_at: float, fault: str
) -> None:
    """Errors during the fault were UNAVAILABLE, never DATA_LOSS or wrong data; each reader read again within
    RECOVERY_S of `alive_at`. Every reader's problems are reported together."""
    deadline = alive_at + RECOVERY_S + CALL_TIMEOUT_S + 5.0
    while time.monotonic() < deadline and any(
        r.first_good_after(alive_at) is None for r in readers.values()
    ):
        time.sleep(0.1)
    problems = []
    for transport, reads in readers.items():
        wrong = {
            repr(error)[:160]
            for _, error in reads.since(fault_start)
            if error is not None
            and not (
                isinstance(error, RankUnavailableError) and error.reason == Reason.RANK_UNAVAILABLE
            )
        }
        problems += [f"{transport}: during the fault: {error}" for error in sorted(wrong)]
        good = reads.first_good_after(alive_at)
        if good is None:
            problems.append(
                f"{transport}: no good read in {deadline - alive_at:.1f} s after rank 1 came back"
            )
            continue
        recovery = max(0.0, good - alive_at)
        print(
            f"{fault}: {transport} reads again {recovery:.2f} s after the coordinator saw rank 1 alive"
        )
        if recovery > RECOVERY_S:
            problems.append(
                f"{transport}: {recovery:.2f} s to read again, after {_errors_before(reads, alive_at, good)}"
            )
    assert not problems, f"{fault}: " + "; ".join(problems)


def _errors_before(reads: Reads, alive_at: float, good: float) -> str:
    """What a reader's failed reads between `alive_at` and its first good read said (each message once, with the
    times it came), so a slow recovery names its cause."""
    seen: dict[str, list[float]] = {}
    for when, error in reads.since(alive_at):
        if error is not None and when < good:
            seen.setdefault(f"{type(error).__name__}: {str(error)[:200]}", []).append(
                when - alive_at
            )
    return (
        "; ".join(
            f"{message} ({len(times)}x, {min(times):.2f}-{max(times):.2f} s)"
            for message, times in seen.items()
        )
        or "no failed read"
    )


def test_readers_of_every_transport_read_again_after_a_rank_is_stopped_and_continued(
    address: str, readers: dict[str, Reads]
) -> None:
    pid = _rank(address, 1).pid
    fault_start = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(
            lambda: not _rank(address, 1).alive, FAULT_WAIT_S, "the coordinator to see rank 1 dead"
        )
        time.sleep(max(0.0, STOP_S - (time.monotonic() - fault_start)))
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: _rank(address, 1).alive, FAULT_WAIT_S, "the coordinator to see rank 1 alive")
    _check_recovery(
        readers, fault_start=fault_start, alive_at=time.monotonic(), fault="SIGSTOP 6 s"
    )


def test_readers_of_every_transport_read_again_after_a_rank_is_killed_restarted_and_restored(
    address: str, readers: dict[str, Reads]
) -> None:
    old_pid = _rank(address, 1).pid
    fault_start = time.monotonic()
    os.kill(old_pid, signal.SIGKILL)
    wait_until(
        lambda: (status := _rank(address, 1)).pid != old_pid and status.alive,
        FAULT_WAIT_S,
        "rank 1 to be restarted and registered",
    )
    with connect(address, timeout=5) as client:
        wait_until(
            lambda: client.tensor("long-lived").health == "healthy",
            FAULT_WAIT_S,
            "rank 1 to restore its shard",
        )
    _check_recovery(readers, fault_start=fault_start, alive_at=time.monotonic(), fault="kill -9")
