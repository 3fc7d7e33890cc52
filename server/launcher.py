"""LocalCluster: a coordinator in this process and N rank processes on this host (what `up` runs).

The ranks are spawned in parallel as `python -m shardserve.server --coordinator
HOST:PORT` with torchrun's environment (server/rank_launch.py), so a local
cluster is the same world torchrun would start. Ranks exit when this process
dies (they watch their parent). A rank that exits while the cluster is up is
reported to the coordinator at once and restarted under its rank number
(server/supervisor.py, per its RestartPolicy); stop() sends SIGTERM, then
SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from shardserve.server.common.auth import Security
from shardserve.server.common.cli_args import CLUSTER_SECRET_FILE
from shardserve.server.common.grpc_server import RunningServer
from shardserve.server.common.ports import free_port
from shardserve.server.common.principals import ClusterSecret
from shardserve.server.common.rank_options import DEFAULT_LISTEN, RankOptions
from shardserve.server.common.tracing import disable_tracing, enable_tracing, tracing_enabled
from shardserve.server.coordinator_process import CoordinatorOptions, start_coordinator
from shardserve.server.rank_launch import rank_launches
from shardserve.server.supervisor import RankLaunch, RankSupervisor, RestartPolicy, exit_reason

if TYPE_CHECKING:  # imported lazily: they pull in torch, which the ranks import meanwhile
    from shardserve.server.coordinator.process import CoordinatorProcess
    from shardserve.server.coordinator.server import CoordinatorServer

log = logging.getLogger(__name__)


PORT_ATTEMPTS = 3
"""Ports a cluster with port=0 tries: one chosen free can be taken (another process's bind to any port) before
the coordinator binds it, after the ranks were told it."""


_NOT_RUNNING = ("T", "t", "Z", "X", None)
"""Thread states in /proc that run no code: stopped, traced, dead (and None: the thread ended)."""


def _wait_stopped(pid: int, *, timeout: float) -> None:
    """Return once no thread of process `pid` can run code (stopped, or gone), or `timeout` passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            states = [_thread_state(pid, task) for task in os.listdir(f"/proc/{pid}/task")]
        except FileNotFoundError:
            return
        if all(state in _NOT_RUNNING for state in states):
            return
        time.sleep(0.001)


def _thread_state(pid: int, task: str) -> str | None:
    """The scheduler state letter of one thread (None once it ended)."""
    try:
        with open(f"/proc/{pid}/task/{task}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


class LocalCluster:
    """A coordinator (in this process) and `ranks` rank processes on this host.

    `rank_options`: what every rank runs with (None: RankOptions(), ranks logging at this process's level); the
    cluster sets where each one listens (on `host`) and its metrics port. Its `tracing` exporter traces the
    coordinator's RPCs here too (with a tracer provider of its own, dropped at stop()).
    `security`: client auth (its principals), TLS, and the cluster credential, made anew at
    STATE_DIR/cluster-secret unless `security` holds one (a secret, or a cluster certificate name with mTLS).
    `restart_policy`: how each rank is restarted after its process ends (max_restarts=0, the default here, keeps
    a dead rank dead, as tests that kill ranks expect; `shardserve up` passes its --max-restarts, default 10).
    `metrics_port`: None, no metrics; P, the coordinator's on P and rank r's on P+1+r; 0, any free ports.
    `catalog`: where the coordinator keeps its catalog (None: STATE_DIR/catalog.sqlite; a postgresql:// URL).
    `peers`: the other coordinators sharing that catalog (HOST:PORT each): the ranks are given them after this
    one and follow whichever leads. Over a shared catalog (a lease: a postgresql:// catalog, or
    `coordinator_options.lease_duration`) this coordinator must lead when the cluster starts; `coordinator` is
    the parts of the term it led then.
    `start_method`: how the rank processes start (server/rank_start.py): "spawn", a new interpreter per rank,
    or "forkserver", forked from a process that imported torch once (a rank starts and restarts in a fraction
    of a second after the first; the calling script's main module must be guarded, as multiprocessing asks).
    """

    def __init__(
        self,
        ranks: int = 3,
        *,
        state_dir: str | Path = ".shardserve",
        host: str = "127.0.0.1",
        port: int = 0,
        rank_options: RankOptions | None = None,
        security: Security = Security(),
        coordinator_options: CoordinatorOptions = CoordinatorOptions(),
        restart_policy: RestartPolicy = RestartPolicy(max_restarts=0),
        metrics_port: int | None = None,
        catalog: str | None = None,
        peers: Sequence[str] = (),
        start_method: str = "spawn",
    ) -> None:
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        options = rank_options or RankOptions()
        per_rank = (options.advertise, options.metrics_port)
        if options.listen != DEFAULT_LISTEN or per_rank != (None, None):
            raise ValueError(
                "rank_options: listen, advertise and metrics_port are set per rank by the cluster "
                "(from host and metrics_port)"
            )
        self.ranks = ranks
        self.state_dir = Path(state_dir)
        self.host, self.port = host, port
        self.rank_options = dataclasses.replace(options, listen=f"{host}:0")
        self.security = security
        self.coordinator_options = coordinator_options
        self.restart_policy = restart_policy
        self.metrics_port = metrics_port
        self.catalog = catalog
        self.peers = tuple(peers)
        self.start_method = start_method
        self._traces = (
            False  # whether this cluster turned tracing on in this process (and turns it off)
        )
        self.coordinator: CoordinatorServer | None = None
        self._process: CoordinatorProcess | None = None
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
            if not self.security.has_cluster_credential:
                secret = ClusterSecret.generate().write(self.state_dir / CLUSTER_SECRET_FILE)
                self.security = dataclasses.replace(self.security, cluster=secret)
            for attempt in range(1, PORT_ATTEMPTS + 1):
                port = self.port or free_port(self.host)
                try:
                    self._start_at(port)
                    break
                except RuntimeError as err:  # grpcio's own, when it cannot bind
                    if self.port or attempt == PORT_ATTEMPTS or "Failed to bind" not in str(err):
                        raise
                    log.warning("port %d was taken before the coordinator bound it; another", port)
                    self._started().stop(grace=1.0)
            self._wait_ready(timeout)
            self._started().watch()
        except BaseException:
            self.stop()
            raise
        log.info("cluster of %d ranks ready at %s", self.ranks, self.address)
        return self

    def _start_at(self, port: int) -> None:
        """Spawn the ranks to register at `port`, then start the coordinator there."""
        self._supervisor = RankSupervisor(
            self._launches(",".join([f"{self._dial_host()}:{port}", *self.peers])),
            self.restart_policy,
            on_exit=self._report_exit,
            start_method=self.start_method,
        )
        self._supervisor.spawn_all()
        self._start_tracing()
        self._process, self._server = start_coordinator(
            f"{self.host}:{port}",
            self.state_dir,
            self.security,
            self.coordinator_options,
            metrics_port=self.metrics_port,
            catalog_location=self.catalog,
        )
        self.coordinator = self._process.role.current()
        if self.coordinator is None:
            leader = self._process.role.view().leader or "another coordinator"
            raise RuntimeError(
                f"{leader} leads the shared catalog: this coordinator stands by, so `up` cannot start "
                "its ranks on it (give that coordinator's address to `node --coordinator` instead)"
            )

    def _start_tracing(self) -> None:
        """Trace the coordinator's RPCs in this process (unless something here already traces)."""
        tracing = self.rank_options.tracing
        if tracing and not tracing_enabled():
            self._traces = enable_tracing(tracing, "shardserve-coordinator")

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
        """HOST:PORT clients dial the coordinator at (127.0.0.1 when bound to every interface)."""
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
        """Send `sig` to one rank's process (tests use it to simulate failures). SIGKILL waits until it is gone
        (its fds closed: a same-host client's shared-memory mapping then sees the rank dead too); SIGSTOP until
        every thread of it has stopped (the kernel stops them one by one as each is next scheduled, so on a
        busy host a thread may answer a call made after os.kill returned)."""
        proc = self._started().process(rank)
        os.kill(proc.pid, sig)
        if sig == signal.SIGKILL:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        elif sig == signal.SIGSTOP:
            _wait_stopped(proc.pid, timeout=30)

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
            if self._process is not None:
                self._process.close()
                self._process = self.coordinator = None
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
        return rank_launches(
            coordinator,
            self.rank_options,
            self.security,
            ranks=range(self.ranks),
            world_size=self.ranks,
            metrics_port=self.metrics_port,
        )

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
