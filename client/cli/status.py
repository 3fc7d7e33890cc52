"""What `shardserve status` and `shardserve snapshots` print: ranks, tensors and snapshots for people."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from rich.console import Console

if TYPE_CHECKING:
    from rich.table import Table

    from shardserve.client.cluster import Cluster
    from shardserve.client.info import RestoreStatus


def human_bytes(n: float) -> str:
    """`n` bytes for people: "512 B", "1.5 MiB"."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def show_status(cluster: Cluster) -> None:
    """The ranks, the collective epoch and the tensors (with their health) of `cluster`, as tables."""
    from rich.table import Table

    from shardserve.client.info import health_summary, layout_summary
    from shardserve.core.dtypes import dtype_name

    ranks = Table(title=f"ranks of {cluster.address}")
    for column in (
        "rank",
        "address",
        "device",
        "host",
        "pid",
        "restarts",
        "alive",
        "memory used",
        "memory limit",
        "limit from",
        "metrics",
        "restore",
    ):
        ranks.add_column(column)
    statuses = cluster.ranks()
    for r in statuses:
        ranks.add_row(
            str(r.rank),
            r.address or "-",
            r.device,
            r.hostname,
            str(r.pid),
            str(r.restarts),
            "[green]yes[/green]" if r.alive else "[red]no[/red]",
            human_bytes(r.memory_used_bytes),
            human_bytes(r.memory_limit_bytes) if r.memory_limit_bytes else "-",
            r.memory_limit_source or "-",
            r.metrics_address or "-",
            _restore_summary(r.restore),
        )
    restoring = {r.rank for r in statuses if r.restore is not None}
    tensors = Table(title="tensors")
    for column in (
        "name",
        "version",
        "state",
        "health",
        "replicas",
        "shape",
        "dtype",
        "layout",
        "bytes",
    ):
        tensors.add_column(column)
    colors = {"healthy": "green", "degraded": "yellow", "unavailable": "red", "lost": "red"}
    for t in cluster.list(include_pending=True):
        health = f"[{colors[t.health]}]{health_summary(t)}[/{colors[t.health]}]"
        waiting = sorted({t.metadata.shards_metadata[i].rank for i in t.unavailable} & restoring)
        if waiting:
            health = f"[yellow]restoring (rank{'s' if len(waiting) > 1 else ''} {','.join(map(str, waiting))})[/yellow]"
        tensors.add_row(
            t.name,
            str(t.version),
            t.state,
            health,
            str(t.replicas),
            "x".join(map(str, t.shape)) or "()",
            dtype_name(t.dtype),
            layout_summary(t.metadata),
            human_bytes(t.nbytes),
        )
    console = (
        Console() if sys.stdout.isatty() else Console(width=200)
    )  # pipes: no truncated columns
    console.print(_coordinators_table(cluster))
    console.print(ranks)
    _print_epoch(cluster, console)
    console.print(tensors)


def _coordinators_table(cluster: Cluster) -> Table:
    """Every coordinator given (and the leader they name): its role, term, the leader it knows, its lease."""
    from rich.table import Table

    table = Table(title="coordinators")
    for column in ("address", "role", "term", "leader", "lease", "takeovers"):
        table.add_column(column)
    colors = {"leader": "green", "standby": "yellow", "unreachable": "red"}
    for c in cluster.session.coordinators.roles():
        color = colors.get(c.role, "red")
        table.add_row(
            c.address,
            f"[{color}]{c.role}[/{color}]" + (f" ({c.error})" if c.error else ""),
            str(c.term) if c.term else "-",
            c.leader or "-",
            f"{c.lease_duration_s:g}s" if c.lease_duration_s else "- (lone coordinator)",
            str(c.takeovers),
        )
    return table


def _restore_summary(restore: RestoreStatus | None) -> str:
    """A rank's restore for people: "-", "42% (1.2 GiB of 2.9 GiB, 3 of 7 tensors)" or "loaded, re-promoting"."""
    if restore is None:
        return "-"
    if restore.loaded:
        return "loaded, re-promoting"
    return (
        f"{restore.fraction:.0%} ({human_bytes(restore.done_bytes)} of {human_bytes(restore.total_bytes)}, "
        f"{restore.done_tensors} of {restore.total_tensors} tensors)"
    )


def _print_epoch(cluster: Cluster, console: Console) -> None:
    """The epoch of collective jobs: one more after every failed job, whose groups the ranks dropped."""
    answer = cluster.session.list_ranks()
    console.print(f"collective jobs: epoch {answer.epoch}")
    console.print(
        f"coordinator metrics: {answer.metrics_address or '- (started without --metrics-port)'}"
    )


def show_snapshots(cluster: Cluster, prefix: str, tensors: bool) -> None:
    """One line per kept snapshot of `prefix` (and one per tensor with `tensors`): a delta put's says what it
    stores anew; with more than one, what they hold together, shared blocks counted once."""
    from shardserve.client.ops.snapshots import held_once
    from shardserve.client.spmd_packs import stored_packs

    kept = cluster.snapshots(prefix)
    if not kept:
        print(f"no snapshots of {prefix}")
    held = held_once(kept)
    for snapshot in kept:
        own = held[snapshot.number]
        sharing = (
            f" ({own} new, the rest shared with snapshot {snapshot.delta_of})"
            if own != snapshot.nbytes
            else ""
        )
        packs = stored_packs(snapshot.skeleton)
        packed = sum(len(pack.items) for pack in packs)
        count = len(snapshot.tensors) - len(packs) + packed
        in_packs = f" ({packed} in {len(packs)} pack{'s' * (len(packs) > 1)})" if packs else ""
        print(
            f"{prefix}\tsnapshot {snapshot.number}\t{count} tensors{in_packs}\t"
            f"{snapshot.nbytes} bytes{sharing}\tage {snapshot.age_s:.1f}s"
        )
        for key, t in snapshot.tensors.items() if tensors else ():
            print(f"  {key}\t{tuple(t.shape)}\t{t.dtype}\t{t.nbytes} bytes\t{t.health}")
        for pack in packs if tensors else ():
            for item in pack.items:
                print(
                    f"  {item.key}\t{item.shape}\t{item.dtype}\t{item.nbytes} bytes\t"
                    f"packed in {pack.key}"
                )
    if len(kept) > 1:
        print(
            f"{prefix}\theld\t{sum(held.values())} bytes (blocks shared between snapshots counted once)"
        )
