"""One rank: serve its ShardServer, register with the coordinator and heartbeat.

Started by the local launcher or by torchrun (`torchrun ... -m shardserve.server
--coordinator HOST:PORT`); it reads RANK / WORLD_SIZE / LOCAL_RANK like any
torchrun worker. It joins no torch.distributed world: collective jobs form
their process groups per epoch over the coordinator's rendezvous store, whose
port the RegisterRank answer gives (rank/jobs/groups.py), so MASTER_ADDR /
MASTER_PORT are not used. SIGTERM or SIGINT stops it cleanly; under the
launcher it also exits when the launcher dies.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import grpc
import torch

from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.protos.same_host import host_id
from shardserve.server.common.auth import Security, make_channel, server_ssl_context
from shardserve.server.common.cli_args import (
    PARENT_PID_ENV,
    add_metrics_args,
    add_security_args,
    add_stream_limit_args,
    configure_logging,
    security_from_args,
    stream_limits_from_args,
)
from shardserve.server.common.errors import ServiceError
from shardserve.server.common.grpc_server import RunningServer, split_address, start_server
from shardserve.server.common.metrics import MetricsEndpoint, serve_metrics
from shardserve.server.common.tracing import add_tracing_args, check_exporter, enable_tracing
from shardserve.server.rank.jobs.groups import ProcessGroups
from shardserve.server.rank.malloc_tuning import tune_malloc
from shardserve.server.rank.memory_budget import (
    HOST_MEMORY_FRACTION,
    default_memory_limit,
    host_memory_bytes,
    ranks_on_host,
)
from shardserve.server.rank.persistence import (
    FSYNC_INTERVAL_S,
    FsyncPolicy,
    Persistence,
    RestoreCount,
)
from shardserve.server.rank.reads.bulk import BulkReads
from shardserve.server.rank.recycling import DEFAULT_MAX_BYTES as DEFAULT_RECYCLE_BYTES
from shardserve.server.rank.service import ShardServerServicer, add_shard_server
from shardserve.server.rank.store import DEFAULT_VERSION_GRACE_S, ShardStore

log = logging.getLogger(__name__)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m shardserve.server",
        description="Run one shard-server rank (torchrun-compatible: reads RANK, "
        "WORLD_SIZE, LOCAL_RANK; MASTER_ADDR and MASTER_PORT are not used).",
    )
    parser.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator")
    parser.add_argument(
        "--listen",
        default="127.0.0.1:0",
        help="HOST:PORT this rank's ShardServer binds "
        "(port 0 = any free port; default %(default)s)",
    )
    parser.add_argument(
        "--advertise",
        default=None,
        help="HOST:PORT clients should dial (default: the "
        "bound address, with this host's name when listening on 0.0.0.0)",
    )
    parser.add_argument(
        "--bulk-port",
        type=int,
        default=0,
        help="TCP port of this rank's bulk reads, on the "
        "--listen host (0 = any free port; default %(default)s; see server/rank/reads/bulk.py)",
    )
    parser.add_argument(
        "--no-bulk-reads",
        action="store_true",
        help="serve no bulk port: remote clients "
        "read over gRPC only (with TLS on, the bulk port speaks TLS with the same certificates)",
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda (= cuda:LOCAL_RANK) or cuda:K")
    parser.add_argument(
        "--memory-limit",
        type=int,
        default=None,
        help="bytes of shards this rank may hold "
        "(0 = unlimited; default: on CPU, 0.8 of the host's memory divided by LOCAL_WORLD_SIZE, "
        "so ranks sharing a host refuse allocations instead of being OOM-killed together)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=0,
        help="largest box one ReadRegion may ask for, in bytes (0 = unlimited)",
    )
    parser.add_argument(
        "--recycle-bytes",
        type=int,
        default=DEFAULT_RECYCLE_BYTES,
        help="bytes of freed "
        "versions' memory kept for the next reshard, update or put of the same size (0 = off; "
        "default %(default)s)",
    )
    parser.add_argument(
        "--version-grace",
        type=float,
        default=DEFAULT_VERSION_GRACE_S,
        help="seconds a "
        "replaced version stays readable after a newer one is served, so reads in flight finish "
        "on it (0 = drop at once; ends early when its memory is needed; default %(default)s)",
    )
    parser.add_argument(
        "--persist-dir",
        default=None,
        help="directory under which this rank persists its "
        "shards and update log (in rank-N/, N its RANK) and restores them from when it starts "
        "(default: none, memory only; `up` passes STATE_DIR/data unless --no-persist)",
    )
    parser.add_argument(
        "--fsync",
        choices=[p.value for p in FsyncPolicy],
        default=FsyncPolicy.ALWAYS.value,
        help="when the update log is fsynced: always (before a commit is acknowledged), interval "
        f"(every {FSYNC_INTERVAL_S * 1000:.0f} ms: a crash loses at most that window of "
        "acknowledged updates) or none (the kernel decides); default %(default)s",
    )
    parser.add_argument(
        "--dist-timeout",
        type=float,
        default=120.0,
        help="longest wait, in seconds, on the "
        "coordinator's rendezvous store when a collective job forms its process group (the "
        "job's own timeout bounds it too; default %(default)s)",
    )
    parser.add_argument(
        "--register-timeout",
        type=float,
        default=60.0,
        help="seconds to keep trying to register with the coordinator (default %(default)s)",
    )
    add_metrics_args(parser)
    add_tracing_args(parser)
    add_security_args(parser)
    add_stream_limit_args(parser)
    args = parser.parse_args(argv)
    try:
        stream_limits_from_args(args)
        if args.tracing:
            check_exporter(args.tracing)
    except ValueError as err:
        parser.error(str(err))
    for flag in ("memory_limit", "max_request_bytes", "recycle_bytes", "bulk_port", "metrics_port"):
        if (getattr(args, flag) or 0) < 0:
            parser.error(f"--{flag.replace('_', '-')} must be >= 0")
    if not 0 <= args.version_grace < math.inf:
        parser.error(f"--version-grace must be >= 0 seconds, got {args.version_grace}")
    for flag in ("dist_timeout", "register_timeout"):
        if not 0 < getattr(args, flag) < math.inf:
            parser.error(
                f"--{flag.replace('_', '-')} must be a number of seconds > 0, got {getattr(args, flag)}"
            )
    return args


def resolve_device(device: str, local_rank: int) -> str:
    """ "cuda" means this rank's local GPU; anything else must be cpu or cuda:K."""
    if device == "cuda":
        device = f"cuda:{local_rank}"
    if device != "cpu" and not device.startswith("cuda:"):
        raise ValueError(f"--device {device!r} is not cpu, cuda or cuda:K")
    if device.startswith("cuda"):
        index = int(device.split(":", 1)[1])
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"--device {device}: this host has {torch.cuda.device_count()} CUDA devices"
            )
        torch.cuda.set_device(torch.device(device))
    return device


def resolve_memory_limit(given: int | None, device: str) -> int:
    """--memory-limit as given, else this rank's share of the host's memory (server/rank/memory_budget.py)."""
    if given is not None:
        return given
    limit = default_memory_limit(device, host_memory_bytes(), ranks_on_host(os.environ))
    if limit:
        log.info(
            "memory limit %d bytes: %.0f%% of this host's memory over %s rank(s) on it (--memory-limit "
            "to change; 0 = unlimited)",
            limit,
            HOST_MEMORY_FRACTION * 100,
            os.environ.get("LOCAL_WORLD_SIZE", "1"),
        )
    return limit


def watch_parent(stop: threading.Event) -> None:
    """Under the launcher: stop when the launcher process is gone (checked every 0.5 s)."""
    parent = int(os.environ.get(PARENT_PID_ENV, "0") or 0)
    if not parent:
        return

    def watch() -> None:
        while not stop.wait(0.5):
            if os.getppid() != parent:
                log.error("the launcher (pid %d) is gone; stopping", parent)
                stop.set()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class CoordinatorLink:
    """Registers this rank with the coordinator and keeps it alive with heartbeats."""

    def __init__(
        self,
        address: str,
        security: Security,
        info: pb.RankInfo,
        store: ShardStore,
        groups: ProcessGroups | None = None,
    ) -> None:
        self.info = info
        self.store = store
        self.groups = groups
        self.coordinator_host = (
            address.rpartition(":")[0].strip("[]") or address
        )  # the store is on its host
        self.interval = 1.0
        self._channel = make_channel(address, security)
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)

    def register(self, timeout: float) -> None:
        """Register, retrying while the coordinator is unreachable, for at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        delay = 0.1
        while True:
            try:
                self._register_once()
                return
            except grpc.RpcError as err:
                if (
                    err.code()
                    not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                    or time.monotonic() + delay > deadline
                ):
                    raise
                log.debug("coordinator not reachable yet (%s); retrying", err.details())
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _register_once(self) -> None:
        self.info.memory_used_bytes = self.store.memory_used
        held = [pb.HeldVersion(name=n, version=v) for n, v, _ in self.store.held()]
        response = self._stub.RegisterRank(
            pb.RegisterRankRequest(rank=self.info, held=held), timeout=10.0
        )
        self.interval = response.heartbeat_interval_s or 1.0
        if self.groups is not None and response.store_port:
            self.groups.set_store(response.store_host or self.coordinator_host, response.store_port)
        log.info(
            "rank %d registered with the coordinator (heartbeat every %.2fs)",
            self.info.rank,
            self.interval,
        )

    def start(self) -> None:
        self._thread.start()

    def _heartbeat_loop(self) -> None:
        unreachable = False
        while not self._stop.wait(self.interval):
            request = pb.HeartbeatRequest(
                rank=self.info.rank, memory_used_bytes=self.store.memory_used
            )
            try:
                self._stub.Heartbeat(request, timeout=max(2.0, 2 * self.interval))
                if unreachable:
                    log.info("coordinator reachable again")
                unreachable = False
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    log.warning(
                        "coordinator does not know rank %d; registering again", self.info.rank
                    )
                    self._try(self._register_once)
                elif not unreachable:
                    unreachable = True
                    log.warning("heartbeat failed: %s %s", err.code().name, err.details())

    def _try(self, action: Callable[[], None]) -> None:
        try:
            action()
        except grpc.RpcError as err:
            log.warning("registering again failed: %s %s", err.code().name, err.details())

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():  # not started when registering failed
            self._thread.join(timeout=5.0)
        self._channel.close()


def advertised_address(running: RunningServer, advertise: str | None) -> str:
    if advertise:
        return advertise
    host = socket.gethostname() if running.host in ("0.0.0.0", "[::]") else running.host
    return f"{host}:{running.port}"


def main(argv: Sequence[str]) -> int:
    """Run one rank until SIGTERM/SIGINT (or the launcher's death)."""
    args = parse_args(argv)
    configure_logging(args.log_level)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    watch_parent(stop)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        device = resolve_device(args.device, int(os.environ.get("LOCAL_RANK", "0")))
        security = security_from_args(args)
        if args.tracing:  # before any server or channel is made: they are traced from the start
            enable_tracing(args.tracing, f"shardserve-rank-{rank}", {"shardserve.rank": rank})
    except ValueError as err:
        log.error("%s", err)
        return 2
    if not security.has_cluster_credential:
        log.error(
            "no cluster credential: pass --cluster-secret-file (the coordinator's STATE_DIR/cluster-secret; "
            "`up` and `node` pass it themselves), or --cluster-cert-name with mTLS"
        )
        return 2
    principals = security.principals
    signal.signal(signal.SIGHUP, lambda *_: principals.reload() if principals is not None else None)
    log.debug("malloc settings: %s", tune_malloc() or "glibc defaults")
    try:
        memory_limit = resolve_memory_limit(args.memory_limit, device)
    except ValueError as err:
        log.error("%s", err)
        return 2
    try:
        persistence = open_persistence(args, rank)
    except ServiceError as err:
        log.error("--persist-dir: %s", err.message)
        return 2
    store = ShardStore(
        rank,
        device,
        memory_limit,
        args.max_request_bytes,
        recycle_bytes=args.recycle_bytes,
        version_grace=args.version_grace,
        persistence=persistence,
    )
    restore(store, RestoreReporter(args.coordinator, security, rank))
    try:
        bulk_reads = open_bulk_reads(args, security, store)
    except OSError as err:
        log.error("--bulk-port %d: cannot listen: %s", args.bulk_port, err)
        return 2
    groups = ProcessGroups(rank, device, store_timeout_s=args.dist_timeout)
    try:
        endpoint = open_metrics(args, store)
    except (OSError, ValueError) as err:
        log.error("--metrics-port %s: cannot serve metrics: %s", args.metrics_port, err)
        bulk_reads.close()
        return 2
    running = start_server(
        args.listen,
        security,
        lambda server: [
            add_shard_server(
                server, ShardServerServicer(store, bulk_reads=bulk_reads, groups=groups)
            )
        ],
        stream_limits_from_args(args),
        metrics=store.metrics if endpoint is not None else None,
    )
    info = pb.RankInfo(
        rank=rank,
        address=advertised_address(running, args.advertise),
        device=device,
        hostname=socket.gethostname(),
        memory_limit_bytes=memory_limit,
        world_size=world_size,
        pid=os.getpid(),
        host_id=host_id(),
        shared_memory=store.hands_over_by_reference,
        metrics_address=advertised_metrics(endpoint, args.advertise),
    )
    link = CoordinatorLink(args.coordinator, security, info, store, groups)
    try:
        try:
            link.register(args.register_timeout)
        except grpc.RpcError as err:
            log.error(
                "rank %d could not register with the coordinator at %s within --register-timeout %gs: "
                "%s: %s",
                rank,
                args.coordinator,
                args.register_timeout,
                err.code().name,
                err.details(),
            )
            return 1
        link.start()
        while not stop.wait(0.2):  # a short wait: signals may land on a non-main thread
            store.shared.recycled.expire()  # an idle rank gives kept buffers back after their max age too
            store.end_graces()  # replaced versions past --version-grace
        log.info("rank %d stopping", rank)
    finally:
        _shutdown(
            link, running, bulk_reads
        )  # the metrics endpoint's daemon thread ends with the process
        if persistence is not None:
            persistence.close()
    return 0


def open_persistence(args: argparse.Namespace, rank: int) -> Persistence | None:
    """The rank's Persistence over --persist-dir (None without one)."""
    if not args.persist_dir:
        return None
    folder = Path(args.persist_dir) / f"rank-{rank}"
    persistence = Persistence(rank, folder, FsyncPolicy(args.fsync))
    log.info("rank %d persists to %s (--fsync %s)", rank, folder, args.fsync)
    return persistence


RESTORE_HOLD_ENV = "SHARDSERVE_DEBUG_RESTORE_HOLD"  # PATH: after its first tensor, a restore waits while PATH exists
RESTORE_HOLD_MAX_S = 120.0


class RestoreReporter:
    """Tells the coordinator how far this rank's restore is (ReportRestore), at most every REPORT_EVERY_S and at
    the end, so `shardserve status` shows it; a coordinator not reachable yet only misses reports."""

    REPORT_EVERY_S = 0.5

    def __init__(self, address: str, security: Security, rank: int) -> None:
        self.address = address
        self.security = security
        self.rank = rank
        self.last = RestoreCount()
        self._reported_at = 0.0
        self._stub: pb_grpc.CoordinatorStub | None = None
        self._channel: grpc.Channel | None = None

    def __call__(self, count: RestoreCount) -> None:
        """Record `count`; report it when the last report is old enough or the restore reached its end."""
        self.last = replace(count)
        hold = os.environ.get(RESTORE_HOLD_ENV)
        held = bool(hold) and count.done_tensors >= 1 and os.path.exists(hold)
        if (
            held
            or time.monotonic() - self._reported_at >= self.REPORT_EVERY_S
            or count.done_tensors == count.total_tensors
        ):
            self._report(loaded=False)
        if held:
            _hold_while_exists(hold, self.rank)

    def finish(self) -> None:
        """Report that every file is read (the rank registers next), then close the channel."""
        self._report(loaded=True)
        if self._channel is not None:
            self._channel.close()

    def _report(self, loaded: bool) -> None:
        self._reported_at = time.monotonic()
        count = self.last
        log.info(
            "rank %d restoring: %d of %d bytes, %d of %d tensors",
            self.rank,
            count.done_bytes,
            count.total_bytes,
            count.done_tensors,
            count.total_tensors,
        )
        if self._stub is None:
            self._channel = make_channel(self.address, self.security)
            self._stub = pb_grpc.CoordinatorStub(self._channel)
        progress = pb.RestoreProgress(
            rank=self.rank,
            pid=os.getpid(),
            hostname=socket.gethostname(),
            done_bytes=count.done_bytes,
            total_bytes=count.total_bytes,
            done_tensors=count.done_tensors,
            total_tensors=count.total_tensors,
            loaded=loaded,
        )
        try:
            self._stub.ReportRestore(progress, timeout=2.0)
        except grpc.RpcError as err:
            log.debug("restore progress not reported: %s", err.details())


def _hold_while_exists(path: str, rank: int) -> None:
    """Debug hook of the restore tests: pause the restore while `path` exists (at most RESTORE_HOLD_MAX_S)."""
    log.warning("rank %d: restore held while %s exists (%s)", rank, path, RESTORE_HOLD_ENV)
    deadline = time.monotonic() + RESTORE_HOLD_MAX_S
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def restore(store: ShardStore, reporter: RestoreReporter) -> None:
    """Load what the persist dir holds before registering, so the rank registers holding it; the coordinator
    sees the progress (and admits reads of these tensors only once they are promoted again)."""
    if store.persistence is None:
        return
    started = time.monotonic()
    log.info("rank %d restoring from %s", store.rank, store.persistence.root)
    restored = store.restore(reporter)
    reporter.finish()
    log.info(
        "rank %d restored %d versions (%d bytes) in %.2fs: %s",
        store.rank,
        len(restored),
        store.memory_used,
        time.monotonic() - started,
        restored,
    )


def open_metrics(args: argparse.Namespace, store: ShardStore) -> MetricsEndpoint | None:
    """With --metrics-port: record the rank's metrics and serve them on the --listen host; else None."""
    if args.metrics_port is None:
        return None
    store.metrics.enable().watch(store)
    endpoint = serve_metrics(store.metrics, split_address(args.listen)[0], args.metrics_port)
    log.info("metrics on http://%s/metrics", endpoint.address)
    return endpoint


def advertised_metrics(endpoint: MetricsEndpoint | None, advertise: str | None) -> str:
    """HOST:PORT of the metrics endpoint as others reach it: the advertised host (or this host's name when
    bound to all interfaces)."""
    if endpoint is None:
        return ""
    host = endpoint.host
    if advertise:
        host = advertise.rpartition(":")[0]
    elif host in ("0.0.0.0", "[::]"):
        host = socket.gethostname()
    return f"{host}:{endpoint.port}"


def open_bulk_reads(args: argparse.Namespace, security: Security, store: ShardStore) -> BulkReads:
    """The rank's bulk port on its --listen host (TLS with the rank's certificates when TLS is on), or none
    (with the reason) when turned off."""
    if args.no_bulk_reads:
        return BulkReads(store, None, off_reason="turned off (--no-bulk-reads)")
    tls = server_ssl_context(security.tls) if security.tls is not None else None
    reads = BulkReads(store, split_address(args.listen)[0], args.bulk_port, tls=tls)
    log.info("bulk reads on port %d%s", reads.port, " (TLS)" if tls is not None else "")
    return reads


def _shutdown(link: CoordinatorLink, running: RunningServer, bulk_reads: BulkReads) -> None:
    """Stop heartbeats, the gRPC server and the bulk port, within a hard 10 s bound."""
    deadline = threading.Timer(10.0, lambda: os._exit(1))
    deadline.daemon = True
    deadline.start()
    link.stop()
    running.stop(grace=1.0)
    bulk_reads.close()
