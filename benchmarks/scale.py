"""The control plane at 1,000 ranks, by simulation: the real coordinator process and N simulated ranks.

For each N (10, 100 and 1,000; `--ranks 10,100` to choose, `--quick` for a smoke test) a fresh coordinator
(`python -m shardserve.server coordinator`, SQLite catalog, metrics on) and N rank instances of the real rank
code in a few processes (benchmarks/scale_ranks.py; tiny shards, no collectives), then, in order:

- registration of N ranks at once (cold), and the coordinator's CPU and memory with N idle ranks heartbeating;
- CreateSnapshot + CommitSnapshot of a state dict of tensors of 10 shards (SHARDS in all: 100,000), first and
  steady (the commit of the snapshot the commit before reserved), each commit reserving the next snapshot after
  it answered (reserve_later, as a steady writer's put asks), and that reservation taken right after the commit
  (TakeReservedSnapshot: what a writer with no training step between its puts would wait for); read back bit
  for bit;
- `list` (ListTensors), `status` (what `shardserve status` asks) and GetTensor with that catalog;
- replicated tables of 1,000 shards (SHARDS in all) resharded: the coordinator's planning (to
  the first progress message) and its prepare/commit fan-out (from there to DONE), read back bit for bit;
- the coordinator killed and started again: seconds to serving with the full catalog, and until the N ranks
  are registered again;
- one rank killed: seconds until the coordinator lists it dead, the coordinator's CPU while it scans for
  repairs with that rank lost, and seconds until the tables it held are repaired (read back bit for bit).

Every row prints its figure at each N and the growth exponent between the last two (log of the ratio over log
of the rank ratio: 0 flat, 1 linear in ranks). The machine is shared: the load average is printed with every
run; exponents matter more than absolute times.

    python -m benchmarks --only scale [--ranks 10,100,1000] [--shards 100000] [--quick]

`--shards` makes both workloads smaller (or larger), the same at every N: on a machine too small for 100,000
shards over 1,000 simulated ranks, the growth exponents can still be read at fewer shards.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass, field

import grpc
import torch

from benchmarks.harness import Context, Row, Target, scenario
from benchmarks.scale_cluster import CALL_TIMEOUT_S, MAX_PROCESSES, SimulatedCluster, wait_for
from benchmarks.scale_workload import (
    PREFIX,
    StateDict,
    create_tables,
    reshard_table,
    table_value,
    write_snapshot,
)
from benchmarks.scale_workload import (
    ROWS as SHARD_ROWS,
)
from shardserve.protos import shardserve_pb2 as pb

log = logging.getLogger(__name__)

GROUP = "scale"
RANKS = (10, 100, 1000)
QUICK_RANKS = (8,)  # one cluster: the smoke test runs every scenario within 120 s
SHARDS = 100_000  # of the state dict (10 per tensor), and of the tables
TABLE_ROWS = 500  # x 2 replicas
SHARDS_STEP = 2 * TABLE_ROWS  # one table's shards: --shards counts whole tables
QUICK_TENSORS = 200
QUICK_TABLES, QUICK_TABLE_ROWS = 4, 50
QUICK_PROCESSES = 2  # rank processes of a quick run (each imports torch)
SETTLE_TIMEOUT_S = REPAIR_TIMEOUT_S = 900.0
HEARTBEAT_S = 2.0  # not 1 s: on a machine shared by busy processes a heartbeat can be a second late
IDLE_WINDOW_S, QUICK_IDLE_WINDOW_S = 10.0, 1.0
SCAN_WINDOW_S, QUICK_SCAN_WINDOW_S = 5.0, 1.0
STEADY_COMMITS = 2
ATTEMPTS = 3
RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND)
READ_BACK = 20  # snapshot tensors read back and compared
GET_CALLS = 200
REPAIR_AFTER_S = 2.0
VICTIM = 3  # the rank killed


@dataclass
class Figures:
    """What one N measured: {row: value} (seconds, or the unit its row names) and the checks made."""

    ranks: int
    values: dict[str, float] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)
    failure: str = ""  # the error that stopped this N before its last row ("": none)
    work: str = ""  # the workloads' sizes, as the table names them


ROWS = (  # (key, what, unit, target at 1,000 ranks)
    ("register_cold", "registration of N ranks, cold", "s", None),
    ("idle_cpu", "coordinator CPU with N idle ranks heartbeating", "cores", 0.10),
    ("coordinator_rss", "coordinator RSS (peak over the run)", "MiB", 1024.0),
    ("rank_rss", "RSS of one simulated rank instance", "MiB", None),
    ("snapshot_first", "CreateSnapshot + CommitSnapshot, first", "s", 5.0),
    ("snapshot_steady", "CommitSnapshot of a reserved snapshot (steady)", "s", 2.0),
    ("snapshot_reserved", "the next snapshot reserved, after the commit answered", "s", None),
    ("list", "ListTensors", "s", None),
    ("status", "status (ListRanks + ListTensors + ListRanks)", "s", 1.0),
    ("get_tensor", "GetTensor (median)", "s", None),
    ("reshard_plan", "reshard planning (to the first progress), all tables", "s", 2.0),
    ("reshard_fanout", "reshard prepare/commit fan-out, all tables", "s", None),
    ("restart_serving", "coordinator restart to serving, full catalog", "s", 5.0),
    ("register_restart", "re-registration of N ranks after a restart", "s", None),
    ("restart_settled", "restart until the coordinator is idle again (reconciled)", "s", None),
    ("dead_noticed", "a dead rank noticed (listed not alive)", "s", None),
    ("scan_cpu", "coordinator CPU with one rank lost (repair scans)", "cores", None),
    ("repaired", "lost copies of the tables repaired", "s", None),
)


def ranks_to_run(ctx: Context) -> tuple[int, ...]:
    chosen = ctx.ranks
    if chosen:
        return tuple(chosen)
    return QUICK_RANKS if ctx.quick else RANKS


@scenario("scale", help="the coordinator at 10 / 100 / 1,000 simulated ranks (control plane costs)")
def scale_scenario(ctx: Context) -> list[Row]:
    results = []
    for world in ranks_to_run(ctx):
        figures = Figures(world)
        with ctx.rss() as peaks:
            try:
                run_one(ctx, figures)
            except Exception as err:  # noqa: BLE001 - the rows measured so far are kept, the failure noted
                log.exception("scale N=%d stopped", world)
                figures.failure = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"
        coordinator = [rss for label, rss in peaks.items() if label.startswith("coordinator")]
        figures.values["coordinator_rss"] = max(coordinator, default=0) / 2**20
        results.append(figures)
        log.warning(
            "scale N=%d done%s: %s",
            world,
            f" (stopped: {figures.failure})" if figures.failure else "",
            json.dumps(figures.values),
        )
    print_table(results)
    return rows_of(results)


def run_one(ctx: Context, figures: Figures) -> None:
    """Every row at one N, in the order the module docstring gives."""
    world, quick = figures.ranks, ctx.quick
    shards = ctx.shards or SHARDS
    state = StateDict(QUICK_TENSORS if quick else shards // SHARD_ROWS, world)
    tables, rows = (
        (QUICK_TABLES, QUICK_TABLE_ROWS) if quick else (shards // SHARDS_STEP, TABLE_ROWS)
    )
    values, checks = figures.values, figures.checks
    figures.load = os.getloadavg()
    figures.work = f"state dict {state.shards:,} shards, tables {tables * rows * 2:,} shards"
    with SimulatedCluster(
        world,
        heartbeat_interval=HEARTBEAT_S,
        repair_after=REPAIR_AFTER_S,
        processes=QUICK_PROCESSES if quick else MAX_PROCESSES,
    ) as cluster:
        cluster.start_coordinator()
        ctx.sampler.label(cluster.coordinator_pid, "coordinator")
        cluster.start_ranks()
        values["rank_rss"] = cluster.rank_bytes_each() / 2**20
        Clock(cluster, values).time("register_cold", cluster.register)
        values["idle_cpu"] = idle_cpu(cluster, QUICK_IDLE_WINDOW_S if quick else IDLE_WINDOW_S)
        snapshot_rows(cluster, state, values, checks)
        catalog_rows(cluster, state, values)
        cluster.wait_alive(
            world
        )  # a rank taken for dead meanwhile (a loaded machine) is back first
        retried(
            cluster,
            values,
            lambda: create_tables(cluster.stub, count=tables, rows=rows, world=world),
        )
        cluster.wait_alive(world)
        reshard_rows(cluster, tables=tables, rows=rows, values=values, checks=checks)
        cluster.wait_alive(world)
        restart_rows(cluster, world, values)
        ctx.sampler.label(cluster.coordinator_pid, "coordinator (restarted)")
        lost_rank_rows(
            cluster,
            tables=tables,
            rows=rows,
            values=values,
            checks=checks,
            window=QUICK_SCAN_WINDOW_S if quick else SCAN_WINDOW_S,
        )


class Clock:
    """Wall seconds and the coordinator's CPU seconds of the steps timed with it, summed per row key."""

    def __init__(self, cluster: SimulatedCluster, values: dict) -> None:
        self.cluster, self.values = cluster, values

    def add(self, key: str, wall: float, cpu: float) -> None:
        self.values[key] = self.values.get(key, 0.0) + wall
        self.values[f"{key}_cpu"] = self.values.get(f"{key}_cpu", 0.0) + cpu

    def time(self, key: str, fn):
        """Run `fn()`, adding its wall and coordinator CPU seconds to row `key`; its result."""
        cpu0, _ = self.cluster.coordinator_usage()
        start = time.perf_counter()
        try:
            return fn()
        finally:
            wall = time.perf_counter() - start
            self.add(key, wall, self.cluster.coordinator_usage()[0] - cpu0)


def idle_cpu(cluster: SimulatedCluster, window: float) -> float:
    """The coordinator's CPU (cores) over `window` seconds while every rank only heartbeats."""
    time.sleep(min(2.0, window))  # the background work of the registrations ends first
    cpu0, _ = cluster.coordinator_usage()
    start = time.perf_counter()
    time.sleep(window)
    cpu1, _ = cluster.coordinator_usage()
    return (cpu1 - cpu0) / (time.perf_counter() - start)


def snapshot_rows(cluster: SimulatedCluster, state: StateDict, values: dict, checks: dict) -> None:
    """Create + commit (first), then the commits of the reserved next snapshots (steady), each reservation taken
    right after the commit before (timed on its own); read back a sample.
    A step that fails because a rank was taken for dead (a loaded machine) is done again from the create, once
    every rank is back (counted in `retries`); its time is not counted."""
    stub = cluster.stub
    for attempt in range(ATTEMPTS):
        timed: dict = {}
        clock = Clock(cluster, timed)
        try:
            request = state.create_request()
            created = clock.time(
                "snapshot_first", lambda: stub.CreateSnapshot(request, timeout=CALL_TIMEOUT_S)
            )
            timed["snapshot_create"] = timed["snapshot_first"]
            write_snapshot(created, cluster.rank_stub, state=state)
            number = created.number
            clock.time("snapshot_first", lambda: commit_snapshot(stub, number))
            for _ in range(STEADY_COMMITS):
                reserved = clock.time("snapshot_reserved", lambda: take_reserved(stub, number))
                write_snapshot(reserved, cluster.rank_stub, state=state)
                number = reserved.number
                clock.time("snapshot_steady", lambda: commit_snapshot(stub, number))
            # the last reservation made before the next rows are timed (left reserved, untimed)
            take_reserved(stub, number)
        except (
            grpc.RpcError
        ) as err:  # NOT_FOUND: a put pending past the coordinator's pending timeout
            if err.code() not in RETRIED or attempt == ATTEMPTS - 1:
                raise
            log.warning("snapshot rows: %s; again once every rank is alive", err.details())
            values["retries"] = values.get("retries", 0) + 1
            cluster.wait_alive(cluster.world)
            continue
        for key in ("snapshot_steady", "snapshot_reserved"):
            timed[key] /= STEADY_COMMITS
            timed[f"{key}_cpu"] /= STEADY_COMMITS
        values.update(timed)
        break
    checks["snapshot read back"] = read_back_snapshot(cluster, state)


def retried(cluster: SimulatedCluster, values: dict, fn):
    """`fn()`, done again (at most ATTEMPTS times) when it fails because a rank was taken for dead meanwhile (a
    loaded machine), once every rank is alive again; the retries are counted in `retries`."""
    for attempt in range(ATTEMPTS):
        try:
            return fn()
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE or attempt == ATTEMPTS - 1:
                raise
            log.warning("%s; again once every rank is alive", err.details())
            values["retries"] = values.get("retries", 0) + 1
            cluster.wait_alive(cluster.world)
    raise AssertionError("unreachable")


def commit_snapshot(stub, number: int) -> pb.CommitSnapshotResponse:
    """Commit snapshot `number` of the prefix, reserving the next after it answered (a steady writer's
    commit)."""
    request = pb.CommitSnapshotRequest(
        prefix=PREFIX,
        number=number,
        view=pb.SNAPSHOT_VIEW_BASIC,
        reserve_next=True,
        reserve_later=True,
    )
    return stub.CommitSnapshot(request, timeout=CALL_TIMEOUT_S)


def take_reserved(stub, committed: int) -> pb.SnapshotInfo:
    """The snapshot the commit of `committed` reserved after it answered (waiting until it is made)."""
    request = pb.TakeReservedSnapshotRequest(prefix=PREFIX, committed=committed)
    return stub.TakeReservedSnapshot(request, timeout=CALL_TIMEOUT_S)


def read_back_snapshot(cluster: SimulatedCluster, state: StateDict) -> bool:
    """A sample of the newest snapshot's tensors read through the client, compared bit for bit."""
    from benchmarks.scale_workload import state_value
    from shardserve import connect

    sample = random.Random(0).sample(range(state.count), min(READ_BACK, state.count))
    with connect(cluster.address, timeout=CALL_TIMEOUT_S, transport="grpc") as client:
        snapshot = client.snapshot(PREFIX)
        return all(
            torch.equal(snapshot[state.key(i)].full_tensor(), state_value(i)) for i in sample
        )


def catalog_rows(cluster: SimulatedCluster, state: StateDict, values: dict) -> None:
    """ListTensors, status and GetTensor with the state dict's tensors in the catalog."""
    from shardserve import connect

    stub, clock = cluster.stub, Clock(cluster, values)
    listing = pb.ListTensorsRequest(layouts_apart=True)  # as the clients ask
    best_of(clock, "list", lambda: stub.ListTensors(listing, timeout=CALL_TIMEOUT_S))
    with connect(cluster.address, timeout=CALL_TIMEOUT_S, transport="grpc") as client:

        def status() -> None:  # what `shardserve status` asks, without printing it
            client.ranks()
            client.list(include_pending=True)
            stub.ListRanks(pb.ListRanksRequest(), timeout=CALL_TIMEOUT_S)

        best_of(clock, "status", status)
    request = pb.GetTensorRequest(name=f"{PREFIX}@{latest_number(cluster)}/{state.key(0)}")
    times = []
    cpu0, _ = cluster.coordinator_usage()
    for _ in range(GET_CALLS):
        start = time.perf_counter()
        stub.GetTensor(request, timeout=CALL_TIMEOUT_S)
        times.append(time.perf_counter() - start)
    values["get_tensor"] = sorted(times)[len(times) // 2]
    values["get_tensor_cpu"] = (cluster.coordinator_usage()[0] - cpu0) / GET_CALLS


def latest_number(cluster: SimulatedCluster) -> int:
    request = pb.GetSnapshotRequest(prefix=PREFIX)
    return cluster.stub.GetSnapshot(request, timeout=CALL_TIMEOUT_S).number


def reshard_rows(
    cluster: SimulatedCluster, *, tables: int, rows: int, values: dict, checks: dict
) -> None:
    """Reshard every table one after another; the planning and fan-out seconds summed; a sample read back."""
    plan = plan_cpu = fanout = 0.0
    cpu0, _ = cluster.coordinator_usage()

    def coordinator_cpu() -> float:
        return cluster.coordinator_usage()[0]

    for index in range(tables):
        run = retried(
            cluster,
            values,
            lambda: reshard_table(
                cluster.stub, index, rows=rows, world=cluster.world, shift=2, cpu=coordinator_cpu
            ),
        )
        plan += run.plan_s
        plan_cpu += run.plan_cpu_s
        fanout += run.fanout_s
    values["reshard_plan"], values["reshard_fanout"] = plan, fanout
    values["reshard_plan_cpu"] = plan_cpu
    values["reshard_fanout_cpu"] = cluster.coordinator_usage()[0] - cpu0 - plan_cpu
    checks["reshard read back"] = read_back_tables(cluster, range(min(tables, 5)), rows)


def read_back_tables(cluster: SimulatedCluster, indices, rows: int) -> bool:
    from shardserve import connect

    expected = table_value(rows)
    with connect(cluster.address, timeout=CALL_TIMEOUT_S, transport="grpc") as client:
        return all(torch.equal(client.tensor(f"table{i}").full_tensor(), expected) for i in indices)


def restart_rows(cluster: SimulatedCluster, world: int, values: dict) -> None:
    """SIGKILL the coordinator, start it again: seconds to serving, then until every rank registered again."""
    cluster.kill_coordinator()
    start = time.perf_counter()
    values["restart_serving"] = cluster.start_coordinator()
    values["restart_serving_cpu"] = cluster.coordinator_usage()[0]
    cluster.wait_alive(world)
    values["register_restart"] = time.perf_counter() - start
    values["register_restart_cpu"] = cluster.coordinator_usage()[0]
    quiet = 1.5 * values["idle_cpu"] + 0.05
    values["restart_settled"] = settle(cluster, quiet) + time.perf_counter() - start
    values["restart_settled_cpu"] = cluster.coordinator_usage()[0]


def settle(cluster: SimulatedCluster, quiet: float) -> float:
    """Seconds until the coordinator's background work has ended: its CPU below `quiet` cores over a second."""
    start = time.perf_counter()
    while time.perf_counter() - start < SETTLE_TIMEOUT_S:
        cpu0, _ = cluster.coordinator_usage()
        time.sleep(1.0)
        if cluster.coordinator_usage()[0] - cpu0 < quiet:
            break
    return time.perf_counter() - start


def lost_rank_rows(
    cluster: SimulatedCluster,
    *,
    tables: int,
    rows: int,
    values: dict,
    checks: dict,
    window: float,
) -> None:
    """Kill one rank: until it is listed dead; the coordinator's CPU meanwhile scanning for repairs; until the
    tables it held copies of are whole again (read back bit for bit)."""
    victim = min(VICTIM, cluster.world - 1)
    held = [i for i in range(tables) if victim in table_ranks(cluster, i)]
    cluster.kill_rank(victim)
    start = time.perf_counter()
    wait_for(
        lambda: not rank_alive(cluster, victim), CALL_TIMEOUT_S, f"rank {victim} listed dead", 0.05
    )
    values["dead_noticed"] = time.perf_counter() - start
    wait_for(
        lambda: all(victim not in table_ranks(cluster, i) for i in held),
        REPAIR_TIMEOUT_S,
        f"the tables rank {victim} held repaired",
        0.1,
    )
    values["repaired"] = time.perf_counter() - start
    checks["repair read back"] = read_back_tables(cluster, held[:5], rows)
    cpu0, _ = cluster.coordinator_usage()
    begin = time.perf_counter()
    time.sleep(window)
    cpu1, _ = cluster.coordinator_usage()
    values["scan_cpu"] = (cpu1 - cpu0) / (time.perf_counter() - begin)


def table_ranks(cluster: SimulatedCluster, index: int) -> set[int]:
    info = cluster.stub.GetTensor(pb.GetTensorRequest(name=f"table{index}"), timeout=CALL_TIMEOUT_S)
    return {int(s.placement.split(":")[1].split("/")[0]) for s in info.metadata.shards_metadata}


def rank_alive(cluster: SimulatedCluster, rank: int) -> bool:
    try:
        ranks = cluster.stub.ListRanks(pb.ListRanksRequest(), timeout=CALL_TIMEOUT_S).ranks
    except grpc.RpcError:
        return True
    return any(r.rank == rank and r.alive for r in ranks)


def best_of(clock: Clock, key: str, fn, repeats: int = 3) -> None:
    """Row `key`: the fastest of `repeats` calls of `fn` (wall), with the coordinator's CPU of that call."""
    best: dict = {}
    for _ in range(repeats):
        Clock(clock.cluster, best).time("run", fn)
        if key not in clock.values or best["run"] < clock.values[key]:
            clock.values[key], clock.values[f"{key}_cpu"] = best["run"], best["run_cpu"]
        best.clear()


def exponent(small: Figures, large: Figures, key: str) -> float | None:
    """The growth exponent of row `key` between two N: log(value ratio) / log(rank ratio)."""
    a, b = small.values.get(key), large.values.get(key)
    if not a or not b or a <= 0 or b <= 0 or large.ranks == small.ranks:
        return None
    return math.log(b / a) / math.log(large.ranks / small.ranks)


def print_table(results: list[Figures]) -> None:
    from rich.table import Table

    from benchmarks.report import console

    table = Table(
        title="scale: the coordinator at N simulated ranks: wall time (the coordinator's CPU seconds in it); "
        "exponent of wall / CPU",
        title_justify="left",
    )
    table.add_column("row")
    for figures in results:
        table.add_column(f"N={figures.ranks}", justify="right")
    if len(results) > 1:
        table.add_column(f"exponent {results[-2].ranks}->{results[-1].ranks}", justify="right")
    table.add_column(f"target at {RANKS[-1]:,}")
    for key, what, unit, target in ROWS:
        cells = [cell(f.values, key, unit) for f in results]
        if len(results) > 1:
            powers = [exponent(results[-2], results[-1], k) for k in (key, f"{key}_cpu")]
            cells.append(" / ".join("-" if p is None else f"{p:.2f}" for p in powers))
        table.add_row(what, *cells, "-" if target is None else f"<= {target:g} {unit}")
    loads = ", ".join(f"N={f.ranks}: {' '.join(f'{x:.2f}' for x in f.load)}" for f in results)
    out = console()
    out.print(table)
    out.print(f"workloads: {results[0].work} (the targets are for 100,000 shards each)")
    out.print(f"load average at the start of each N: {loads}")
    for f in results:
        out.print(f"N={f.ranks} checks: {f.checks}, retries: {f.values.get('retries', 0)}")
        if f.failure:
            out.print(f"N={f.ranks} stopped before its last row: {f.failure}")


def cell(values: dict, key: str, unit: str) -> str:
    """A row's figure at one N, and the coordinator's CPU seconds in it when measured."""
    text = format_value(values.get(key), unit)
    cpu = values.get(f"{key}_cpu")
    return text if cpu is None else f"{text} ({cpu:.2f} cpu-s)"


def format_value(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        return f"{value * 1e3:.2f} ms" if value < 1 else f"{value:.2f} s"
    if unit == "cores":
        return f"{value * 100:.1f}%"
    return f"{value:,.1f} {unit}"


def rows_of(results: list[Figures]) -> list[Row]:
    """One Row per (row, N): seconds where the row is a time, the figure in `extra` and the note otherwise."""
    out = []
    for position, figures in enumerate(results):
        previous = results[position - 1] if position else None
        for key, what, unit, target in ROWS:
            value = figures.values.get(key)
            power = exponent(previous, figures, key) if previous is not None else None
            seconds = value if unit == "s" and value else None
            row_target = (
                Target(max_seconds=target)
                if unit == "s" and target is not None and figures.ranks == RANKS[-1]
                else None
            )
            out.append(
                Row(
                    GROUP,
                    what,
                    f"N={figures.ranks}",
                    seconds,
                    ok=all(figures.checks.values()) if figures.checks else None,
                    note=(
                        ("" if unit == "s" else format_value(value, unit))
                        if value is not None or not figures.failure
                        else f"not reached: {figures.failure}"
                    ),
                    target=row_target,
                    extra={
                        "ranks": figures.ranks,
                        "key": key,
                        "value": value,
                        "coordinator_cpu_s": figures.values.get(f"{key}_cpu"),
                        "unit": unit,
                        "exponent": power,
                        "load_average": list(figures.load),
                    },
                )
            )
    return out
