"""`up` (a coordinator plus N local ranks), `coordinator` alone, and LocalCluster, the code both share.

LocalCluster runs the coordinator in this process and spawns the ranks in
parallel as `python -m server --coordinator HOST:PORT` with torchrun's
environment, so a local cluster is the same world torchrun would start.
Ranks exit when this process dies (they watch their parent), and stop()
sends SIGTERM, then SIGKILL after a grace period.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from protos import shardserve_pb2 as pb
from protos import shardserve_pb2_grpc as pb_grpc
from server.common.auth import Security, TlsFiles
from server.common.cli_args import (
    PARENT_PID_ENV,
    TOKEN_ENV,
    add_security_args,
    configure_logging,
    security_from_args,
)
from server.common.grpc_server import RunningServer, start_server

if TYPE_CHECKING:  # imported lazily: they pull in torch, which the ranks import meanwhile
    from server.coordinator.lifecycle import Coordinator

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CATALOG_FILE = "catalog.sqlite"
COORDINATOR_WORKERS = 64  # gRPC threads: 16 queued reshards took all 16 and ranks were declared dead


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def start_coordinator(listen: str, state_dir: str | Path, security: Security, heartbeat_interval: float = 1.0,
                      rpc_timeout: float = 60.0, pending_timeout: float = 600.0, store_port: int = 0,
                      repair_after: float = 30.0) -> "tuple[Coordinator, RunningServer]":
    """A Coordinator over the SQLite catalog in `state_dir`, served on `listen`, hosting the rendezvous store
    of collective jobs on `store_port` (0 = any free port), repairing copies dead for `repair_after` s."""
    from server.coordinator.catalog import SQLiteCatalog
    from server.coordinator.lifecycle import Coordinator
    from server.coordinator.service import CoordinatorServicer

    coordinator = Coordinator(SQLiteCatalog(Path(state_dir) / CATALOG_FILE), security,
                              heartbeat_interval=heartbeat_interval, rpc_timeout=rpc_timeout,
                              pending_timeout=pending_timeout, store_port=store_port, repair_after=repair_after)

    def add(server: object) -> list[str]:
        pb_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(coordinator), server)
        return [pb.DESCRIPTOR.services_by_name["Coordinator"].full_name]
    try:  # reshard and checkpoint streams hold a worker for their whole run: room left for heartbeats and reads
        running = start_server(listen, security, add, max_workers=COORDINATOR_WORKERS)
    except Exception:
        coordinator.close()
        raise
    return coordinator, running


class LocalCluster:
    """A coordinator (in this process) and `ranks` rank processes on this host."""

    def __init__(self, ranks: int = 3, token: str | None = None, state_dir: str | Path = ".shardserve",
                 tls: TlsFiles | None = None, memory_limit: int | None = None,
                 max_request_bytes: int | None = None, heartbeat_interval: float = 1.0,
                 host: str = "127.0.0.1", port: int = 0, device: str = "cpu", rpc_timeout: float = 60.0,
                 pending_timeout: float = 600.0, log_level: str | None = None,
                 recycle_bytes: int | None = None, bulk_reads: bool = True, repair_after: float = 30.0) -> None:
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        self.ranks = ranks
        self.security = Security(token=token or None, tls=tls)
        self.state_dir = Path(state_dir)
        self.memory_limit = memory_limit  # None: each rank's share of the host's memory
        self.recycle_bytes = recycle_bytes  # None: the rank's default
        self.max_request_bytes = max_request_bytes or 0
        self.bulk_reads = bulk_reads  # False: ranks serve no bulk TCP port (server/rank/reads/bulk.py)
        self.heartbeat_interval = heartbeat_interval
        self.repair_after = repair_after
        self.host, self.port, self.device = host, port, device
        self.rpc_timeout, self.pending_timeout = rpc_timeout, pending_timeout
        self.log_level = log_level or logging.getLevelName(logging.getLogger().getEffectiveLevel())
        self.coordinator: "Coordinator | None" = None
        self._server: RunningServer | None = None
        self._procs: list[subprocess.Popen] = []
        self._stopping = threading.Event()
        self._lock = threading.Lock()

    # ------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 60.0) -> "LocalCluster":
        """Start the ranks, then the coordinator they register with; return once all have registered.

        The ranks are spawned first (with the coordinator's port chosen up front) so that their torch
        imports overlap this process's; they retry registering until the coordinator answers.
        """
        try:
            port = self.port or free_port(self.host)
            self._spawn_ranks(f"{self._dial_host()}:{port}")
            self.coordinator, self._server = start_coordinator(
                f"{self.host}:{port}", self.state_dir, self.security, self.heartbeat_interval,
                self.rpc_timeout, self.pending_timeout, repair_after=self.repair_after)
            threading.Thread(target=self._watch_ranks, name="rank-watch", daemon=True).start()
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        log.info("cluster of %d ranks ready at %s", self.ranks, self.address)
        return self

    @property
    def address(self) -> str:
        if self._server is None:
            raise RuntimeError("the cluster is not started")
        return f"{self._dial_host()}:{self._server.port}"

    def _dial_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "[::]", "") else self.host

    @property
    def rank_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def kill_rank(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to one rank's process (tests use it to simulate failures); SIGKILL waits until it is gone
        (its fds closed: a same-host client's shared-memory mapping then sees the rank dead too)."""
        os.kill(self._procs[rank].pid, sig)
        if sig == signal.SIGKILL:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._procs[rank].wait(timeout=30)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM every rank, SIGKILL those still alive after `grace`, then stop the coordinator. Idempotent."""
        with self._lock:
            self._stopping.set()
            if self.coordinator is not None:
                self.coordinator.stop_monitor()
            for proc in self._procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for proc in self._procs:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("rank pid %d did not stop in %.1fs; killing it", proc.pid, grace)
                    proc.kill()
                    proc.wait(timeout=5.0)
            if self._server is not None:
                self._server.stop(grace=1.0)
            if self.coordinator is not None:
                self.coordinator.close()
                self.coordinator = None

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ ranks

    def _spawn_ranks(self, coordinator: str) -> None:
        for rank in range(self.ranks):
            self._procs.append(subprocess.Popen(self._rank_command(coordinator), env=self._rank_env(rank),
                                                stdin=subprocess.DEVNULL))
        log.info("started ranks %s", self.rank_pids)

    def _rank_command(self, coordinator: str) -> list[str]:
        cmd = [sys.executable, "-m", "server", "--coordinator", coordinator, "--listen", f"{self.host}:0",
               "--device", self.device,
               "--max-request-bytes", str(self.max_request_bytes), "--log-level", self.log_level]
        if self.memory_limit is not None:
            cmd += ["--memory-limit", str(self.memory_limit)]
        if self.recycle_bytes is not None:
            cmd += ["--recycle-bytes", str(self.recycle_bytes)]
        if not self.bulk_reads:
            cmd.append("--no-bulk-reads")
        tls = self.security.tls
        if tls is not None:
            cmd += ["--tls-cert", tls.cert, "--tls-key", tls.key] + (["--tls-ca", tls.ca] if tls.ca else [])
        return cmd

    def _rank_env(self, rank: int) -> dict[str, str]:
        """torchrun's variables but MASTER_ADDR/PORT: ranks form their groups over the coordinator's store."""
        env = dict(os.environ)
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(self.ranks),
                   LOCAL_WORLD_SIZE=str(self.ranks), GROUP_RANK="0")
        env[PARENT_PID_ENV] = str(os.getpid())
        # As torchrun does: ranks sharing a host split its cores instead of each taking all of them.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.ranks)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
        env.pop(TOKEN_ENV, None)
        if self.security.token:
            env[TOKEN_ENV] = self.security.token
        return env

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        assert self.coordinator is not None
        while not self.coordinator.registry.wait_for_ranks(self.ranks, timeout=0.2):
            for rank, proc in enumerate(self._procs):
                if proc.poll() is not None:
                    raise RuntimeError(f"rank {rank} (pid {proc.pid}) exited with code {proc.returncode} "
                                       f"during startup")
            if time.monotonic() > deadline:
                raise TimeoutError(f"only some of {self.ranks} ranks registered within {timeout}s")

    def _watch_ranks(self) -> None:
        """Report ranks whose process ends while the cluster is up."""
        reported: set[int] = set()
        while not self._stopping.wait(0.2):
            for rank, proc in enumerate(self._procs):
                if rank not in reported and proc.poll() is not None:
                    reported.add(rank)
                    coordinator = self.coordinator
                    if coordinator is not None and not self._stopping.is_set():
                        coordinator.registry.mark_exited(rank, f"process {proc.pid} exited with code {proc.returncode}")


# ---------------------------------------------------------------- command lines

class _Stop(Exception):
    """Raised in the main thread by SIGINT/SIGTERM."""


def _raise_stop(signum: int, frame: object) -> None:
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)  # a second signal must not interrupt the cleanup
    raise _Stop(signal.Signals(signum).name)


def _wait_for_signal() -> None:
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _raise_stop)
    while True:
        time.sleep(0.2)  # short sleeps: a signal landing on a non-main thread is handled promptly


def _add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", default=".shardserve", help="directory of the SQLite catalog "
                        "(default %(default)s)")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds between rank "
                        "heartbeats; a rank is dead after 3 missed (default %(default)s)")
    parser.add_argument("--repair-after", type=float, default=30.0, help="seconds a rank stays dead before the "
                        "coordinator copies its shards' boxes from live replicas onto other ranks; copies a "
                        "restarted rank came back without are repaired at once (default %(default)s)")
    add_security_args(parser)


def _check_common_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.heartbeat_interval <= 0:
        parser.error("--heartbeat-interval must be > 0")
    if not args.repair_after >= 0:
        parser.error("--repair-after must be >= 0 seconds")


def main_up(argv: Sequence[str]) -> int:
    """`up`: run a coordinator and N ranks here in the foreground until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(prog="shardserve up", description="Run a coordinator and N shard-server "
                                     "ranks on this host; prints 'coordinator: HOST:PORT' when ready.")
    parser.add_argument("--ranks", type=int, default=2, help="number of ranks (default %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default %(default)s)")
    parser.add_argument("--port", type=int, default=0, help="coordinator port (0 = any free port)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (each rank takes cuda:LOCAL_RANK)")
    parser.add_argument("--memory-limit", type=int, default=None, help="bytes of shards per rank (0 = unlimited; "
                        "default: on CPU, 0.8 of the host's memory split among the ranks)")
    parser.add_argument("--max-request-bytes", type=int, default=0, help="largest ReadRegion box in bytes "
                        "(0 = unlimited)")
    parser.add_argument("--recycle-bytes", type=int, default=None, help="bytes of freed versions' memory each "
                        "rank keeps for reuse (0 = off; default: the rank's, 1 GiB)")
    parser.add_argument("--no-bulk-reads", action="store_true", help="ranks serve no bulk TCP port; remote "
                        "clients read over gRPC only (always so with TLS)")
    parser.add_argument("--startup-timeout", type=float, default=120.0, help="seconds to wait for the ranks")
    parser.add_argument("--demo", action="store_true", help="serve the demo table 'demo' (float32 1,000,000 x 64, "
                        "normal, seed 0, row-wise over all ranks), loaded from a DCP checkpoint written once "
                        "under the state dir")
    _add_common_args(parser)
    args = parser.parse_args(argv)
    if args.ranks < 1:
        parser.error("--ranks must be >= 1")
    for flag in ("memory_limit", "max_request_bytes", "port", "recycle_bytes"):
        if (getattr(args, flag) or 0) < 0:
            parser.error(f"--{flag.replace('_', '-')} must be >= 0")
    if args.port > 65535:
        parser.error(f"--port {args.port} is not a TCP port (0-65535)")
    if not args.host.strip():
        parser.error("--host is empty (an interface address, e.g. 127.0.0.1)")
    _check_common_args(parser, args)
    configure_logging(args.log_level)
    try:
        security = security_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    cluster = LocalCluster(args.ranks, token=security.token, state_dir=args.state_dir, tls=security.tls,
                           memory_limit=args.memory_limit, max_request_bytes=args.max_request_bytes,
                           heartbeat_interval=args.heartbeat_interval, host=args.host, port=args.port,
                           device=args.device, log_level=args.log_level, recycle_bytes=args.recycle_bytes,
                           bulk_reads=not args.no_bulk_reads, repair_after=args.repair_after)
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _raise_stop)
    try:
        cluster.start(timeout=args.startup_timeout)
        if args.demo:
            create_demo(cluster)
        print(f"coordinator: {cluster.address}", flush=True)
        _wait_for_signal()
    except _Stop as stop:
        log.info("%s received; stopping the cluster", stop)
    except (OSError, RuntimeError, TimeoutError, ValueError) as err:
        log.error("the cluster could not start: %s", err)
        return 1
    finally:
        cluster.stop()
    return 0


def create_demo(cluster: LocalCluster) -> pb.TensorInfo:
    """The demo table "demo" (float32 1,000,000 x 64), loaded from a DCP checkpoint it writes once: server.demo."""
    from server.demo import load_demo

    assert cluster.coordinator is not None
    return load_demo(cluster.coordinator, cluster.state_dir)


def main_coordinator(argv: Sequence[str]) -> int:
    """`coordinator`: run the coordinator alone (ranks join with torchrun ... -m server --coordinator)."""
    parser = argparse.ArgumentParser(prog="shardserve coordinator", description="Run the coordinator alone; "
                                     "prints 'coordinator: HOST:PORT' once serving.")
    parser.add_argument("--listen", default="0.0.0.0:50051", help="HOST:PORT to bind (default %(default)s)")
    parser.add_argument("--store-port", type=int, default=0, help="TCP port of the rendezvous store (a "
                        "torch.distributed TCPStore, on all interfaces) that collective jobs form their process "
                        "groups over; ranks learn it when they register (0 = any free port; default %(default)s)")
    _add_common_args(parser)
    args = parser.parse_args(argv)
    _check_common_args(parser, args)
    configure_logging(args.log_level)
    try:
        security = security_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _raise_stop)
    try:
        coordinator, running = start_coordinator(args.listen, args.state_dir, security, args.heartbeat_interval,
                                                 store_port=args.store_port, repair_after=args.repair_after)
    except (OSError, RuntimeError, ValueError) as err:
        log.error("the coordinator could not start: %s", err)
        return 1
    try:
        print(f"coordinator: {running.address}", flush=True)
        _wait_for_signal()
    except _Stop as stop:
        log.info("%s received; stopping the coordinator", stop)
    finally:
        running.stop(grace=1.0)
        coordinator.close()
    return 0
