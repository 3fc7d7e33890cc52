"""What `up`, `node` and LocalCluster start a rank process with: its command line, environment and flags.

Every rank of a launcher gets the same RankOptions (server/common/rank_options.py)
but for where it serves: its metrics port is numbered after the launcher's
--metrics-port. Its cluster credential and TLS files travel as flags, its token
in its environment, and torchrun's variables tell it its rank.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from shardserve.server.common.auth import Security
from shardserve.server.common.cli_args import PARENT_PID_ENV, TOKEN_ENV, security_flags
from shardserve.server.common.rank_options import RankOptions, add_rank_setting_args
from shardserve.server.rank_start import CLI_START_METHOD, START_METHODS
from shardserve.server.supervisor import RankLaunch, add_restart_args, check_restart_args

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def rank_command(coordinator: str, options: RankOptions, security: Security) -> list[str]:
    """`python -m shardserve.server --coordinator ...`: one rank's command line (the token travels in its
    environment)."""
    return [
        sys.executable,
        "-m",
        "shardserve.server",
        "--coordinator",
        coordinator,
        *security_flags(security),
        *options.to_argv(),
    ]


def rank_metrics_port(metrics_port: int | None, rank: int) -> int | None:
    """The --metrics-port of `rank` when its launcher was given `metrics_port`: port+1+rank (the launcher's own
    coordinator, if any, takes `metrics_port` itself), 0 for 0 (any free port), None for None."""
    if metrics_port is None:
        return None
    return metrics_port + 1 + rank if metrics_port else 0


def rank_env(
    rank: int,
    local_rank: int,
    local_world_size: int,
    world_size: int,
    token: str | None,
) -> dict[str, str]:
    """torchrun's variables but MASTER_ADDR/PORT (ranks form their groups over the coordinator's store), and the
    supervisor's pid: the rank exits when its supervisor is gone."""
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(local_world_size),
        GROUP_RANK="0",
    )
    env[PARENT_PID_ENV] = str(os.getpid())
    # As torchrun does: ranks sharing a host split its cores instead of each taking all of them.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // local_world_size)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    env.pop(TOKEN_ENV, None)
    if token:
        env[TOKEN_ENV] = token
    return env


def rank_launches(
    coordinator: str,
    options: RankOptions,
    security: Security,
    *,
    ranks: Sequence[int],
    world_size: int,
    metrics_port: int | None = None,
) -> list[RankLaunch]:
    """One launch per rank of this host: LOCAL_RANK is its position in `ranks`, LOCAL_WORLD_SIZE their count,
    and its metrics port is numbered after `metrics_port` (rank_metrics_port)."""
    return [
        RankLaunch(
            rank,
            rank_command(
                coordinator,
                replace(options, metrics_port=rank_metrics_port(metrics_port, rank)),
                security,
            ),
            rank_env(rank, local, len(ranks), world_size, security.token),
        )
        for local, rank in enumerate(ranks)
    ]


def add_rank_launch_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `up` and `node` that go to every rank they start, the ranks' metrics ports and restarts."""
    add_rank_setting_args(parser)
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics: the coordinator "
        "(under `up`) on this port, rank r on port+1+r (0 = any free port each; default: off; "
        "`shardserve status` lists the addresses)",
    )
    add_restart_args(parser)
    parser.add_argument(
        "--start-method",
        choices=START_METHODS,
        default=CLI_START_METHOD,
        help="how each rank process starts: forked from a process that imported torch and the rank's code "
        "once (forkserver: a rank starts or restarts in a fraction of a second) or a new interpreter each "
        "time (spawn, as torchrun does; 2-3 s of CPU each) (default %(default)s)",
    )


def check_rank_launch_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors (exit 2) naming the flag of add_rank_launch_args that is out of range."""
    if (args.metrics_port or 0) < 0:
        parser.error("--metrics-port must be >= 0")
    check_restart_args(parser, args)
    try:
        RankOptions.from_launcher_args(args)
    except ValueError as err:
        parser.error(str(err))
