"""`up` (a coordinator plus N local ranks), `coordinator` alone, and LocalCluster, the code both share.

LocalCluster runs the coordinator in this process and spawns the ranks in
parallel as `python -m shardserve.server --coordinator HOST:PORT` with torchrun's
environment, so a local cluster is the same world torchrun would start.
Ranks exit when this process dies (they watch their parent). A rank that
exits while the cluster is up is reported to the coordinator at once and
restarted under its rank number (server/supervisor.py, up to `max_restarts`
times); stop() sends SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.server.common.auth import Security, TlsFiles
from shardserve.server.common.cli_args import (
    CLUSTER_SECRET_FILE,
    add_metrics_args,
    add_security_args,
    configure_logging,
    security_from_args,
    stream_limits_from_args,
    with_state_dir_secret,
)
from shardserve.server.common.grpc_server import RunningServer, split_address, start_server
from shardserve.server.common.principals import ClusterCertificate, ClusterSecret, PrincipalBook
from shardserve.server.common.stop_signals import (
    Stop,
    handle_reload_signal,
    handle_stop_signals,
    wait_for_stop_signal,
)
from shardserve.server.common.stream_limits import StreamLimitSettings
from shardserve.server.common.tracing import (
    add_tracing_args,
    check_exporter,
    disable_tracing,
    enable_tracing,
    tracing_enabled,
    tracing_flags,
)
from shardserve.server.supervisor import (  # noqa: F401 - PROJECT_ROOT is read from here by tests
    PROJECT_ROOT,
    RankLaunch,
    RankSupervisor,
    RestartPolicy,
    add_rank_args,
    check_rank_args,
    exit_reason,
    rank_command,
    rank_env,
    rank_metrics_flags,
)

if TYPE_CHECKING:  # imported lazily: they pull in torch, which the ranks import meanwhile
    from shardserve.server.coordinator.metrics import CoordinatorMetrics
    from shardserve.server.coordinator.server import CoordinatorServer

log = logging.getLogger(__name__)

CATALOG_FILE = "catalog.sqlite"
COORDINATOR_WORKERS = (
    64  # gRPC threads: 16 queued reshards took all 16 and ranks were declared dead
)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def start_coordinator(
    listen: str,
    state_dir: str | Path,
    security: Security,
    heartbeat_interval: float = 1.0,
    rpc_timeout: float = 60.0,
    pending_timeout: float = 600.0,
    store_port: int = 0,
    repair_after: float = 30.0,
    metrics_port: int | None = None,
) -> tuple[CoordinatorServer, RunningServer]:
    """A CoordinatorServer over the SQLite catalog in `state_dir`, served on `listen`, hosting the rendezvous store
    of collective jobs on `store_port` (0 = any free port) of the `listen` host, repairing copies dead for
    `repair_after` s; with `metrics_port` (0 = any free port), its Prometheus metrics served on the `listen` host."""
    from shardserve.server.coordinator.catalog import SQLiteCatalog
    from shardserve.server.coordinator.metrics import CoordinatorMetrics, TimedCatalog
    from shardserve.server.coordinator.server import CoordinatorServer, CoordinatorSettings
    from shardserve.server.coordinator.service import CoordinatorServicer

    catalog = SQLiteCatalog(Path(state_dir) / CATALOG_FILE)
    metrics = CoordinatorMetrics() if metrics_port is not None else None
    coordinator = CoordinatorServer(
        TimedCatalog(catalog, metrics.catalog_latency) if metrics else catalog,
        security,
        CoordinatorSettings(
            heartbeat_interval=heartbeat_interval,
            rpc_timeout=rpc_timeout,
            pending_timeout=pending_timeout,
            store_port=store_port,
            store_host=split_address(listen)[0],
            repair_after=repair_after,
        ),
    )

    def add(server: object) -> list[str]:
        pb_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(coordinator), server)
        return [pb.DESCRIPTOR.services_by_name["Coordinator"].full_name]

    try:  # reshard and checkpoint streams hold a worker for their whole run: room left for heartbeats and reads
        coordinator.start()
        if metrics is not None:
            serve_coordinator_metrics(coordinator, metrics, listen, metrics_port or 0)
        running = start_server(
            listen, security, add, StreamLimitSettings(workers=COORDINATOR_WORKERS), metrics
        )
    except Exception:
        coordinator.close()
        raise
    return coordinator, running


def serve_coordinator_metrics(
    coordinator: CoordinatorServer, metrics: CoordinatorMetrics, listen: str, port: int
) -> None:
    """Serve `metrics` (watching `coordinator`) on the `listen` host at `port`; ListRanks tells its address."""
    coordinator.serve_metrics(metrics, split_address(listen)[0], port)


class LocalCluster:
    """A coordinator (in this process) and `ranks` rank processes on this host.

    `max_restarts`: how many times each rank is restarted after its process ends (0, the default here, keeps a
    dead rank dead, as tests that kill ranks expect; `shardserve up` passes its --max-restarts, default 10);
    `restart_backoff`: seconds before the first restart of a rank, doubling up to 30 s.
    `token` (one admin token) and/or `tokens_file` (principals, server/common/principals.py) turn client auth on;
    the cluster credential is read from `cluster_secret_file`, or made anew at STATE_DIR/cluster-secret, unless
    `cluster_cert_name` (mTLS: `tls` with a CA) names the cluster's certificates, which then suffice.
    `tracing` (an exporter: otlp, console, file:DIR; server.common.tracing) traces the coordinator's RPCs here
    (with a tracer provider of its own, dropped at stop()) and the ranks'.
    """

    def __init__(
        self,
        ranks: int = 3,
        token: str | None = None,
        state_dir: str | Path = ".shardserve",
        tls: TlsFiles | None = None,
        memory_limit: int | None = None,
        max_request_bytes: int | None = None,
        heartbeat_interval: float = 1.0,
        host: str = "127.0.0.1",
        port: int = 0,
        device: str = "cpu",
        rpc_timeout: float = 60.0,
        pending_timeout: float = 600.0,
        log_level: str | None = None,
        recycle_bytes: int | None = None,
        bulk_reads: bool = True,
        max_restarts: int = 0,
        restart_backoff: float = 1.0,
        repair_after: float = 30.0,
        version_grace: float | None = None,
        tokens_file: str | None = None,
        cluster_secret_file: str | None = None,
        cluster_cert_name: str | None = None,
        rank_limits: StreamLimitSettings = StreamLimitSettings(),
        persist_dir: str | Path | None = None,
        fsync: str | None = None,
        metrics_port: int | None = None,
        tracing: str | None = None,
    ) -> None:
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        if version_grace is not None and not 0 <= version_grace < float("inf"):
            raise ValueError(f"version_grace must be >= 0 seconds, got {version_grace}")
        self.ranks = ranks
        principals = PrincipalBook(tokens_file, token) if tokens_file or token else None
        cluster_cert = (
            ClusterCertificate(cluster_cert_name) if cluster_cert_name is not None else None
        )
        self.security = Security(
            token=token or None, tls=tls, principals=principals, cluster_cert=cluster_cert
        )
        self.cluster_secret_file = cluster_secret_file
        self.rank_limits = rank_limits  # the ranks' stream limits and stall timeout
        self.metrics_port = (
            metrics_port  # None: no metrics; P: coordinator P, rank r P+1+r; 0: any free ports
        )
        self.tracing = (
            check_exporter(tracing) if tracing else None
        )  # --tracing of the coordinator and ranks
        self._traces = (
            False  # whether this cluster turned tracing on in this process (and turns it off)
        )
        self.state_dir = Path(state_dir)
        self.memory_limit = memory_limit  # None: each rank's share of the host's memory
        self.recycle_bytes = recycle_bytes  # None: the rank's default
        self.version_grace = version_grace  # None: the rank's default (--version-grace)
        self.persist_dir = (
            persist_dir  # None: memory only; else each rank persists under persist_dir/rank-N
        )
        self.fsync = fsync  # None: the rank's default (--fsync)
        self.max_request_bytes = max_request_bytes or 0
        self.bulk_reads = (
            bulk_reads  # False: ranks serve no bulk TCP port (server/rank/reads/bulk.py)
        )
        self.heartbeat_interval = heartbeat_interval
        self.repair_after = repair_after
        self.host, self.port, self.device = host, port, device
        self.rpc_timeout, self.pending_timeout = rpc_timeout, pending_timeout
        self.log_level = log_level or logging.getLevelName(logging.getLogger().getEffectiveLevel())
        self.restart_policy = RestartPolicy(
            max_restarts, restart_backoff, max(30.0, restart_backoff)
        )
        self.coordinator: CoordinatorServer | None = None
        self._server: RunningServer | None = None
        self._supervisor: RankSupervisor | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 60.0) -> LocalCluster:
        """Start the ranks, then the coordinator they register with; return once all have registered.

        The ranks are spawned first (with the coordinator's port chosen up front) so that their torch
        imports overlap this process's; they retry registering until the coordinator answers. A rank that
        exits during startup fails the start; restarts begin once every rank registered.
        """
        try:
            if self.cluster_secret_file or self.security.cluster_cert is None:
                self.security = dataclasses.replace(self.security, cluster=self._cluster_secret())
            port = self.port or free_port(self.host)
            self._supervisor = RankSupervisor(
                self._launches(f"{self._dial_host()}:{port}"),
                self.restart_policy,
                on_exit=self._report_exit,
            )
            self._supervisor.spawn_all()
            self._start_tracing()
            self.coordinator, self._server = start_coordinator(
                f"{self.host}:{port}",
                self.state_dir,
                self.security,
                self.heartbeat_interval,
                self.rpc_timeout,
                self.pending_timeout,
                repair_after=self.repair_after,
                metrics_port=self.metrics_port,
            )
            self._wait_ready(timeout)
            self._supervisor.watch()
        except BaseException:
            self.stop()
            raise
        log.info("cluster of %d ranks ready at %s", self.ranks, self.address)
        return self

    def _start_tracing(self) -> None:
        """Trace the coordinator's RPCs in this process (unless something here already traces)."""
        if self.tracing and not tracing_enabled():
            self._traces = enable_tracing(self.tracing, "shardserve-coordinator")

    def _cluster_secret(self) -> ClusterSecret:
        """The internal credential: from --cluster-secret-file, or a new one written for the ranks to read."""
        if self.cluster_secret_file:
            return ClusterSecret.from_file(self.cluster_secret_file)
        return ClusterSecret.generate().write(self.state_dir / CLUSTER_SECRET_FILE)

    @property
    def cluster_metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata of the cluster credential (what the coordinator presents to its ranks)."""
        return self.security.call_metadata()

    def reload_principals(self) -> None:
        """Re-read the tokens file here and in every rank (SIGHUP to `up` does this)."""
        if self.security.principals is None:
            return
        self.security.principals.reload()
        if self._supervisor is not None:
            self._supervisor.signal_all(signal.SIGHUP)

    @property
    def address(self) -> str:
        if self._server is None:
            raise RuntimeError("the cluster is not started")
        return f"{self._dial_host()}:{self._server.port}"

    def _dial_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "[::]", "") else self.host

    @property
    def rank_pids(self) -> list[int]:
        """The current process id of every rank, by rank (a restarted rank's new one)."""
        return self._started().pids()

    def restarts(self, rank: int) -> int:
        """How many times `rank` was restarted."""
        return self._started().restarts(rank)

    def stays_dead(self, rank: int) -> bool:
        """Whether `rank` exited with no restarts left."""
        return self._started().stays_dead(rank)

    def kill_rank(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to one rank's process (tests use it to simulate failures); SIGKILL waits until it is gone
        (its fds closed: a same-host client's shared-memory mapping then sees the rank dead too)."""
        proc = self._started().process(rank)
        os.kill(proc.pid, sig)
        if sig == signal.SIGKILL:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM every rank, SIGKILL those still alive after `grace`, then stop the coordinator; no rank is
        restarted once this began. Idempotent."""
        with self._lock:
            if self.coordinator is not None:
                self.coordinator.stop()
            if self._supervisor is not None:
                self._supervisor.stop(grace)
            if self._server is not None:
                self._server.stop(grace=1.0)
            if self.coordinator is not None:
                self.coordinator.close()
                self.coordinator = None
            if self._traces:
                disable_tracing()
                self._traces = False

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ ranks

    def _started(self) -> RankSupervisor:
        if self._supervisor is None:
            raise RuntimeError("the cluster is not started")
        return self._supervisor

    def _launches(self, coordinator: str) -> list[RankLaunch]:
        command = rank_command(
            coordinator,
            self.host,
            self.device,
            self.max_request_bytes,
            self.log_level,
            self.security,
            self.memory_limit,
            self.recycle_bytes,
            self.bulk_reads,
            self.version_grace,
            self.rank_limits,
            self.persist_dir,
            self.fsync,
        )
        return [
            RankLaunch(
                rank,
                command + rank_metrics_flags(self.metrics_port, rank) + tracing_flags(self.tracing),
                rank_env(rank, rank, self.ranks, self.ranks, self.security.token),
            )
            for rank in range(self.ranks)
        ]

    def _report_exit(self, rank: int, reason: str) -> None:
        """Tell the coordinator at once that a rank's process ended (it need not wait for missed heartbeats)."""
        coordinator = self.coordinator
        if coordinator is not None:
            coordinator.registry.mark_exited(rank, reason)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        assert self.coordinator is not None and self._supervisor is not None
        while not self.coordinator.registry.wait_for_ranks(self.ranks, timeout=0.2):
            for rank in range(self.ranks):
                proc = self._supervisor.process(rank)
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"rank {rank} (pid {proc.pid}) {exit_reason(proc.returncode)} "
                        f"during startup"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(f"only some of {self.ranks} ranks registered within {timeout}s")


# ---------------------------------------------------------------- command lines


def _add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir",
        default=".shardserve",
        help="directory of the SQLite catalog (default %(default)s)",
    )
    parser.add_argument(
        "--heartbeat-interval",
        type=float,
        default=1.0,
        help="seconds between rank heartbeats; a rank is dead after 3 missed (default %(default)s)",
    )
    parser.add_argument(
        "--repair-after",
        type=float,
        default=30.0,
        help="seconds a rank stays dead before the "
        "coordinator copies its shards' boxes from live replicas onto other ranks; copies a "
        "restarted rank came back without are repaired at once (default %(default)s)",
    )
    add_security_args(parser)


def _check_common_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.heartbeat_interval <= 0:
        parser.error("--heartbeat-interval must be > 0")
    if not args.repair_after >= 0:
        parser.error("--repair-after must be >= 0 seconds")


def main_up(argv: Sequence[str]) -> int:
    """`up`: run a coordinator and N ranks here in the foreground until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(
        prog="shardserve up",
        description="Run a coordinator and N shard-server "
        "ranks on this host; prints 'coordinator: HOST:PORT' when ready.",
    )
    parser.add_argument(
        "--ranks", type=int, default=2, help="number of ranks (default %(default)s)"
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="interface to bind (default %(default)s)"
    )
    parser.add_argument("--port", type=int, default=0, help="coordinator port (0 = any free port)")
    add_rank_args(parser)
    parser.add_argument(
        "--startup-timeout", type=float, default=120.0, help="seconds to wait for the ranks"
    )
    parser.add_argument(
        "--no-persist",
        action="store_true",
        help="keep shards in memory only: a restarted "
        "rank or cluster comes back empty (default: persist under --persist-dir, STATE_DIR/data)",
    )
    parser.add_argument(
        "--demo",
        action="store_true",
        help="serve the demo table 'demo' (float32 1,000,000 x 64, "
        "normal, seed 0, row-wise over all ranks), loaded from a DCP checkpoint written once "
        "under the state dir",
    )
    _add_common_args(parser)
    args = parser.parse_args(argv)
    if args.ranks < 1:
        parser.error("--ranks must be >= 1")
    check_rank_args(parser, args)
    if args.port < 0:
        parser.error("--port must be >= 0")
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
    cluster = LocalCluster(
        args.ranks,
        token=security.token,
        state_dir=args.state_dir,
        tls=security.tls,
        memory_limit=args.memory_limit,
        max_request_bytes=args.max_request_bytes,
        heartbeat_interval=args.heartbeat_interval,
        host=args.host,
        port=args.port,
        device=args.device,
        log_level=args.log_level,
        recycle_bytes=args.recycle_bytes,
        bulk_reads=not args.no_bulk_reads,
        max_restarts=args.max_restarts,
        restart_backoff=args.restart_backoff,
        repair_after=args.repair_after,
        version_grace=args.version_grace,
        tokens_file=args.tokens_file,
        cluster_secret_file=args.cluster_secret_file,
        cluster_cert_name=args.cluster_cert_name,
        rank_limits=stream_limits_from_args(args),
        persist_dir=None if args.no_persist else args.persist_dir or Path(args.state_dir) / "data",
        fsync=args.fsync,
        metrics_port=args.metrics_port,
        tracing=args.tracing,
    )
    handle_stop_signals()
    handle_reload_signal(cluster.reload_principals)
    try:
        cluster.start(timeout=args.startup_timeout)
        if args.demo:
            create_demo(cluster)
        print(f"coordinator: {cluster.address}", flush=True)
        wait_for_stop_signal()
    except Stop as stop:
        log.info("%s received; stopping the cluster", stop)
    except (OSError, RuntimeError, TimeoutError, ValueError) as err:
        log.error("the cluster could not start: %s", err)
        return 1
    finally:
        cluster.stop()
    return 0


def create_demo(cluster: LocalCluster) -> pb.TensorInfo:
    """The demo table "demo" (float32 1,000,000 x 64), loaded from a DCP checkpoint it writes once: server.demo."""
    from shardserve.server.demo import load_demo

    assert cluster.coordinator is not None
    return load_demo(cluster.coordinator, cluster.state_dir)


def main_coordinator(argv: Sequence[str]) -> int:
    """`coordinator`: run the coordinator alone (ranks join with torchrun ... -m shardserve.server --coordinator)."""
    parser = argparse.ArgumentParser(
        prog="shardserve coordinator",
        description="Run the coordinator alone; prints 'coordinator: HOST:PORT' once serving.",
    )
    parser.add_argument(
        "--listen", default="0.0.0.0:50051", help="HOST:PORT to bind (default %(default)s)"
    )
    parser.add_argument(
        "--store-port",
        type=int,
        default=0,
        help="TCP port of the rendezvous store (a "
        "torch.distributed TCPStore, on the --listen host) that collective jobs form their process "
        "groups over; ranks learn it when they register (0 = any free port; default %(default)s)",
    )
    add_metrics_args(parser)
    add_tracing_args(parser)
    _add_common_args(parser)
    args = parser.parse_args(argv)
    _check_common_args(parser, args)
    if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
        parser.error(f"--metrics-port {args.metrics_port} is not a TCP port (0-65535)")
    configure_logging(args.log_level)
    try:
        security = with_state_dir_secret(security_from_args(args), args.state_dir)
        if args.tracing:
            enable_tracing(args.tracing, "shardserve-coordinator")
    except (OSError, ValueError) as err:
        parser.error(str(err))
    handle_stop_signals()
    if security.principals is not None:
        handle_reload_signal(security.principals.reload)
    try:
        coordinator, running = start_coordinator(
            args.listen,
            args.state_dir,
            security,
            args.heartbeat_interval,
            store_port=args.store_port,
            repair_after=args.repair_after,
            metrics_port=args.metrics_port,
        )
    except (OSError, RuntimeError, ValueError) as err:
        log.error("the coordinator could not start: %s", err)
        return 1
    try:
        print(f"coordinator: {running.address}", flush=True)
        wait_for_stop_signal()
    except Stop as stop:
        log.info("%s received; stopping the coordinator", stop)
    finally:
        running.stop(grace=1.0)
        coordinator.close()
    return 0
