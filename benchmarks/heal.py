"""Healing under load: a replicas=2 table read by client processes while a rank is SIGKILLed, restarted, repaired.

Measured in one run: time to detect the death (kill -> the coordinator marks the rank dead), time to take the rank
back (-> its restarted process registered), time to repair (-> the table healthy again), the repair's GB/s
against a bare gloo send of the same bytes between two processes, and read p50/p99 before the kill, during the
outage (kill -> healthy again) and after it; every answer is checked against the table, bit for bit. The rank is
killed a second time once the readers are done, so the repair is also timed with no read load. The readers are
forked from the ranks' preloaded forkserver (torch imported once, not once per reader).

    python -m benchmarks.heal [--rows R] [--dim D] [--readers N] [--kill-at T] [--after S] [--json FILE]

The `heal` scenario of `python -m benchmarks` runs it; tests/cluster/test_heal_under_load.py runs it small.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch

TABLE = "heal"
LOOKUP_IDS = 256
FETCH_ROWS = 64
READY_TIMEOUT_S = 120.0  # the readers connecting on a busy 2-core host


def table(rows: int, dim: int, seed: int) -> torch.Tensor:
    """The table every reader checks its answers against."""
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- one reader process


def read_loop(
    address: str, name: str, *, rows: int, dim: int, seed: int, seconds: float, out: str
) -> None:
    """Once connected (the file `out`.ready made), alternate lookups of LOOKUP_IDS random ids and fetches of
    FETCH_ROWS-row bands until the file `out`.stop exists (at most `seconds`), recording for each read (wall
    start, latency s, kind, outcome) where outcome is "ok", "wrong" or the error; JSON to `out`."""
    from shardserve import ShardServeError, connect

    expected = table(rows, dim, seed)
    generator = torch.Generator().manual_seed(os.getpid())
    records = []
    with connect(address, timeout=30) as client:
        remote = client.tensor(name)
        Path(out + ".ready").touch()
        end, stop = time.monotonic() + seconds, Path(out + ".stop")
        while time.monotonic() < end and (len(records) % 16 or not stop.exists()):
            kind = "lookup" if len(records) % 2 == 0 else "fetch"
            started, wall = time.perf_counter(), time.time()
            try:
                if kind == "lookup":
                    ids = torch.randint(0, rows, (LOOKUP_IDS,), generator=generator)
                    ok = torch.equal(remote.lookup(ids), expected[ids])
                else:
                    start = int(torch.randint(0, rows - FETCH_ROWS + 1, (1,), generator=generator))
                    ok = torch.equal(
                        remote[start : start + FETCH_ROWS], expected[start : start + FETCH_ROWS]
                    )
                outcome = "ok" if ok else "wrong"
            except ShardServeError as err:
                outcome = f"{type(err).__name__}: {err}"
            records.append((wall, time.perf_counter() - started, kind, outcome))
    Path(out).write_text(json.dumps(records))


# ---------------------------------------------------------------- the run


@dataclass
class Recovery:
    """One death and its healing; times in seconds after the kill."""

    detect_s: float | None = None  # the coordinator marks the rank dead
    readmit_s: float | None = None  # its restarted process registered
    healthy_s: float | None = None  # the table healthy again, repaired
    repair_bytes: int = 0  # bytes of the copies rebuilt
    repair_s: float | None = (
        None  # the repair itself (reservation, collective job, commit, promotion)
    )

    @property
    def repair_gb_s(self) -> float | None:
        return self.repair_bytes / self.repair_s / 1e9 if self.repair_s else None


@dataclass
class HealReport:
    """What one run measured: the death under read load, a second one with no reads, and the reads."""

    rows: int
    dim: int
    readers: int
    reads: int = 0
    failed: list[str] = field(default_factory=list)
    wrong: int = 0
    restarts: int = 0
    under_load: Recovery = field(default_factory=Recovery)
    quiet: Recovery = field(default_factory=Recovery)
    bare_send_s: float | None = (
        None  # a gloo send of under_load.repair_bytes between two processes, no load
    )
    phases: dict[str, dict[str, float]] = field(
        default_factory=dict
    )  # before/during/after: count, p50/p99 ms

    @property
    def bare_gb_s(self) -> float | None:
        nbytes = self.under_load.repair_bytes
        return nbytes / self.bare_send_s / 1e9 if self.bare_send_s else None

    def to_json(self) -> dict:
        out = asdict(self)
        out["bare_gb_s"] = self.bare_gb_s
        out["under_load"]["repair_gb_s"] = self.under_load.repair_gb_s
        out["quiet"]["repair_gb_s"] = self.quiet.repair_gb_s
        return out


def run(
    rows: int = 200_000,
    dim: int = 64,
    *,
    ranks: int = 3,
    readers: int = 8,
    kill_at: float = 8.0,
    after: float = 5.0,
    victim: int = 1,
    bare_baseline: bool = True,
    timeout: float = 180.0,
    quiet_repair: bool = True,
) -> HealReport:
    """Start a cluster, put the replicas=2 table, read it from `readers` processes, SIGKILL rank `victim`
    `kill_at` seconds in, and measure until the table is healthy again; the readers go on `after` seconds more
    (everything bounded by `timeout` seconds after the kill)."""
    from shardserve import connect
    from shardserve.server.common.rank_options import RankOptions
    from shardserve.server.launcher import LocalCluster
    from shardserve.server.supervisor import RestartPolicy

    report = HealReport(rows, dim, readers)
    data = table(rows, dim, seed=7)
    with tempfile.TemporaryDirectory(prefix="shardserve-heal-") as tmp:
        cluster = LocalCluster(
            ranks=ranks,
            state_dir=Path(tmp) / "state",
            rank_options=RankOptions(log_level="WARNING"),
            restart_policy=RestartPolicy(max_restarts=3, initial_backoff=0.5),
            start_method="forkserver",
        )
        procs: list[tuple[BaseProcess, Path]] = []
        try:
            cluster.start(timeout=180)
            with connect(cluster.address) as client:
                client.put(TABLE, data, replicas=2)
            procs = _start_readers(
                cluster.address, rows, dim, readers, kill_at + timeout + after, Path(tmp)
            )
            time.sleep(kill_at)
            killed = time.time()
            report.under_load = _kill_and_heal(cluster, victim, killed, timeout)
            time.sleep(after)
            for _, out in procs:
                Path(str(out) + ".stop").touch()
            _collect(procs, killed, report)
            if quiet_repair:
                report.quiet = _kill_and_heal(
                    cluster, victim, time.time(), timeout
                )  # the same, with no reads
            report.restarts = cluster.restarts(victim)
        finally:
            _stop_readers(procs)
            cluster.stop()
    if bare_baseline and report.under_load.repair_bytes:
        report.bare_send_s = bare_send_seconds(report.under_load.repair_bytes)
    return report


def _start_readers(
    address: str, rows: int, dim: int, readers: int, seconds: float, tmp: Path
) -> list[tuple[BaseProcess, Path]]:
    """Fork the readers from the preloaded forkserver (torch imported once, not once per reader) and wait until
    each has connected."""
    from shardserve.server.rank_start import forkserver_context

    context = forkserver_context()
    procs: list[tuple[BaseProcess, Path]] = []
    for i in range(readers):
        out = tmp / f"reader{i}.json"
        proc = context.Process(
            target=read_loop,
            args=(address, TABLE),
            kwargs={"rows": rows, "dim": dim, "seed": 7, "seconds": seconds, "out": str(out)},
            daemon=True,
        )
        proc.start()
        procs.append((proc, out))
    give_up = time.monotonic() + READY_TIMEOUT_S
    for proc, out in procs:
        while not Path(str(out) + ".ready").exists():
            if proc.exitcode is not None or time.monotonic() > give_up:
                _stop_readers(procs)
                raise RuntimeError(f"a reader did not start (pid {proc.pid}, exit {proc.exitcode})")
            time.sleep(0.02)
    return procs


def _stop_readers(procs: list[tuple[BaseProcess, Path]]) -> None:
    """Kill the readers still running (the run failed): they share this process's stderr, and whoever waits for
    its output would wait for them too, until the end of their reading time."""
    for proc, _ in procs:
        if proc.exitcode is None:
            proc.kill()
            proc.join(timeout=30)


def _kill_and_heal(cluster, victim: int, killed: float, timeout: float) -> Recovery:
    """SIGKILL rank `victim` (at `killed`, wall time) and poll the in-process coordinator: when the rank is marked
    dead, registered again, and the table healthy at a newer version; then the repair's own record."""
    coordinator = cluster.coordinator
    version, recovery, done_before = (
        coordinator.lifecycle.get(TABLE).version,
        Recovery(),
        len(coordinator.repairs.completed()),
    )
    cluster.kill_rank(victim, signal.SIGKILL)
    deadline = killed + timeout
    while time.time() < deadline:
        now = time.time() - killed
        alive = coordinator.registry.rank_alive(victim)
        if recovery.detect_s is None and not alive:
            recovery.detect_s = now
        if recovery.detect_s is not None and recovery.readmit_s is None and alive:
            recovery.readmit_s = now
        info = coordinator.answers.tensor(coordinator.lifecycle.get(TABLE))
        if recovery.readmit_s is not None and info.health == "healthy" and info.version > version:
            recovery.healthy_s = now
            break
        time.sleep(0.02)
    while (
        recovery.healthy_s is not None and time.time() < deadline
    ):  # the record lands just after the promotion
        done = [r for r in coordinator.repairs.completed()[done_before:] if r.name == TABLE]
        if done:
            recovery.repair_bytes, recovery.repair_s = done[-1].nbytes, done[-1].seconds
            break
        time.sleep(0.02)
    return recovery


def _collect(procs: list[tuple[BaseProcess, Path]], killed: float, report: HealReport) -> None:
    """Wait for the readers; sort their reads into before / during / after the outage."""
    records = []
    for proc, out in procs:
        proc.join(timeout=300)
        if proc.exitcode != 0:
            raise RuntimeError(f"a reader exited with {proc.exitcode} (pid {proc.pid})")
        records += json.loads(out.read_text())
    healed = killed + (
        report.under_load.healthy_s if report.under_load.healthy_s is not None else float("inf")
    )
    phases: dict[str, list[float]] = {"before": [], "during": [], "after": []}
    for wall, seconds, _kind, outcome in records:
        phase = "before" if wall < killed else "during" if wall < healed else "after"
        phases[phase].append(seconds)
        if outcome == "wrong":
            report.wrong += 1
        elif outcome != "ok":
            report.failed.append(outcome)
    report.reads = len(records)
    report.phases = {name: _percentiles(values) for name, values in phases.items()}


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"reads": 0}
    t = torch.tensor(values, dtype=torch.float64)
    return {
        "reads": len(values),
        "p50_ms": float(t.quantile(0.5)) * 1e3,
        "p99_ms": float(t.quantile(0.99)) * 1e3,
    }


# ---------------------------------------------------------------- the baseline: a bare gloo send of the same bytes


def bare_send_seconds(nbytes: int) -> float:
    """Seconds for one gloo send of `nbytes` from one process to another on 127.0.0.1 (median of 3)."""
    from shardserve.server.common.ports import free_port
    from shardserve.server.rank_start import forkserver_context

    ctx = forkserver_context()
    result = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_bare_send_worker, args=(rank, port, nbytes, result))
        for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    seconds = result.get(timeout=300)
    for proc in procs:
        proc.join(timeout=60)
    return seconds


def _bare_send_worker(rank: int, port: int, nbytes: int, result) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buffer = (
        torch.ones(nbytes, dtype=torch.uint8)
        if rank == 0
        else torch.empty(nbytes, dtype=torch.uint8)
    )
    times = []
    for _ in range(3):
        dist.barrier()
        started = time.perf_counter()
        if rank == 0:
            dist.send(buffer, 1)
        else:
            dist.recv(buffer, 0)
        times.append(time.perf_counter() - started)
    if rank == 1:
        result.put(sorted(times)[1])
    dist.destroy_process_group()


# ---------------------------------------------------------------- command line


def print_report(report: HealReport) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"[bold]heal[/bold]: {report.rows} x {report.dim} float32, replicas=2, {report.readers} reader "
        f"processes; reads {report.reads}, failed {len(report.failed)}, wrong {report.wrong}"
    )
    out = Table(title="a rank SIGKILLed, restarted and repaired (seconds after the kill)")
    for column in (
        "reads",
        "detect s",
        "re-admitted s",
        "healthy s",
        "repair MB",
        "repair s",
        "repair GB/s",
        "x bare send",
    ):
        out.add_column(column, justify="right")
    for name, r in (
        ("8 readers" if report.readers == 8 else f"{report.readers} readers", report.under_load),
        ("none", report.quiet),
    ):
        ratio = r.repair_gb_s / report.bare_gb_s if r.repair_gb_s and report.bare_gb_s else None
        out.add_row(
            name,
            _s(r.detect_s),
            _s(r.readmit_s),
            _s(r.healthy_s),
            f"{r.repair_bytes / 1e6:.1f}",
            _s(r.repair_s),
            _f(r.repair_gb_s),
            _f(ratio),
        )
    console.print(out)
    console.print(f"bare gloo send of the same bytes, no load: {_f(report.bare_gb_s)} GB/s")
    reads = Table(title="read latency (lookups of 256 ids and 64-row fetches, mixed)")
    for column in ("phase", "reads", "p50 ms", "p99 ms"):
        reads.add_column(column, justify="right")
    for phase, stats in report.phases.items():
        reads.add_row(
            phase, str(stats.get("reads", 0)), _f(stats.get("p50_ms")), _f(stats.get("p99_ms"))
        )
    console.print(reads)


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f}"


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--readers", type=int, default=8)
    parser.add_argument(
        "--kill-at", type=float, default=8.0, help="seconds of reads before the kill"
    )
    parser.add_argument(
        "--after", type=float, default=8.0, help="seconds of reads after the table is healthy"
    )
    parser.add_argument(
        "--no-quiet-repair", action="store_true", help="skip the second kill, timed with no reads"
    )
    parser.add_argument("--json", metavar="FILE")
    ns = parser.parse_args(argv)
    report = run(
        ns.rows,
        ns.dim,
        readers=ns.readers,
        kill_at=ns.kill_at,
        after=ns.after,
        quiet_repair=not ns.no_quiet_repair,
    )
    print_report(report)
    if ns.json:
        Path(ns.json).write_text(json.dumps(report.to_json(), indent=2))


if __name__ == "__main__":
    main()
