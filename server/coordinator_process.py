"""A coordinator served by this process: `start_coordinator` (for LocalCluster and `coordinator`), its options
and flags, and the `coordinator` command that runs it alone (ranks join with torchrun or `node`)."""

from __future__ import annotations

import argparse
import logging
import socket
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.server.common.announce import (
    add_address_file_arg,
    announce_address,
    check_address_file,
    withdraw_address,
)
from shardserve.server.common.auth import Security
from shardserve.server.common.cli_args import (
    add_log_level_arg,
    add_metrics_args,
    add_security_args,
    configure_logging,
    security_from_args,
    with_state_dir_secret,
)
from shardserve.server.common.grpc_server import RunningServer, split_address, start_server
from shardserve.server.common.heap import prepare_collector
from shardserve.server.common.stop_signals import (
    Stop,
    handle_reload_signal,
    handle_stop_signals,
    wait_for_stop_signal,
)
from shardserve.server.common.stream_limits import StreamLimitSettings
from shardserve.server.common.tracing import add_tracing_args, enable_tracing
from shardserve.server.coordinator.catalog.leadership import LEASE_DURATION_S
from shardserve.server.coordinator.catalog.locations import check_location
from shardserve.server.coordinator.catalog.urls import is_postgres_url
from shardserve.server.coordinator.options import CoordinatorOptions

if TYPE_CHECKING:  # imported lazily: they pull in torch, which the ranks import meanwhile
    from shardserve.server.coordinator.process import CoordinatorProcess

log = logging.getLogger(__name__)

COORDINATOR_WORKERS = (
    64  # gRPC threads: 16 queued reshards took all 16 and ranks were declared dead
)


def start_coordinator(
    listen: str,
    state_dir: str | Path,
    security: Security,
    options: CoordinatorOptions = CoordinatorOptions(),
    *,
    metrics_port: int | None = None,
    advertise: str | None = None,
    catalog_location: str | None = None,
) -> tuple[CoordinatorProcess, RunningServer]:
    """A coordinator over the catalog at `catalog_location` (None: the SQLite file in `state_dir`; a
    postgresql:// URL: that database), served on `listen`; with `metrics_port` (0 = any free port), its
    Prometheus metrics served on the `listen` host. A lone coordinator (no `options.lease_duration`) leads at
    once; one of several sharing the catalog leads once it holds the lease and stands by until then, naming
    itself to the others as `advertise` (default: the listen address, the host's name for a wildcard host)."""
    from shardserve.server.coordinator.leadership_service import LeadershipServicer
    from shardserve.server.coordinator.metrics import CoordinatorMetrics
    from shardserve.server.coordinator.process import CoordinatorProcess
    from shardserve.server.coordinator.service import CoordinatorServicer

    host = split_address(listen)[0]
    process = CoordinatorProcess(
        catalog_location,
        state_dir,
        security,
        replace(options, store_host=host),
        metrics=CoordinatorMetrics() if metrics_port is not None else None,
    )

    def add(server: object) -> list[str]:
        """Add the Coordinator and Leadership services to `server`; their names, for health and reflection."""
        pb_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(process.role), server)
        pb_grpc.add_LeadershipServicer_to_server(LeadershipServicer(process.role), server)
        return [pb.DESCRIPTOR.services_by_name[s].full_name for s in ("Coordinator", "Leadership")]

    running: RunningServer | None = None
    try:  # reshard and checkpoint streams hold a worker for their whole run: room left for heartbeats and reads
        if not process.shares_catalog:
            process.lead_alone()
        if process.metrics is not None:
            process.serve_metrics(host, metrics_port or 0)
        running = start_server(
            listen, security, add, StreamLimitSettings(workers=COORDINATOR_WORKERS), process.metrics
        )
        shown = socket.gethostname() if host in ("0.0.0.0", "[::]", "") else host
        process.role.address = advertise or f"{shown}:{running.port}"
        if process.shares_catalog:
            process.stand(process.role.address, lambda leads: _serving(running, leads))
    except Exception:
        if running is not None:
            running.stop(grace=0.0)
        process.close()
        raise
    return process, running


def _serving(running: RunningServer | None, leads: bool) -> None:
    """The health of the Coordinator service: SERVING while this coordinator leads, NOT_SERVING while it stands
    by (load balancers and probes send calls to the leader; the Leadership service always serves)."""
    from grpc_health.v1 import health_pb2

    if running is not None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if leads
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        running.health.set(pb.DESCRIPTOR.services_by_name["Coordinator"].full_name, status)


def add_coordinator_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `up` and `coordinator` for the coordinator: its state dir, timings, security and the
    address file."""
    parser.add_argument(
        "--state-dir",
        default=".shardserve",
        help="directory of the cluster secret and the SQLite catalog (default %(default)s)",
    )
    parser.add_argument(
        "--catalog",
        metavar="URL",
        help="where the coordinator keeps its catalog: a postgresql://USER@HOST:PORT/DB URL (a password from "
        "the URL, PGPASSWORD or ~/.pgpass; docs/operations.md#the-catalog-on-postgresql) or an SQLite file "
        "(default: STATE_DIR/catalog.sqlite)",
    )
    parser.add_argument(
        "--heartbeat-interval",
        type=float,
        default=CoordinatorOptions.heartbeat_interval,
        help="seconds between rank heartbeats, the shortest interval ranks are told (it grows with the "
        "cluster, see --heartbeat-rate); a rank silent for twice its interval is dead (default %(default)s)",
    )
    parser.add_argument(
        "--dead-after",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds of silence that mark a rank dead, whatever its interval (default: twice the interval "
        "it was told); on a host whose CPU is oversubscribed, where heartbeats arrive late, a longer silence "
        "keeps live ranks alive without slowing the heartbeats",
    )
    parser.add_argument(
        "--heartbeat-rate",
        type=float,
        default=CoordinatorOptions.heartbeat_rate,
        help="heartbeats per second the coordinator takes from all ranks together: past "
        "--heartbeat-interval x this many ranks, their interval grows to keep within it (0 = no limit; "
        "default %(default)s)",
    )
    parser.add_argument(
        "--repair-after",
        type=float,
        default=CoordinatorOptions.repair_after,
        help="seconds a rank stays dead before the "
        "coordinator copies its shards' boxes from live replicas onto other ranks; copies a "
        "restarted rank came back without are repaired at once (default %(default)s)",
    )
    add_leadership_args(parser)
    add_address_file_arg(parser)
    add_security_args(parser)


def coordinator_options_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, *, store_port: int = 0
) -> CoordinatorOptions:
    """The CoordinatorOptions of the flags of add_coordinator_args; a usage error (exit 2) names a bad one."""
    if args.catalog is not None:
        try:
            check_location(args.catalog)
        except ValueError as err:
            parser.error(f"--catalog: {err}")
    try:
        return CoordinatorOptions(
            heartbeat_interval=args.heartbeat_interval,
            heartbeat_rate=args.heartbeat_rate,
            dead_after=args.dead_after,
            repair_after=args.repair_after,
            store_port=store_port,
            lease_duration=args.lease_duration,
        )
    except ValueError as err:
        parser.error(str(err))


def add_leadership_args(parser: argparse.ArgumentParser) -> None:
    """The flag of a coordinator that may share its catalog with others: its lease."""
    parser.add_argument(
        "--lease-duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help="lead under a lease of this many seconds held in the catalog, so that several coordinators "
        "may share it (one PostgreSQL --catalog, or one SQLite file on one host): one leads, the others "
        "stand by and take over within about 1.25 leases of the leader's death or hang; the leader renews "
        "every quarter lease and stops serving three quarters of a lease after its last renewal began "
        f"(default: `coordinator` with a postgresql:// --catalog {LEASE_DURATION_S:g}; otherwise none: a "
        "lone coordinator that leads at once)",
    )


def main_coordinator(argv: Sequence[str]) -> int:
    """`coordinator`: run the coordinator alone (ranks join with torchrun ... -m shardserve.server --coordinator)."""
    parser = argparse.ArgumentParser(
        prog="shardserve coordinator",
        description="Run the coordinator alone; prints 'coordinator: HOST:PORT' once serving "
        "(and writes HOST:PORT to --address-file).",
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
    parser.add_argument(
        "--advertise",
        default=None,
        metavar="HOST:PORT",
        help="the address the other coordinators name this one by, to clients and ranks, while it leads "
        "(default: the --listen address, this host's name for a wildcard host)",
    )
    add_metrics_args(parser)
    add_tracing_args(parser)
    add_log_level_arg(parser)
    add_coordinator_args(parser)
    args = parser.parse_args(argv)
    options = coordinator_options_from_args(parser, args, store_port=args.store_port)
    if options.lease_duration is None and args.catalog and is_postgres_url(args.catalog):
        # a catalog in a database is there to be shared: its coordinators lead under a lease
        options = replace(options, lease_duration=LEASE_DURATION_S)
    if args.advertise is not None:
        try:
            split_address(args.advertise)
        except ValueError:
            parser.error(f"--advertise {args.advertise!r} is not HOST:PORT")
    check_address_file(parser, args.address_file)
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
    withdraw_address(args.address_file)
    try:
        process, running = start_coordinator(
            args.listen,
            args.state_dir,
            security,
            options,
            metrics_port=args.metrics_port,
            advertise=args.advertise,
            catalog_location=args.catalog,
        )
    except (OSError, RuntimeError, ValueError) as err:
        log.error("the coordinator could not start: %s", err)
        return 1
    try:
        prepare_collector("coordinator")  # before the address is out: then it only serves
        announce_address(running.address, args.address_file)
        wait_for_stop_signal()
    except Stop as stop:
        log.info("%s received; stopping the coordinator", stop)
    finally:
        withdraw_address(args.address_file)
        running.stop(grace=1.0)
        process.close()
    return 0
