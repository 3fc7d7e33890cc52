"""`shardserve top`: a refreshing terminal view of a cluster, from its processes' Prometheus metrics.

Every interval it asks the coordinator for the ranks (and their metrics
addresses) and the tensors, scrapes every /metrics endpoint, and shows rates
over the interval: requests per second and p50/p99 latency per method (from
the histogram buckets that moved), bytes per second per data path and tensor,
and the collective jobs in flight with their progress.
"""

from __future__ import annotations

import math
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

SCRAPE_TIMEOUT_S = 2.0
Samples = dict[
    tuple[str, tuple[tuple[str, str], ...]], float
]  # (sample name, sorted labels) -> value


def scrape(address: str, timeout: float = SCRAPE_TIMEOUT_S) -> Samples:
    """Every sample of http://ADDRESS/metrics; OSError when it cannot be read."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as answer:
        text = answer.read().decode()
    return parse_samples(text)


def parse_samples(text: str) -> Samples:
    """The samples of a Prometheus text exposition, keyed by name and labels."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(
        value for (sample, keys), value in samples.items() if sample == name and want <= set(keys)
    )


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    """The samples named `name` summed per value of `label`."""
    out: dict[str, float] = {}
    for (sample, keys), value in samples.items():
        if sample == name:
            key = dict(keys).get(label, "")
            out[key] = out.get(key, 0.0) + value
    return out


def quantile(q: float, buckets: dict[float, float]) -> float:
    """The q-quantile of a cumulative histogram {upper bound: count} with linear interpolation inside a bucket,
    as Prometheus's histogram_quantile; NaN without observations."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return math.nan
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 0.0)
        lower, below = bound, count
    return lower


def method_buckets(samples: Samples, method: str) -> dict[float, float]:
    """The latency histogram of `method`, summed over processes: {le: cumulative count}."""
    out: dict[float, float] = {}
    for (sample, keys), value in samples.items():
        labels = dict(keys)
        if sample == "shardserve_rpc_latency_seconds_bucket" and labels.get("method") == method:
            bound = float(labels["le"])
            out[bound] = out.get(bound, 0.0) + value
    return out


def delta(now: Samples, before: Samples) -> Samples:
    """now - before, sample by sample (a counter that went down, a restarted process, counts from zero)."""
    out: Samples = {}
    for key, value in now.items():
        change = value - before.get(key, 0.0)
        out[key] = value if change < 0 else change
    return out


@dataclass
class Frame:
    """One refresh: what the coordinator said and what every process's metrics said, merged."""

    ranks: list[Any]
    tensors: list[Any]
    samples: Samples
    at: float
    unreachable: list[str] = field(default_factory=list)
    addresses: int = 0


def merge(parts: Iterable[Samples]) -> Samples:
    """Samples of several processes added up (each process's own series are distinct by their labels or not:
    the rates shown are the cluster's)."""
    out: Samples = {}
    for part in parts:
        for key, value in part.items():
            out[key] = out.get(key, 0.0) + value
    return out


def take_frame(cluster: Any) -> Frame:
    """Ask the coordinator for ranks and tensors and scrape every metrics endpoint it names."""
    answer = cluster.session.list_ranks()
    addresses = [answer.metrics_address] + [r.metrics_address for r in answer.ranks if r.alive]
    addresses = [a for a in addresses if a]
    parts, unreachable = [], []
    for address in addresses:
        try:
            parts.append(scrape(address))
        except OSError:
            unreachable.append(address)
    return Frame(
        list(answer.ranks),
        cluster.list(include_pending=True),
        merge(parts),
        time.monotonic(),
        unreachable,
        len(addresses),
    )


def _rate(value: float, seconds: float) -> str:
    return f"{value / seconds:,.1f}" if seconds > 0 else "-"


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.2f}"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.0f} B"


def render(frame: Frame, before: Frame | None) -> Any:
    """The rich renderable of one refresh (rates over the time since `before`, totals when there is none)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    seconds = frame.at - before.at if before is not None else 0.0
    moved = delta(frame.samples, before.samples) if before is not None else frame.samples
    head = Text(
        f"shardserve top: {len(frame.ranks)} ranks, {len(frame.tensors)} tensors, "
        f"{frame.addresses} metrics endpoints"
        + (f" ({len(frame.unreachable)} unreachable)" if frame.unreachable else "")
        + (" -- no metrics: start the cluster with --metrics-port" if not frame.addresses else "")
    )
    return Group(
        head,
        _ranks_table(frame, Table),
        _tensors_table(frame, moved, seconds, Table),
        _methods_table(moved, seconds, Table),
        _jobs_table(frame, Table),
    )


def _ranks_table(frame: Frame, table_type: Any) -> Any:
    table = table_type(title="ranks")
    for column in (
        "rank",
        "alive",
        "restarts",
        "memory used",
        "reserved",
        "recycled",
        "versions",
        "pinned",
        "jobs",
    ):
        table.add_column(column, no_wrap=True)
    for r in frame.ranks:
        rank = str(r.rank)
        table.add_row(
            rank,
            "[green]yes[/green]" if r.alive else "[red]no[/red]",
            str(r.restarts),
            _bytes(r.memory_used_bytes),
            _bytes(total(frame.samples, "shardserve_rank_memory_reserved_bytes", rank=rank)),
            _bytes(total(frame.samples, "shardserve_rank_memory_recycled_bytes", rank=rank)),
            f"{total(frame.samples, 'shardserve_rank_versions', rank=rank):.0f}",
            f"{total(frame.samples, 'shardserve_rank_versions_pinned', rank=rank):.0f}",
            f"{total(frame.samples, 'shardserve_rank_jobs_in_flight', rank=rank):.0f}",
        )
    return table


def _tensors_table(frame: Frame, moved: Samples, seconds: float, table_type: Any) -> Any:
    table = table_type(title="tensors" + (" (per second)" if seconds else " (totals)"))
    for column in (
        "name",
        "version",
        "state",
        "health",
        "shape",
        "bytes",
        "read bytes",
        "lookups",
        "ids",
    ):
        table.add_column(column, no_wrap=True)
    served = by_label(moved, "shardserve_rank_bytes_served_total", "tensor")
    lookups = by_label(moved, "shardserve_rank_lookups_total", "tensor")
    ids = by_label(moved, "shardserve_rank_lookup_ids_total", "tensor")
    per = seconds or 1.0
    for t in frame.tensors:
        table.add_row(
            t.name,
            str(t.version),
            t.state,
            t.health,
            "x".join(map(str, t.shape)) or "()",
            _bytes(t.nbytes),
            _bytes(served.get(t.name, 0.0) / per),
            f"{lookups.get(t.name, 0.0) / per:,.1f}",
            f"{ids.get(t.name, 0.0) / per:,.1f}",
        )
    return table


def _methods_table(moved: Samples, seconds: float, table_type: Any) -> Any:
    table = table_type(title="requests" + (" (per second)" if seconds else " (totals)"))
    for column in ("method", "calls", "errors", "p50 ms", "p99 ms"):
        table.add_column(column, no_wrap=True)
    calls = by_label(moved, "shardserve_rpc_requests_total", "method")
    errors = by_label(moved, "shardserve_rpc_errors_total", "method")
    for method in sorted(calls, key=lambda m: -calls[m]):
        if not calls[method]:
            continue
        buckets = method_buckets(moved, method)
        table.add_row(
            method,
            _rate(calls[method], seconds) if seconds else f"{calls[method]:.0f}",
            _rate(errors.get(method, 0.0), seconds)
            if seconds
            else f"{errors.get(method, 0.0):.0f}",
            _ms(quantile(0.5, buckets)),
            _ms(quantile(0.99, buckets)),
        )
    paths = by_label(moved, "shardserve_rank_bytes_served_total", "path")
    for path in sorted(paths):
        table.add_row(
            f"[dim]bytes over {path}[/dim]", _bytes(paths[path] / (seconds or 1.0)), "", "", ""
        )
    return table


def _jobs_table(frame: Frame, table_type: Any) -> Any:
    table = table_type(title="collective jobs in flight")
    for column in ("kind", "jobs", "progress"):
        table.add_column(column, no_wrap=True)
    running = by_label(frame.samples, "shardserve_coordinator_jobs_in_flight", "kind")
    done = by_label(frame.samples, "shardserve_coordinator_job_bytes_done", "kind")
    whole = by_label(frame.samples, "shardserve_coordinator_job_bytes_total", "kind")
    for kind, count in sorted(running.items()):
        if count:
            share = f"{100 * done.get(kind, 0.0) / whole[kind]:.0f}%" if whole.get(kind) else "-"
            table.add_row(kind, f"{count:.0f}", f"{share} of {_bytes(whole.get(kind, 0.0))}")
    return table


def run_top(cluster: Any, interval: float, iterations: int = 0) -> None:
    """Refresh the view every `interval` seconds, `iterations` times (0: until Ctrl-C, which quits quietly)."""
    from rich.console import Console
    from rich.live import Live

    if not interval > 0:
        raise ValueError(f"--interval must be > 0 seconds, got {interval}")
    before = take_frame(cluster)
    shown = 0
    try:
        with Live(
            render(before, None), console=Console(), auto_refresh=False, vertical_overflow="visible"
        ) as live:
            while iterations == 0 or shown < iterations:
                time.sleep(interval)
                frame = take_frame(cluster)
                live.update(render(frame, before), refresh=True)
                before = frame
                shown += 1
    except KeyboardInterrupt:
        return
