"""A coordinator served by this process: `start_coordinator` (for LocalCluster and `coordinator`), its options
and flags, and the `coordinator` command that runs it alone (ranks join with torchrun or `node`)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, cast

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
from shardserve.server.common.stop_signals import (
    Stop,
    handle_reload_signal,
    handle_stop_signals,
    wait_for_stop_signal,
)
from shardserve.server.common.stream_limits import StreamLimitSettings
from shardserve.server.common.tracing import add_tracing_args, enable_tracing
from shardserve.server.coordinator.options import CoordinatorOptions

if TYPE_CHECKING:  # imported lazily: they pull in torch, which the ranks import meanwhile
    from shardserve.server.coordinator.server import CoordinatorServer

log = logging.getLogger(__name__)

CATALOG_FILE = "catalog.sqlite"
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
) -> tuple[CoordinatorServer, RunningServer]:
    """A CoordinatorServer over the SQLite catalog in `state_dir`, started and served on `listen`; with
    `metrics_port` (0 = any free port), its Prometheus metrics served on the `listen` host."""
    from shardserve.server.coordinator.catalog.interface import Catalog
    from shardserve.server.coordinator.catalog.sqlite import SQLiteCatalog
    from shardserve.server.coordinator.metrics import CoordinatorMetrics, TimedCatalog
    from shardserve.server.coordinator.server import CoordinatorServer
    from shardserve.server.coordinator.service import CoordinatorServicer

    catalog: Catalog = SQLiteCatalog(Path(state_dir) / CATALOG_FILE)
    metrics = CoordinatorMetrics() if metrics_port is not None else None
    if metrics is not None:  # a proxy that times every Catalog call
        catalog = cast(Catalog, TimedCatalog(catalog, metrics.catalog_latency))
    coordinator = CoordinatorServer(
        catalog,
        security,
        replace(options, store_host=split_address(listen)[0]),
    )

    def add(server: object) -> list[str]:
        """Add the Coordinator service to `server`; its name, for health checks and reflection."""
        pb_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(coordinator), server)
        return [pb.DESCRIPTOR.services_by_name["Coordinator"].full_name]

    try:  # reshard and checkpoint streams hold a worker for their whole run: room left for heartbeats and reads
        coordinator.start()
        if metrics is not None:
            coordinator.serve_metrics(metrics, split_address(listen)[0], metrics_port or 0)
        running = start_server(
            listen, security, add, StreamLimitSettings(workers=COORDINATOR_WORKERS), metrics
        )
    except Exception:
        coordinator.close()
        raise
    return coordinator, running


def add_coordinator_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `up` and `coordinator` for the coordinator: its state dir, timings, security and the
    address file."""
    parser.add_argument(
        "--state-dir",
        default=".shardserve",
        help="directory of the SQLite catalog (default %(default)s)",
    )
    parser.add_argument(
        "--heartbeat-interval",
        type=float,
        default=CoordinatorOptions.heartbeat_interval,
        help="seconds between rank heartbeats, the shortest interval ranks are told (it grows with the "
        "cluster, see --heartbeat-rate); a rank silent for twice its interval is dead (default %(default)s)",
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
    add_address_file_arg(parser)
    add_security_args(parser)


def coordinator_options_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, *, store_port: int = 0
) -> CoordinatorOptions:
    """The CoordinatorOptions of the flags of add_coordinator_args; a usage error (exit 2) names a bad one."""
    try:
        return CoordinatorOptions(
            heartbeat_interval=args.heartbeat_interval,
            heartbeat_rate=args.heartbeat_rate,
            repair_after=args.repair_after,
            store_port=store_port,
        )
    except ValueError as err:
        parser.error(str(err))


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
    add_metrics_args(parser)
    add_tracing_args(parser)
    add_log_level_arg(parser)
    add_coordinator_args(parser)
    args = parser.parse_args(argv)
    options = coordinator_options_from_args(parser, args, store_port=args.store_port)
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
        coordinator, running = start_coordinator(
            args.listen, args.state_dir, security, options, metrics_port=args.metrics_port
        )
    except (OSError, RuntimeError, ValueError) as err:
        log.error("the coordinator could not start: %s", err)
        return 1
    try:
        announce_address(running.address, args.address_file)
        wait_for_stop_signal()
    except Stop as stop:
        log.info("%s received; stopping the coordinator", stop)
    finally:
        withdraw_address(args.address_file)
        running.stop(grace=1.0)
        coordinator.close()
    return 0
