"""Rank processes kept running: spawn them, restart one that exits (with backoff), stop them all.

`shardserve up` (LocalCluster) and `shardserve node` both supervise their
ranks with RankSupervisor, like torchrun's elastic agent but one rank at a
time: a rank that exits is restarted under the same rank number after a
backoff (1 s doubling to 30 s, back to 1 s once an incarnation stayed up for a
minute), at most `max_restarts` times; one out of restarts stays dead. A
restarted rank registers with the coordinator again and comes back empty: the
coordinator records the copies it lost (server/coordinator/reconcile.py).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from shardserve.server.common.auth import Security
from shardserve.server.common.cli_args import (
    PARENT_PID_ENV,
    TOKEN_ENV,
    add_stream_limit_args,
    stream_limit_flags,
    stream_limits_from_args,
)
from shardserve.server.common.stream_limits import StreamLimitSettings
from shardserve.server.common.tracing import add_tracing_args, check_exporter

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MAX_RESTARTS = 10
POLL_INTERVAL = 0.2  # seconds between checks of the rank processes


@dataclass(frozen=True)
class RestartPolicy:
    """How often and how soon a rank that exited is started again."""

    max_restarts: int = (
        DEFAULT_MAX_RESTARTS  # per rank, over the supervisor's life; 0 = never restart
    )
    initial_backoff: float = 1.0  # seconds before the first restart
    max_backoff: float = 30.0  # the doubling stops here
    stable_after: float = 60.0  # an incarnation up this long resets the backoff to initial_backoff

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not 0 <= self.initial_backoff <= self.max_backoff:
            raise ValueError(
                f"restart backoff must satisfy 0 <= initial ({self.initial_backoff}) <= max "
                f"({self.max_backoff})"
            )

    def next_backoff(self, previous: float | None, uptime: float) -> float:
        """The wait before the next restart: doubled from `previous`, or the initial one after a stable run."""
        if previous is None or uptime >= self.stable_after:
            return self.initial_backoff
        return min(self.max_backoff, max(previous * 2, self.initial_backoff))


@dataclass(frozen=True)
class RankLaunch:
    """Everything a rank process is started with (the same for every incarnation)."""

    rank: int
    command: Sequence[str]
    env: dict[str, str]


def rank_command(
    coordinator: str,
    host: str,
    device: str,
    max_request_bytes: int,
    log_level: str,
    security: Security,
    memory_limit: int | None = None,
    recycle_bytes: int | None = None,
    bulk_reads: bool = True,
    version_grace: float | None = None,
    limits: StreamLimitSettings = StreamLimitSettings(),
    persist_dir: str | Path | None = None,
    fsync: str | None = None,
) -> list[str]:
    """`python -m shardserve.server --coordinator ...`: one rank's command line (the token travels
    in its environment)."""
    cmd = [
        sys.executable,
        "-m",
        "shardserve.server",
        "--coordinator",
        coordinator,
        "--listen",
        f"{host}:0",
        "--device",
        device,
        "--max-request-bytes",
        str(max_request_bytes),
        "--log-level",
        log_level,
    ]
    if memory_limit is not None:
        cmd += ["--memory-limit", str(memory_limit)]
    if recycle_bytes is not None:
        cmd += ["--recycle-bytes", str(recycle_bytes)]
    if version_grace is not None:
        cmd += ["--version-grace", repr(float(version_grace))]
    if not bulk_reads:
        cmd.append("--no-bulk-reads")
    if persist_dir is not None:
        cmd += ["--persist-dir", str(Path(persist_dir).resolve())]
    if fsync is not None:
        cmd += ["--fsync", fsync]
    cmd += stream_limit_flags(limits)
    tls = security.tls
    if tls is not None:
        cmd += ["--tls-cert", tls.cert, "--tls-key", tls.key] + (
            ["--tls-ca", tls.ca] if tls.ca else []
        )
    if security.principals is not None and security.principals.tokens_file is not None:
        cmd += ["--tokens-file", str(Path(security.principals.tokens_file).resolve())]
    if security.cluster is not None and security.cluster.path is not None:
        cmd += ["--cluster-secret-file", str(Path(security.cluster.path).resolve())]
    if security.cluster_cert is not None:
        cmd += ["--cluster-cert-name", security.cluster_cert.name]
    return cmd


def rank_metrics_flags(metrics_port: int | None, rank: int) -> list[str]:
    """The --metrics-port of `rank` when its launcher was given `metrics_port`: port+1+rank (the launcher's own
    coordinator, if any, takes `metrics_port` itself), 0 for 0 (any free port), nothing for None."""
    if metrics_port is None:
        return []
    return ["--metrics-port", str(metrics_port + 1 + rank if metrics_port else 0)]


def rank_env(
    rank: int,
    local_rank: int,
    local_world_size: int,
    world_size: int,
    token: str | None,
    node_rank: int = 0,
) -> dict[str, str]:
    """torchrun's variables but MASTER_ADDR/PORT (ranks form their groups over the coordinator's store), and the
    supervisor's pid: the rank exits when its supervisor is gone."""
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(local_world_size),
        GROUP_RANK=str(node_rank),
    )
    env[PARENT_PID_ENV] = str(os.getpid())
    # As torchrun does: ranks sharing a host split its cores instead of each taking all of them.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // local_world_size)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    env.pop(TOKEN_ENV, None)
    if token:
        env[TOKEN_ENV] = token
    return env


def add_rank_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `up` and `node` that go to every rank they start, and the restart flags."""
    parser.add_argument(
        "--device", default="cpu", help="cpu or cuda (each rank takes cuda:LOCAL_RANK)"
    )
    parser.add_argument(
        "--memory-limit",
        type=int,
        default=None,
        help="bytes of shards per rank (0 = unlimited; "
        "default: on CPU, 0.8 of the host's memory split among the ranks)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=0,
        help="largest ReadRegion box in bytes (0 = unlimited)",
    )
    parser.add_argument(
        "--recycle-bytes",
        type=int,
        default=None,
        help="bytes of freed versions' memory each "
        "rank keeps for reuse (0 = off; default: the rank's, 1 GiB)",
    )
    parser.add_argument(
        "--version-grace",
        type=float,
        default=None,
        help="seconds a replaced version stays "
        "readable on each rank after a newer one is served (0 = drop at once; default: the "
        "rank's, 2)",
    )
    parser.add_argument(
        "--no-bulk-reads",
        action="store_true",
        help="ranks serve no bulk TCP port; remote "
        "clients read over gRPC only (always so with TLS)",
    )
    parser.add_argument(
        "--persist-dir",
        default=None,
        help="directory under which each rank persists its shards "
        "and update log (in rank-N/) and restores them from when it starts (`up`: default "
        "STATE_DIR/data; `node`: default none, memory only)",
    )
    parser.add_argument(
        "--fsync",
        choices=("always", "interval", "none"),
        default=None,
        help="when each rank "
        "fsyncs its update log: always (before a commit is acknowledged), interval (every 100 ms) "
        "or none (default: the rank's, always)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=DEFAULT_MAX_RESTARTS,
        help="times each rank is "
        "restarted after its process ends, under the same rank number (0 = never; a rank out of "
        "restarts stays dead; default %(default)s)",
    )
    parser.add_argument(
        "--restart-backoff",
        type=float,
        default=RestartPolicy.initial_backoff,
        help="seconds "
        "before restarting a rank that exited, doubled for each further restart up to "
        f"{RestartPolicy.max_backoff:.0f} s and reset once a rank stayed up "
        f"{RestartPolicy.stable_after:.0f} s (default %(default)s)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics: the coordinator "
        "(under `up`) on this port, rank r on port+1+r (0 = any free port each; default: off; "
        "`shardserve status` lists the addresses)",
    )
    add_tracing_args(parser)
    add_stream_limit_args(parser)


def check_rank_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors (exit 2) naming the flag of add_rank_args that is out of range."""
    for flag in (
        "memory_limit",
        "max_request_bytes",
        "recycle_bytes",
        "max_restarts",
        "metrics_port",
    ):
        if (getattr(args, flag) or 0) < 0:
            parser.error(f"--{flag.replace('_', '-')} must be >= 0")
    if not 0 <= args.restart_backoff < math.inf:
        parser.error(
            f"--restart-backoff must be a number of seconds >= 0, got {args.restart_backoff}"
        )
    try:
        if args.tracing:
            check_exporter(args.tracing)
        stream_limits_from_args(args)
    except ValueError as err:
        parser.error(str(err))


def restart_policy_from_args(args: argparse.Namespace) -> RestartPolicy:
    """The RestartPolicy of --max-restarts and --restart-backoff (checked by check_rank_args)."""
    return RestartPolicy(
        args.max_restarts,
        args.restart_backoff,
        max(RestartPolicy.max_backoff, args.restart_backoff),
    )


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


def exit_reason(code: int) -> str:
    """'exited with code 1' or 'was killed by SIGKILL' for a Popen returncode."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _Slot:
    """One rank number: its current process and its restart state."""

    def __init__(self, launch: RankLaunch) -> None:
        self.launch = launch
        self.proc: subprocess.Popen | None = None
        self.started = 0.0  # time.monotonic() of the current incarnation's start
        self.restarts = 0
        self.backoff: float | None = None  # the last backoff waited; None before the first restart
        self.restart_at: float | None = None  # when a restart is due; None when none is
        self.final = False  # out of restarts: stays dead


class RankSupervisor:
    """Spawns rank processes, restarts each one that exits per `policy`, and stops them all.

    `on_exit(rank, reason)` is called (from the watch thread) as soon as a rank's process is seen ended, before
    any restart, so a coordinator told there learns of the death at once. No rank is spawned once stop() began.
    """

    def __init__(
        self,
        launches: Sequence[RankLaunch],
        policy: RestartPolicy = RestartPolicy(),
        on_exit: Callable[[int, str], None] | None = None,
    ) -> None:
        ranks = [launch.rank for launch in launches]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ranks must be distinct, got {ranks}")
        self.policy = policy
        self._on_exit = on_exit
        self._slots = {launch.rank: _Slot(launch) for launch in launches}
        self._lock = threading.Lock()  # spawning and stopping: never a spawn after stop() began
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ what tests and launchers read

    @property
    def ranks(self) -> list[int]:
        return sorted(self._slots)

    def process(self, rank: int) -> subprocess.Popen:
        """The current (latest) process of `rank`."""
        proc = self._slot(rank).proc
        if proc is None:
            raise RuntimeError(f"rank {rank} was never started")
        return proc

    def pids(self) -> list[int]:
        """The current process id of every rank, by rank (a rank that stays dead keeps its last pid)."""
        return [self.process(rank).pid for rank in self.ranks]

    def restarts(self, rank: int) -> int:
        """How many times `rank` was restarted."""
        return self._slot(rank).restarts

    def stays_dead(self, rank: int) -> bool:
        """Whether `rank` exited with no restarts left."""
        return self._slot(rank).final

    def restart_pending(self, rank: int) -> bool:
        """Whether `rank` exited and waits out its backoff before its restart."""
        return self._slot(rank).restart_at is not None

    @property
    def watching(self) -> bool:
        """Whether the watch thread runs (only it restarts ranks)."""
        return self._thread is not None and self._thread.is_alive()

    def _slot(self, rank: int) -> _Slot:
        try:
            return self._slots[rank]
        except KeyError:
            raise ValueError(f"rank {rank} is not supervised here (ranks {self.ranks})") from None

    def signal_all(self, sig: int) -> None:
        """Send `sig` to every rank process still running (SIGHUP: re-read the tokens file)."""
        with self._lock:
            procs = [slot.proc for slot in self._slots.values() if slot.proc is not None]
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, sig)

    # ------------------------------------------------------------ lifecycle

    def spawn_all(self) -> None:
        """Start every rank once (without watching them yet)."""
        with self._lock:
            for slot in self._slots.values():
                if not self._stopping.is_set():
                    self._spawn(slot)
        log.info(
            "started ranks %s as pids %s",
            self.ranks,
            [s.proc.pid for s in self._slots.values() if s.proc],
        )

    def watch(self) -> None:
        """Start the thread that reports and restarts ranks whose process ends."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._watch_loop, name="rank-supervisor", daemon=True
            )
            self._thread.start()

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM every rank, SIGKILL those still alive after `grace`; no restart happens after this began.
        Idempotent."""
        with self._lock:
            self._stopping.set()
            procs = [slot.proc for slot in self._slots.values() if slot.proc is not None]
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("rank pid %d did not stop in %.1fs; killing it", proc.pid, grace)
                proc.kill()
                proc.wait(timeout=5.0)

    # ------------------------------------------------------------ the watch thread

    def _spawn(self, slot: _Slot) -> None:
        """(lock held) Start `slot`'s rank."""
        slot.proc = subprocess.Popen(
            list(slot.launch.command), env=slot.launch.env, stdin=subprocess.DEVNULL
        )
        slot.started = time.monotonic()
        slot.restart_at = None

    def _watch_loop(self) -> None:
        while not self._stopping.wait(POLL_INTERVAL):
            for slot in self._slots.values():
                try:
                    self._check(slot)
                except Exception:  # noqa: BLE001 - the watch thread must outlive one rank's trouble
                    log.exception("supervising rank %d failed", slot.launch.rank)

    def _check(self, slot: _Slot) -> None:
        if slot.final or slot.proc is None:
            return
        if slot.restart_at is None and slot.proc.poll() is not None:
            self._exited(slot)
        if slot.restart_at is not None and time.monotonic() >= slot.restart_at:
            self._restart(slot)

    def _exited(self, slot: _Slot) -> None:
        """Report the death, then schedule a restart or declare the rank dead for good."""
        rank, proc = slot.launch.rank, slot.proc
        assert proc is not None
        reason = f"process {proc.pid} {exit_reason(proc.returncode)}"
        if self._on_exit is not None and not self._stopping.is_set():
            self._on_exit(rank, reason)
        if slot.restarts >= self.policy.max_restarts:
            slot.final = True
            log.error(
                "rank %d: %s; no restarts left (%d of --max-restarts %d used): it stays dead",
                rank,
                reason,
                slot.restarts,
                self.policy.max_restarts,
            )
            return
        slot.backoff = self.policy.next_backoff(slot.backoff, time.monotonic() - slot.started)
        slot.restart_at = time.monotonic() + slot.backoff
        log.warning(
            "rank %d: %s; restarting it in %.1fs (restart %d of %d)",
            rank,
            reason,
            slot.backoff,
            slot.restarts + 1,
            self.policy.max_restarts,
        )

    def _restart(self, slot: _Slot) -> None:
        with self._lock:
            if self._stopping.is_set():
                return
            self._spawn(slot)
            slot.restarts += 1
        assert slot.proc is not None
        log.warning(
            "rank %d restarted as pid %d (restart %d of %d)",
            slot.launch.rank,
            slot.proc.pid,
            slot.restarts,
            self.policy.max_restarts,
        )
