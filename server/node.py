"""`node`: supervise some ranks of a cluster whose coordinator runs elsewhere, the multi-node sibling of `up`.

`shardserve node --coordinator HOST:PORT --ranks 0-3 --world-size 8` starts
those ranks on this host (LOCAL_RANK = their position in --ranks) and restarts
each one that exits, one by one, with the same backoff and --max-restarts as
`up` (server/supervisor.py); unlike torchrun, a dead rank never stops its
node-mates. SIGINT/SIGTERM stops them all; the node exits 1 once every rank it
supervises is out of restarts.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from shardserve.core.coordinator_addresses import parse_addresses
from shardserve.server.common.cli_args import (
    add_security_args,
    configure_logging,
    security_from_args,
)
from shardserve.server.common.rank_options import RankOptions
from shardserve.server.common.stop_signals import Stop, handle_reload_signal, handle_stop_signals
from shardserve.server.rank_launch import (
    add_rank_launch_args,
    check_rank_launch_args,
    rank_launches,
)
from shardserve.server.supervisor import RankSupervisor, restart_policy_from_args

log = logging.getLogger(__name__)

COORDINATOR_ENV = "SHARDSERVE_COORDINATOR"


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[int]]:
    """The node's arguments and its sorted rank numbers; usage errors (exit 2) name the flag."""
    parser = argparse.ArgumentParser(
        prog="shardserve node",
        description="Run and supervise some ranks of a cluster whose coordinator runs "
        "elsewhere (`shardserve coordinator`): each rank that exits is restarted under its rank number; "
        "SIGINT/SIGTERM stops them all.",
    )
    parser.add_argument(
        "--coordinator",
        default=os.environ.get(COORDINATOR_ENV),
        metavar="HOST:PORT[,HOST:PORT...]",
        help="the coordinator's address; several that share one catalog, comma-separated (the ranks "
        f"follow the leader) (default: ${COORDINATOR_ENV})",
    )
    parser.add_argument(
        "--ranks",
        required=True,
        help="rank numbers to run here: a range 0-3, a list 0,2,5, or both (0-1,4)",
    )
    parser.add_argument(
        "--world-size", type=int, required=True, help="ranks in the whole cluster, all nodes"
    )
    parser.add_argument(
        "--host",
        default="0.0.0.0",
        help="interface the ranks bind; on 0.0.0.0 they advertise "
        "this host's name (default %(default)s)",
    )
    add_rank_launch_args(parser)
    add_security_args(parser)
    args = parser.parse_args(argv)
    if not args.coordinator:
        parser.error(f"--coordinator HOST:PORT is required (or set ${COORDINATOR_ENV})")
    _check_address(parser, args.coordinator)
    if args.world_size < 1:
        parser.error(f"--world-size must be >= 1, got {args.world_size}")
    if not args.host.strip():
        parser.error("--host is empty (an interface address, e.g. 0.0.0.0)")
    check_rank_launch_args(parser, args)
    try:
        ranks = parse_rank_list(args.ranks, args.world_size)
    except ValueError as err:
        parser.error(str(err))
    return args, ranks


def _check_address(parser: argparse.ArgumentParser, addresses: str) -> None:
    try:
        parse_addresses(addresses, "--coordinator")
    except ValueError as err:
        parser.error(f"{err} (HOST:PORT with a port 1-65535, several comma-separated)")


def parse_rank_list(text: str, world_size: int) -> list[int]:
    """ "0-3" or "0,2,5" or "0-1,4" into sorted distinct rank numbers below `world_size`; ValueError says why."""
    ranks: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        first, dash, last = part.partition("-")
        try:
            low, high = int(first), int(last if dash else first)
        except ValueError:
            raise ValueError(
                f"--ranks {text!r}: {part!r} is not a rank or a range like 0-3"
            ) from None
        if low < 0 or high < low:
            raise ValueError(f"--ranks {text!r}: {part!r} is not a range of ranks >= 0 (low-high)")
        if high >= world_size:
            raise ValueError(
                f"--ranks {text!r}: rank {high} is not below --world-size {world_size}"
            )
        ranks.extend(range(low, high + 1))
    duplicates = sorted(rank for rank, count in Counter(ranks).items() if count > 1)
    if duplicates:
        raise ValueError(f"--ranks {text!r} names ranks {duplicates} more than once")
    return sorted(ranks)


def main_node(argv: Sequence[str]) -> int:
    """Run the node until SIGINT/SIGTERM (0), or until every rank is out of restarts (1)."""
    args, ranks = parse_args(argv)
    configure_logging(args.log_level)
    if not args.cluster_secret_file and not args.cluster_cert_name:
        log.error(
            "--cluster-secret-file is required: the coordinator's cluster secret (it writes "
            "STATE_DIR/cluster-secret when started without one), unless mTLS with --cluster-cert-name"
        )
        return 2
    try:
        security = security_from_args(args)
    except ValueError as err:
        log.error("%s", err)
        return 2
    launches = rank_launches(
        args.coordinator,
        replace(RankOptions.from_launcher_args(args), listen=f"{args.host}:0"),
        security,
        ranks=ranks,
        world_size=args.world_size,
        metrics_port=args.metrics_port,
    )
    supervisor = RankSupervisor(
        launches, restart_policy_from_args(args), start_method=args.start_method
    )
    handle_stop_signals()
    handle_reload_signal(lambda: supervisor.signal_all(signal.SIGHUP))
    try:
        supervisor.spawn_all()
        supervisor.watch()
        print(
            f"node: ranks {','.join(map(str, ranks))} of {args.world_size} started, coordinator "
            f"{args.coordinator}",
            flush=True,
        )
        while not all(supervisor.stays_dead(rank) for rank in ranks):
            time.sleep(
                0.2
            )  # short sleeps: a signal landing on a non-main thread is handled promptly
        log.error("every rank of this node is out of restarts; the node exits")
        return 1
    except Stop as stop:
        log.info("%s received; stopping ranks %s", stop, ranks)
        return 0
    except OSError as err:
        log.error("the ranks could not start: %s", err)
        return 1
    finally:
        supervisor.stop()
