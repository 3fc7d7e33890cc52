"""RankOptions: every setting of a rank process, its flags, and the command line that gives them back.

A launcher (`up`, `node`, LocalCluster) builds a RankOptions and starts each
rank with `to_argv()`; the rank parses the flags of `add_arguments` and reads
them back with `from_args`, so a setting is named here once. Where a rank
joins (--coordinator) and its credentials (server/common/cli_args.py) travel
beside these flags.
"""

from __future__ import annotations

import argparse
import logging
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from shardserve.server.common.cli_args import add_log_level_arg, add_metrics_args
from shardserve.server.common.stream_limits import StreamLimitSettings
from shardserve.server.common.tracing import add_tracing_args, check_exporter

FSYNC_POLICIES = ("always", "interval", "none")  # server/rank/persistence.py's FsyncPolicy values
DEFAULT_LISTEN = "127.0.0.1:0"
DEFAULT_DIST_TIMEOUT_S = 120.0
DEFAULT_REGISTER_TIMEOUT_S = 60.0


def this_process_log_level() -> str:
    """The level this process logs at: the ranks a launcher starts log like it unless told otherwise."""
    return logging.getLevelName(logging.getLogger().getEffectiveLevel())


@dataclass(frozen=True)
class RankOptions:
    """How one rank process runs: where it serves, its device and memory, versions, persistence, limits.

    None means the rank's own default (for `memory_limit`: its share of the host's memory). `listen`,
    `advertise`, `bulk_port` and `metrics_port` are where this one process serves: launchers set them per rank.
    ValueError names the flag of a value out of range.
    """

    listen: str = DEFAULT_LISTEN
    advertise: str | None = None
    bulk_port: int = 0
    bulk_reads: bool = True
    device: str = "cpu"
    memory_limit: int | None = None
    max_request_bytes: int = 0
    recycle_bytes: int | None = None
    version_grace: float | None = None
    persist_dir: str | Path | None = None  # kept as an absolute path: ranks may start elsewhere
    fsync: str | None = None
    stall_timeout: float = StreamLimitSettings.stall_timeout
    streams_per_principal: int = StreamLimitSettings.per_principal
    dist_timeout: float = DEFAULT_DIST_TIMEOUT_S
    register_timeout: float = DEFAULT_REGISTER_TIMEOUT_S
    metrics_port: int | None = None
    tracing: str | None = None
    log_level: str = field(default_factory=this_process_log_level)

    def __post_init__(self) -> None:
        if self.persist_dir is not None:
            resolved = str(Path(self.persist_dir).resolve()) if self.persist_dir else None
            object.__setattr__(self, "persist_dir", resolved)
        for flag in (
            "memory_limit",
            "max_request_bytes",
            "recycle_bytes",
            "bulk_port",
            "metrics_port",
        ):
            if (getattr(self, flag) or 0) < 0:
                raise ValueError(f"--{flag.replace('_', '-')} must be >= 0")
        if self.version_grace is not None and not 0 <= self.version_grace < math.inf:
            raise ValueError(f"--version-grace must be >= 0 seconds, got {self.version_grace}")
        for flag in ("dist_timeout", "register_timeout"):
            if not 0 < getattr(self, flag) < math.inf:
                raise ValueError(
                    f"--{flag.replace('_', '-')} must be a number of seconds > 0, got {getattr(self, flag)}"
                )
        if self.fsync is not None and self.fsync not in FSYNC_POLICIES:
            raise ValueError(
                f"--fsync must be one of {', '.join(FSYNC_POLICIES)}, got {self.fsync!r}"
            )
        if self.streams_per_principal < 1:
            raise ValueError(
                f"--streams-per-principal must be >= 1, got {self.streams_per_principal}"
            )
        if not self.stall_timeout > 0:
            raise ValueError(f"--stall-timeout must be > 0 seconds, got {self.stall_timeout}")
        if self.tracing:
            check_exporter(self.tracing)

    @property
    def stream_limits(self) -> StreamLimitSettings:
        """The rank's streaming-call limits (server/common/stream_limits.py)."""
        return StreamLimitSettings(
            per_principal=self.streams_per_principal, stall_timeout=self.stall_timeout
        )

    def to_argv(self) -> list[str]:
        """The flags of `python -m shardserve.server` that give a rank these options (--tracing last)."""
        argv = [
            "--listen",
            self.listen,
            "--bulk-port",
            str(self.bulk_port),
            "--device",
            self.device,
            "--max-request-bytes",
            str(self.max_request_bytes),
            "--stall-timeout",
            str(self.stall_timeout),
            "--streams-per-principal",
            str(self.streams_per_principal),
            "--dist-timeout",
            str(self.dist_timeout),
            "--register-timeout",
            str(self.register_timeout),
            "--log-level",
            self.log_level,
        ]
        if not self.bulk_reads:
            argv.append("--no-bulk-reads")
        unless_none = {
            "--advertise": self.advertise,
            "--memory-limit": self.memory_limit,
            "--recycle-bytes": self.recycle_bytes,
            "--version-grace": self.version_grace,
            "--persist-dir": self.persist_dir,
            "--fsync": self.fsync,
            "--metrics-port": self.metrics_port,
            "--tracing": self.tracing,
        }
        for flag, value in unless_none.items():
            if value is not None:
                argv += [flag, str(value)]
        return argv

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RankOptions:
        """The options of a rank's parsed flags (those of add_arguments)."""
        return replace(
            cls.from_launcher_args(args),
            listen=args.listen,
            advertise=args.advertise,
            bulk_port=args.bulk_port,
            dist_timeout=args.dist_timeout,
            register_timeout=args.register_timeout,
            metrics_port=args.metrics_port,
        )

    @classmethod
    def from_launcher_args(cls, args: argparse.Namespace) -> RankOptions:
        """The settings of `up`/`node` flags (those of add_rank_setting_args) that every rank they start gets;
        where each one serves is left at the defaults, for the launcher to set."""
        return cls(
            bulk_reads=not args.no_bulk_reads,
            device=args.device,
            memory_limit=args.memory_limit,
            max_request_bytes=args.max_request_bytes,
            recycle_bytes=args.recycle_bytes,
            version_grace=args.version_grace,
            persist_dir=args.persist_dir,
            fsync=args.fsync,
            stall_timeout=args.stall_timeout,
            streams_per_principal=args.streams_per_principal,
            tracing=args.tracing,
            log_level=args.log_level,
        )

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """Every flag of a rank process but --coordinator and the security flags."""
        parser.add_argument(
            "--listen",
            default=DEFAULT_LISTEN,
            help="HOST:PORT this rank's ShardServer binds (port 0 = any free port; default %(default)s)",
        )
        parser.add_argument(
            "--advertise",
            default=None,
            help="HOST:PORT clients should dial (default: the bound address, with this host's name when "
            "listening on 0.0.0.0)",
        )
        parser.add_argument(
            "--bulk-port",
            type=int,
            default=0,
            help="TCP port of this rank's bulk reads, on the --listen host (0 = any free port; default "
            "%(default)s; see server/rank/reads/bulk.py)",
        )
        parser.add_argument(
            "--dist-timeout",
            type=float,
            default=DEFAULT_DIST_TIMEOUT_S,
            help="longest wait, in seconds, on the coordinator's rendezvous store when a collective job "
            "forms its process group (the job's own timeout bounds it too; default %(default)s)",
        )
        parser.add_argument(
            "--register-timeout",
            type=float,
            default=DEFAULT_REGISTER_TIMEOUT_S,
            help="seconds to keep trying to register with the coordinator (default %(default)s)",
        )
        add_metrics_args(parser)
        add_rank_setting_args(parser)


def add_rank_setting_args(parser: argparse.ArgumentParser) -> None:
    """The flags of the settings a rank takes and `up` and `node` hand to every rank they start."""
    parser.add_argument(
        "--device", default="cpu", help="cpu, cuda (each rank takes cuda:LOCAL_RANK) or cuda:K"
    )
    parser.add_argument(
        "--memory-limit",
        type=int,
        default=None,
        help="bytes of shards each rank may hold (0 = unlimited; default: on CPU, 0.8 of what is left of the "
        "smaller of host memory and the process's cgroup limit after a reserve of min(1 GiB, a quarter), "
        "divided by LOCAL_WORLD_SIZE, so ranks sharing a host or a container refuse allocations instead of "
        "being OOM-killed together)",
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
        default=None,
        help="bytes of freed versions' memory each rank keeps for the next reshard, update or put of the "
        "same size (0 = off; default 1 GiB)",
    )
    parser.add_argument(
        "--version-grace",
        type=float,
        default=None,
        help="seconds a replaced version stays readable after a newer one is served, so reads in flight "
        "finish on it (0 = drop at once; ends early when its memory is needed; default 2)",
    )
    parser.add_argument(
        "--no-bulk-reads",
        action="store_true",
        help="serve no bulk port: remote clients read over gRPC only (with TLS on, the bulk port speaks "
        "TLS with the same certificates)",
    )
    parser.add_argument(
        "--persist-dir",
        default=None,
        help="directory under which each rank persists its shards and update log (in rank-N/, N its "
        "RANK) and restores them from when it starts (default: none, memory only; `up` passes "
        "STATE_DIR/data unless --no-persist)",
    )
    parser.add_argument(
        "--fsync",
        choices=FSYNC_POLICIES,
        default=None,
        help="when the update log is fsynced: always (before a commit is acknowledged), interval (every "
        "100 ms: a crash loses at most that window of acknowledged updates) or none (the kernel "
        "decides); default always",
    )
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=StreamLimitSettings.stall_timeout,
        help="seconds a ReadRegion, Lookup or WriteShard stream may move no message (a reader that "
        "stopped reading, a writer that stopped sending) before the rank cancels it (default %(default)s)",
    )
    parser.add_argument(
        "--streams-per-principal",
        type=int,
        default=StreamLimitSettings.per_principal,
        help="streaming calls one principal (without client auth: one peer IP) may run at once on one "
        "rank; a principal's max_streams in the tokens file overrides it (default %(default)s)",
    )
    add_tracing_args(parser)
    add_log_level_arg(parser)
