"""One rank: serve its ShardServer, register with the coordinator and heartbeat.

Started by the local launcher or by torchrun (`torchrun ... -m shardserve.server
--coordinator HOST:PORT`); it reads RANK / WORLD_SIZE / LOCAL_RANK like any
torchrun worker. It joins no torch.distributed world: collective jobs form
their process groups per epoch over the coordinator's rendezvous store, whose
port the RegisterRank answer gives (rank/jobs/groups.py), so MASTER_ADDR /
MASTER_PORT are not used. SIGTERM or SIGINT stops it cleanly; under the
launcher it also exits when the launcher dies. Its flags are RankOptions'
(server/common/rank_options.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import socket
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
import torch

from shardserve.core.coordinator_addresses import parse_addresses
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.same_host import host_id
from shardserve.server.common.auth import Security, server_ssl_context
from shardserve.server.common.cli_args import (
    PARENT_PID_ENV,
    add_security_args,
    configure_logging,
    security_from_args,
)
from shardserve.server.common.grpc_server import RunningServer, split_address, start_server
from shardserve.server.common.heap import prepare_collector
from shardserve.server.common.memory_limits import MemoryLimit, effective_memory
from shardserve.server.common.metrics import MetricsEndpoint, serve_metrics
from shardserve.server.common.rank_options import RankOptions
from shardserve.server.common.stop_signals import handle_dump_signal, relay_stop_signals
from shardserve.server.common.tracing import enable_tracing
from shardserve.server.rank.coordinator_link import CoordinatorLink
from shardserve.server.rank.coordinators import Coordinators
from shardserve.server.rank.errors import RankError
from shardserve.server.rank.jobs.groups import ProcessGroups
from shardserve.server.rank.malloc_tuning import tune_malloc
from shardserve.server.rank.memory_budget import (
    HOST_MEMORY_FRACTION,
    default_memory_limit,
    ranks_on_host,
    reserved_bytes,
)
from shardserve.server.rank.persistence import FsyncPolicy, Persistence
from shardserve.server.rank.reads.bulk import BulkReads
from shardserve.server.rank.recycling import DEFAULT_MAX_BYTES as DEFAULT_RECYCLE_BYTES
from shardserve.server.rank.restore_report import RestoreReporter, restore
from shardserve.server.rank.retirement import DEFAULT_VERSION_GRACE_S
from shardserve.server.rank.service import ShardServerServicer, add_shard_server
from shardserve.server.rank.store import ShardStore

log = logging.getLogger(__name__)


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, RankOptions]:
    """The rank's flags and its RankOptions; usage errors (exit 2) name the flag."""
    parser = argparse.ArgumentParser(
        prog="python -m shardserve.server",
        description="Run one shard-server rank (torchrun-compatible: reads RANK, "
        "WORLD_SIZE, LOCAL_RANK; MASTER_ADDR and MASTER_PORT are not used).",
    )
    parser.add_argument(
        "--coordinator",
        required=True,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="the coordinator; several that share one catalog, comma-separated: the rank registers with "
        "the one that leads and follows a new leader",
    )
    RankOptions.add_arguments(parser)
    add_security_args(parser)
    args = parser.parse_args(argv)
    try:
        args.coordinators = parse_addresses(args.coordinator, "--coordinator")
        return args, RankOptions.from_args(args)
    except ValueError as err:
        parser.error(str(err))


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


def resolve_memory_limit(given: int | None, device: str) -> MemoryLimit:
    """--memory-limit as given, else this rank's share of the memory this process may use (the host's, or
    its cgroup's when smaller; server/rank/memory_budget.py), with where it came from."""
    if given is not None:
        return MemoryLimit(given, "--memory-limit")
    if not device.startswith("cpu"):
        return MemoryLimit(0, f"unlimited: a {device} rank (the device refuses what does not fit)")
    memory = effective_memory()
    ranks = ranks_on_host(os.environ)
    limit = default_memory_limit(device, memory.nbytes, ranks)
    source = (
        f"{HOST_MEMORY_FRACTION:.0%} of ({memory.nbytes / 2**30:.1f} GiB from {memory.source} less "
        f"{reserved_bytes(memory.nbytes) / 2**30:.1f} GiB reserved), over {ranks} rank(s) on this host"
    )
    log.info("memory limit %d bytes: %s (--memory-limit to change; 0 = unlimited)", limit, source)
    return MemoryLimit(limit, source)


def watch_parent(stop: threading.Event) -> None:
    """Under a launcher: stop when the launcher process is gone (checked every 0.5 s). The launcher is watched
    by its pid, through a pidfd where the kernel has them: a rank forked from the launcher's forkserver is not
    its child."""
    parent = int(os.environ.get(PARENT_PID_ENV, "0") or 0)
    if not parent:
        return
    gone = _process_watch(parent)

    def watch() -> None:
        """Set `stop` once the launcher has ended."""
        while not stop.wait(0.5):
            if gone():
                log.error("the launcher (pid %d) is gone; stopping", parent)
                stop.set()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _process_watch(pid: int) -> Callable[[], bool]:
    """A check of whether process `pid` has ended: its pidfd is readable (a later process reusing the pid is
    not it), else, without pidfds, no process has that pid."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return lambda: True
    except (AttributeError, OSError):
        return lambda: not _pid_exists(pid)
    return lambda: bool(select.select([pidfd], [], [], 0)[0])


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def advertised_address(running: RunningServer, advertise: str | None) -> str:
    """HOST:PORT clients dial this rank at: --advertise, else the bound address (this host's name on 0.0.0.0)."""
    if advertise:
        return advertise
    host = socket.gethostname() if running.host in ("0.0.0.0", "[::]") else running.host
    return f"{host}:{running.port}"


def main(argv: Sequence[str]) -> int:
    """Run one rank until SIGTERM/SIGINT (or the launcher's death)."""
    args, options = parse_args(argv)
    configure_logging(options.log_level)
    stop = threading.Event()
    relay_stop_signals(stop.set)
    handle_dump_signal()
    watch_parent(stop)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        device = resolve_device(options.device, int(os.environ.get("LOCAL_RANK", "0")))
        security = security_from_args(args)
        if options.tracing:  # before any server or channel is made: they are traced from the start
            enable_tracing(options.tracing, f"shardserve-rank-{rank}", {"shardserve.rank": rank})
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
        limit = resolve_memory_limit(options.memory_limit, device)
    except ValueError as err:
        log.error("%s", err)
        return 2
    try:
        persistence = open_persistence(options, rank)
    except RankError as err:
        log.error("--persist-dir: %s", err.message)
        return 2
    store = open_store(options, rank, device, memory_limit=limit.nbytes, persistence=persistence)
    coordinators = Coordinators(args.coordinators, security)
    restore(store, RestoreReporter(coordinators, rank))
    try:
        bulk_reads = open_bulk_reads(options, security, store)
    except OSError as err:
        log.error("--bulk-port %d: cannot listen: %s", options.bulk_port, err)
        return 2
    groups = ProcessGroups(rank, device, store_timeout_s=options.dist_timeout)
    try:
        endpoint = open_metrics(options, store)
    except (OSError, ValueError) as err:
        log.error("--metrics-port %s: cannot serve metrics: %s", options.metrics_port, err)
        bulk_reads.close()
        return 2
    running = start_server(
        options.listen,
        security,
        lambda server: [
            add_shard_server(
                server,
                ShardServerServicer(
                    store, bulk_reads=bulk_reads, groups=groups, memory_limit_source=limit.source
                ),
            )
        ],
        options.stream_limits,
        metrics=store.metrics if endpoint is not None else None,
    )
    info = pb.RankInfo(
        rank=rank,
        address=advertised_address(running, options.advertise),
        device=device,
        hostname=socket.gethostname(),
        memory_limit_bytes=limit.nbytes,
        memory_limit_source=limit.source,
        world_size=world_size,
        pid=os.getpid(),
        host_id=host_id(),
        shared_memory=store.hands_over_by_reference,
        metrics_address=advertised_metrics(endpoint, options.advertise),
    )
    link = CoordinatorLink(coordinators, info, store, groups)
    try:
        try:
            link.register(options.register_timeout)
        except grpc.RpcError as err:
            log.error(
                "rank %d could not register with the coordinator at %s within --register-timeout %gs: "
                "%s: %s",
                rank,
                args.coordinator,
                options.register_timeout,
                err.code().name,
                err.details(),
            )
            return 1
        link.start()
        prepare_collector(f"rank {rank}")
        while not stop.wait(0.2):  # a short wait: signals may land on a non-main thread
            store.memory.expire_kept()  # an idle rank gives kept memory back after its max age too
            store.end_graces()  # replaced versions past --version-grace
        log.info("rank %d stopping", rank)
    finally:
        _shutdown(
            link, running, bulk_reads
        )  # the metrics endpoint's daemon thread ends with the process
        if persistence is not None:
            persistence.close()
    return 0


def open_store(
    options: RankOptions,
    rank: int,
    device: str,
    *,
    memory_limit: int,
    persistence: Persistence | None,
) -> ShardStore:
    """The rank's ShardStore; the options left at None (the rank's default) take the store's defaults."""
    recycle_bytes = options.recycle_bytes
    version_grace = options.version_grace
    return ShardStore(
        rank,
        device,
        memory_limit,
        options.max_request_bytes,
        recycle_bytes=DEFAULT_RECYCLE_BYTES if recycle_bytes is None else recycle_bytes,
        version_grace=DEFAULT_VERSION_GRACE_S if version_grace is None else version_grace,
        persistence=persistence,
    )


def open_persistence(options: RankOptions, rank: int) -> Persistence | None:
    """The rank's Persistence over --persist-dir (None without one)."""
    if not options.persist_dir:
        return None
    folder = Path(options.persist_dir) / f"rank-{rank}"
    policy = FsyncPolicy(options.fsync or FsyncPolicy.ALWAYS.value)
    persistence = Persistence(rank, folder, policy)
    log.info("rank %d persists to %s (--fsync %s)", rank, folder, policy.value)
    return persistence


def open_metrics(options: RankOptions, store: ShardStore) -> MetricsEndpoint | None:
    """With --metrics-port: record the rank's metrics and serve them on the --listen host; else None."""
    if options.metrics_port is None:
        return None
    store.metrics.enable().watch(store)
    endpoint = serve_metrics(store.metrics, split_address(options.listen)[0], options.metrics_port)
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


def open_bulk_reads(options: RankOptions, security: Security, store: ShardStore) -> BulkReads:
    """The rank's bulk port on its --listen host (TLS with the rank's certificates when TLS is on), or none
    (with the reason) when turned off."""
    if not options.bulk_reads:
        return BulkReads(store, None, off_reason="turned off (--no-bulk-reads)")
    tls = server_ssl_context(security.tls) if security.tls is not None else None
    reads = BulkReads(store, split_address(options.listen)[0], options.bulk_port, tls=tls)
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
