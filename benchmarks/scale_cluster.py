"""A coordinator process and N simulated ranks (benchmarks/scale_ranks.py) for the scale harness and its test.

The coordinator is the real one (`python -m shardserve.server coordinator`), on a fixed loopback port so that
it can be killed and started again where the ranks look for it. The ranks are rank instances in a few worker
processes, driven over their stdin (see benchmarks/scale_ranks.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import psutil

from shardserve.core.channel_options import RECONNECT_OPTIONS
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.server.common.ports import free_port

PROJECT_ROOT = Path(__file__).resolve().parent.parent
MAX_PROCESSES = (
    16  # rank instances are spread over at most this many processes (each ~300 MiB of torch)
)
START_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 600.0  # a call that takes longer is a failure of its row (the first 1,000-rank runs took minutes)
STOP_TIMEOUT_S = 2.0
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    *RECONNECT_OPTIONS,  # as every client's: tries again within a second after the coordinator's restart
]


def wait_for(predicate, timeout: float, what: str, interval: float = 0.02):
    """Poll `predicate` until it returns a truthy value (returned); TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)


class RankProcess:
    """One worker process of simulated ranks, answering one line per command."""

    def __init__(self, command: list[str], first: int, count: int) -> None:
        self.first, self.count = first, count
        self.proc = subprocess.Popen(
            command,
            cwd=PROJECT_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self._lock = threading.Lock()

    def holds(self, rank: int) -> bool:
        return self.first <= rank < self.first + self.count

    def read(self, expected: str) -> list[str]:
        """The next answer line, which must start with `expected`; its words after the first."""
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(
                f"simulated ranks {self.first}-{self.first + self.count - 1} exited "
                f"(code {self.proc.poll()}) before answering {expected!r}"
            )
        words = line.split()
        if not words or words[0] != expected:
            raise RuntimeError(f"simulated ranks answered {line.strip()!r}, not {expected!r}")
        return words[1:]

    def ask(self, command: str, expected: str) -> list[str]:
        with self._lock:
            self.send(command)
            return self.read(expected)

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def close_input(self) -> None:
        """End its commands: it stops its instances and exits (`stop` waits for that)."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Let it stop its instances, for `timeout` seconds; then kill it (nothing it does on the way out is
        measured)."""
        if self.proc.poll() is None:
            self.close_input()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


class SimulatedCluster:
    """The real coordinator process and `ranks` simulated ranks; use as a context manager."""

    def __init__(
        self,
        ranks: int,
        *,
        heartbeat_interval: float = 1.0,
        repair_after: float = 30.0,
        processes: int = MAX_PROCESSES,
        state_dir: str | Path | None = None,
        log_level: str = "ERROR",
    ) -> None:
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        self.world = ranks
        self.heartbeat_interval = heartbeat_interval
        self.repair_after = repair_after
        # as few instances in one process as the memory allows: a process's instances share one GIL, and a
        # real rank has a process (and a core) of its own
        self.ranks_per_process = -(-ranks // max(1, min(processes, ranks)))
        self.log_level = log_level
        self._temporary = (
            tempfile.TemporaryDirectory(prefix="shardserve-scale-") if state_dir is None else None
        )
        self.state_dir = Path(state_dir or self._temporary.name)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.coordinator: subprocess.Popen | None = None
        self.workers: list[RankProcess] = []
        self.channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.rank_rss_before = self.rank_rss_after = 0
        self._rank_stubs: dict[int, pb_grpc.ShardServerStub] = {}

    def __enter__(self) -> SimulatedCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ the coordinator

    def start_coordinator(self) -> float:
        """Start the coordinator process; seconds until it answers ListTensors."""
        address_file = self.state_dir / "address"
        address_file.unlink(missing_ok=True)
        start = time.perf_counter()
        self.coordinator = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shardserve.server",
                "coordinator",
                "--listen",
                self.address,
                "--state-dir",
                str(self.state_dir),
                "--heartbeat-interval",
                str(self.heartbeat_interval),
                "--repair-after",
                str(self.repair_after),
                "--metrics-port",
                "0",
                "--log-level",
                self.log_level,
            ],
            cwd=PROJECT_ROOT,
            stdout=subprocess.DEVNULL,
        )
        wait_for(self._answers, START_TIMEOUT_S, "the coordinator to serve")
        return time.perf_counter() - start

    def _answers(self) -> bool:
        """Whether the coordinator answers ListTensors, asked on a channel of this try's own: a channel refused
        while the coordinator started waits out its reconnect backoff before it tries again (gRPC's default
        grows 1, 1.6, 2.6, 4.1 s: the restart row measured those steps, 4.5 to 11.8 s, not the coordinator)."""
        if self.coordinator is not None and self.coordinator.poll() is not None:
            raise RuntimeError(f"the coordinator exited with code {self.coordinator.returncode}")
        with grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS) as channel:
            try:
                pb_grpc.CoordinatorStub(channel).ListTensors(
                    pb.ListTensorsRequest(layouts_apart=True), timeout=CALL_TIMEOUT_S
                )
            except grpc.RpcError as err:
                if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    return False
                raise
        return True

    def kill_coordinator(self) -> None:
        """SIGKILL the coordinator (a crash) and reap it."""
        assert self.coordinator is not None
        self.coordinator.send_signal(signal.SIGKILL)
        self.coordinator.wait(timeout=30)

    @property
    def coordinator_pid(self) -> int:
        assert self.coordinator is not None
        return self.coordinator.pid

    def coordinator_usage(self) -> tuple[float, int]:
        """(CPU seconds, user and system, so far; RSS bytes now) of the coordinator process."""
        process = psutil.Process(self.coordinator_pid)
        times = process.cpu_times()
        return times.user + times.system, process.memory_info().rss

    # ------------------------------------------------------------ the ranks

    def start_ranks(self) -> None:
        """Start the worker processes and wait until each serves its instances (not yet registered)."""
        secret = self.state_dir / "cluster-secret"
        wait_for(secret.exists, START_TIMEOUT_S, "the coordinator's cluster secret")
        for first in range(0, self.world, self.ranks_per_process):
            count = min(self.ranks_per_process, self.world - first)
            command = [
                sys.executable,
                "-m",
                "benchmarks.scale_ranks",
                "--coordinator",
                self.address,
                "--secret-file",
                str(secret),
                "--world",
                str(self.world),
                "--first",
                str(first),
                "--count",
                str(count),
            ]
            self.workers.append(RankProcess(command, first, count))
        for worker in self.workers:
            _, before, after = worker.read("ready")
            self.rank_rss_before += int(before)
            self.rank_rss_after += int(after)

    @property
    def rank_pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def rank_bytes_each(self) -> float:
        """Resident bytes one rank instance costs: the workers' growth while making them, per instance."""
        return (self.rank_rss_after - self.rank_rss_before) / self.world

    def register(self) -> float:
        """Register every rank at once; seconds until the coordinator lists all of them alive."""
        start = time.perf_counter()
        for worker in self.workers:
            worker.send("register")
        for worker in self.workers:
            worker.read("registered")
        self.wait_alive(self.world)
        return time.perf_counter() - start

    def wait_alive(self, count: int, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until the coordinator lists `count` live ranks."""
        wait_for(lambda: self.alive_count() >= count, timeout, f"{count} live ranks", 0.05)

    def alive_count(self) -> int:
        try:
            answer = self.stub.ListRanks(pb.ListRanksRequest(), timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                return 0
            raise
        return sum(r.alive for r in answer.ranks)

    def kill_rank(self, rank: int) -> None:
        """Stop rank instance `rank` as a crash would."""
        worker = next(w for w in self.workers if w.holds(rank))
        worker.ask(f"kill {rank}", "killed")

    def rank_stub(self, rank: int) -> pb_grpc.ShardServerStub:
        """A stub for rank `rank`, at the address it registered."""
        if rank not in self._rank_stubs:
            ranks = self.stub.ListRanks(pb.ListRanksRequest(), timeout=CALL_TIMEOUT_S).ranks
            for info in ranks:
                channel = grpc.insecure_channel(info.address, options=CHANNEL_OPTIONS)
                self._rank_stubs.setdefault(info.rank, pb_grpc.ShardServerStub(channel))
        return self._rank_stubs[rank]

    def close(self) -> None:
        """Stop the coordinator first (so that no rank is reported dead on the way out), then the ranks."""
        if self.coordinator is not None and self.coordinator.poll() is None:
            self.coordinator.send_signal(signal.SIGTERM)
            try:
                self.coordinator.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.coordinator.kill()
                self.coordinator.wait(timeout=10)
        for worker in self.workers:
            worker.close_input()
        for worker in self.workers:
            worker.stop()
        self.channel.close()
        if self._temporary is not None:
            self._temporary.cleanup()


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()
