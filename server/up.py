"""`up`: a coordinator and N ranks on this host, in the foreground until SIGINT/SIGTERM (a LocalCluster)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from shardserve.core.coordinator_addresses import parse_addresses
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.common.announce import announce_address, check_address_file, withdraw_address
from shardserve.server.common.cli_args import configure_logging, security_from_args
from shardserve.server.common.heap import prepare_collector
from shardserve.server.common.rank_options import RankOptions
from shardserve.server.common.stop_signals import (
    Stop,
    handle_reload_signal,
    handle_stop_signals,
    wait_for_stop_signal,
)
from shardserve.server.coordinator_process import (
    add_coordinator_args,
    coordinator_options_from_args,
)
from shardserve.server.launcher import LocalCluster
from shardserve.server.rank_launch import add_rank_launch_args, check_rank_launch_args
from shardserve.server.supervisor import restart_policy_from_args

log = logging.getLogger(__name__)


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, LocalCluster]:
    """`up`'s flags and the (not yet started) cluster they describe; usage errors (exit 2) name the flag."""
    parser = argparse.ArgumentParser(
        prog="shardserve up",
        description="Run a coordinator and N shard-server "
        "ranks on this host; prints 'coordinator: HOST:PORT' when ready (and writes HOST:PORT to "
        "--address-file).",
    )
    parser.add_argument(
        "--ranks", type=int, default=2, help="number of ranks (default %(default)s)"
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="interface to bind (default %(default)s)"
    )
    parser.add_argument("--port", type=int, default=0, help="coordinator port (0 = any free port)")
    parser.add_argument(
        "--coordinator",
        default="",
        metavar="HOST:PORT[,HOST:PORT...]",
        help="the other coordinators that share --catalog: this one must lead when `up` starts; its ranks "
        "are given them too and follow whichever leads later (default: none)",
    )
    add_rank_launch_args(parser)
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
    add_coordinator_args(parser)
    args = parser.parse_args(argv)
    if args.ranks < 1:
        parser.error("--ranks must be >= 1")
    check_rank_launch_args(parser, args)
    if args.port < 0:
        parser.error("--port must be >= 0")
    if args.port > 65535:
        parser.error(f"--port {args.port} is not a TCP port (0-65535)")
    if not args.host.strip():
        parser.error("--host is empty (an interface address, e.g. 127.0.0.1)")
    coordinator_options = coordinator_options_from_args(parser, args)
    try:
        peers = parse_addresses(args.coordinator, "--coordinator") if args.coordinator else ()
    except ValueError as err:
        parser.error(str(err))
    check_address_file(parser, args.address_file)
    try:
        security = security_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    persist_dir = None if args.no_persist else args.persist_dir or Path(args.state_dir) / "data"
    cluster = LocalCluster(
        args.ranks,
        state_dir=args.state_dir,
        host=args.host,
        port=args.port,
        rank_options=replace(RankOptions.from_launcher_args(args), persist_dir=persist_dir),
        security=security,
        coordinator_options=coordinator_options,
        restart_policy=restart_policy_from_args(args),
        metrics_port=args.metrics_port,
        catalog=args.catalog,
        peers=peers,
        start_method=args.start_method,
    )
    return args, cluster


def main_up(argv: Sequence[str]) -> int:
    """`up`: run a coordinator and N ranks here in the foreground until SIGINT/SIGTERM."""
    args, cluster = parse_args(argv)
    configure_logging(args.log_level)
    handle_stop_signals()
    handle_reload_signal(cluster.reload_principals)
    withdraw_address(args.address_file)
    try:
        cluster.start(timeout=args.startup_timeout)
        if args.demo:
            create_demo(cluster)
        prepare_collector("up")  # before the address is out: then it only serves
        announce_address(cluster.address, args.address_file)
        wait_for_stop_signal()
    except Stop as stop:
        log.info("%s received; stopping the cluster", stop)
    except (OSError, RuntimeError, TimeoutError, ValueError) as err:
        log.error("the cluster could not start: %s", err)
        return 1
    finally:
        withdraw_address(args.address_file)
        cluster.stop()
    return 0


def create_demo(cluster: LocalCluster) -> pb.TensorInfo:
    """The demo table "demo" (float32 1,000,000 x 64), loaded from a DCP checkpoint it writes once: server.demo."""
    from shardserve.server.demo import load_demo

    assert cluster.coordinator is not None
    return load_demo(cluster.coordinator, cluster.state_dir)
