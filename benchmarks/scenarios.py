"""Scenarios that wrap the standalone benchmark modules (planning, reshard) for the suite.

Each adapter calls the module's own `main(argv)` with `--json FILE` (its
printed table is captured, not shown), reads that JSON back and turns it into
harness Rows; the modules' logic is not repeated here. Add an adapter for a new
module (lookups, checkpoint) the same way: one function with `@scenario`.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from collections.abc import Callable
from contextlib import redirect_stdout
from pathlib import Path

from benchmarks.harness import Context, Row, scenario
from benchmarks.rss import SELF_LABEL

CLUSTER_RESHARD_MIB = 256


def run_module_main(main: Callable[[list[str]], object], argv: list[str]) -> dict:
    """Call a benchmark module's main(argv + ["--json", FILE]) quietly and return the JSON it wrote."""
    with tempfile.TemporaryDirectory(prefix="shardserve-bench-") as tmp:
        path = Path(tmp) / "result.json"
        printed = io.StringIO()
        try:
            with redirect_stdout(printed):
                main([*argv, "--json", str(path)])
        except SystemExit as exc:
            raise RuntimeError(
                f"{main.__module__}.main exited with {exc.code}: {printed.getvalue()[-2000:]}"
            ) from None
        return json.loads(path.read_text())


@scenario(
    "planning",
    help="plan_reshard vs DCP's read planner and all-pairs; row routing vs a Python loop",
)
def planning_scenario(ctx: Context) -> list[Row]:
    """benchmarks.planning, as rows: planning time per layout, routing time per id batch."""
    from benchmarks import planning

    with ctx.rss([os.getpid()]) as peaks:
        result = run_module_main(planning.main, ["--quick"] if ctx.quick else [])
    return planning_rows(result["planning"], peaks) + routing_rows(result["routing"], peaks)


def planning_rows(results: list[dict], peaks: dict[str, int]) -> list[Row]:
    rows = []
    for r in results:
        case = f"{r['layout']} {r['src_shards']}->{r['dst_shards']}"
        extra = {"transfers": r["transfers"], "buckets": r["buckets"]}
        rows.append(
            Row(
                "planning",
                case,
                "plan_reshard",
                r["plan_ms"] / 1e3,
                path="in-process",
                baseline="DCP read planner",
                peak_rss=peaks,
                extra=extra,
            )
        )
        rows.append(
            Row(
                "planning",
                case,
                "DCP read planner",
                r["dcp_ms"] / 1e3,
                path="in-process",
                role="baseline",
                peak_rss=peaks,
            )
        )
        if r["all_pairs_ms"] is not None:
            rows.append(
                Row(
                    "planning",
                    case,
                    "all-pairs loop",
                    r["all_pairs_ms"] / 1e3,
                    path="in-process",
                    role="baseline",
                    peak_rss=peaks,
                )
            )
    return rows


def routing_rows(results: list[dict], peaks: dict[str, int]) -> list[Row]:
    rows = []
    for r in results:
        case, count = f"{r['layout']}: {r['ids']}", r["count"]
        methods = (
            ("RowIndex.route", r["route_ids_per_s"], "subject", ""),
            ("route_rows (+index build)", r["route_rows_ids_per_s"], "subject", ""),
            (
                "Python loop (bisect)",
                r["python_loop_ids_per_s"],
                "baseline",
                "extrapolated from a subset",
            ),
        )
        for name, per_s, role, note in methods:
            if per_s:
                rows.append(
                    Row(
                        "routing",
                        case,
                        name,
                        count / per_s,
                        path="in-process",
                        role=role,
                        peak_rss=peaks,
                        note=note,
                        extra={"ids": count, "ids_per_s": per_s},
                    )
                )
    return rows


@scenario(
    "reshard",
    help="Shard(0)->Shard(1) on gloo ranks: shardserve vs bare all_to_all, DTensor, ShardedTensor; "
    "a 2-rank cluster's reshard vs the same column copies in one process",
)
def reshard_scenario(ctx: Context) -> list[Row]:
    """benchmarks.reshard, as rows: one case per world size, peak RSS of every rank process of the worlds;
    then benchmarks.reshard_cluster's 2-rank cluster reshard against an in-process copy_."""
    from benchmarks import reshard
    from benchmarks.reshard_cluster import cluster_reshard_rows

    argv = (
        ["--size-mib", "4", "--ranks", "2", "--repeats", "1", "--timeout", "120"]
        if ctx.quick
        else ["--timeout", "900"]
    )
    with ctx.rss() as seen:
        result = run_module_main(reshard.main, argv)
    peaks = {
        label: rss for label, rss in seen.items() if label != SELF_LABEL
    }  # the world's ranks only
    rows = []
    for run in result["runs"]:
        nbytes = run["n"] * run["n"] * 4
        case = f"{run['world']} ranks, {nbytes >> 20} MiB"
        for r in run["rows"]:
            ours = r["method"] == reshard.OURS
            extra = {
                k: v for k, v in r.items() if k not in ("method", "seconds", "ok", "note", "trace")
            }
            rows.append(
                Row(
                    "reshard",
                    case,
                    r["method"],
                    r["seconds"],
                    path="gloo",
                    role="subject" if ours else "baseline",
                    nbytes=nbytes,
                    baseline=reshard.BARE,
                    peak_rss=peaks,
                    ok=r["ok"],
                    note=r.get("note", ""),
                    extra=extra,
                )
            )
    size_mib, repeats = (4, 1) if ctx.quick else (CLUSTER_RESHARD_MIB, 3)
    return rows + cluster_reshard_rows(size_mib=size_mib, repeats=repeats)


@scenario(
    "heal",
    help="a replicas=2 table read by 8 processes through a rank's SIGKILL, restart and repair",
)
def heal_scenario(ctx: Context) -> list[Row]:
    """benchmarks.heal, as rows: the repair against a bare gloo send of the same bytes; read p50/p99 in the
    outage against before it; detection, re-admission and failed reads in `extra`."""
    from benchmarks import heal

    argv = (
        [
            "--rows",
            "20000",
            "--dim",
            "32",
            "--readers",
            "2",
            "--kill-at",
            "1",
            "--after",
            "1",
            "--no-quiet-repair",
        ]
        if ctx.quick
        else []
    )
    with ctx.rss() as seen:
        result = run_module_main(heal.main, argv)
    peaks = {label: rss for label, rss in seen.items() if label != SELF_LABEL}
    extra = {key: result[key] for key in ("reads", "wrong", "restarts")}
    extra.update(
        failed=len(result["failed"]), under_load=result["under_load"], quiet=result["quiet"]
    )
    rows = []
    case = "repair of a restarted rank's copies"
    for name, recovery in (
        ("shardserve repair, reads running", result["under_load"]),
        ("shardserve repair, no reads", result["quiet"]),
    ):
        if recovery["repair_s"]:
            rows.append(
                Row(
                    "heal",
                    case,
                    name,
                    recovery["repair_s"],
                    path="gloo",
                    nbytes=recovery["repair_bytes"],
                    baseline="bare gloo send",
                    peak_rss=peaks,
                    extra=extra,
                )
            )
    if result["bare_send_s"]:
        rows.append(
            Row(
                "heal",
                case,
                "bare gloo send",
                result["bare_send_s"],
                path="gloo",
                role="baseline",
                nbytes=result["under_load"]["repair_bytes"],
            )
        )
    for stat in ("p50_ms", "p99_ms"):
        case = f"read {stat[:3]} (256-id lookups, 64-row fetches)"
        before, during = result["phases"]["before"], result["phases"]["during"]
        if stat in before and stat in during:
            rows += [
                Row(
                    "heal",
                    case,
                    "during the outage",
                    during[stat] / 1e3,
                    path="auto",
                    baseline="no failure",
                    extra={"reads": during["reads"]},
                ),
                Row(
                    "heal",
                    case,
                    "no failure",
                    before[stat] / 1e3,
                    path="auto",
                    role="baseline",
                    extra={"reads": before["reads"]},
                ),
            ]
    return rows


@scenario(
    "updates",
    help="update_rows cost by table size, update rate with 1 and 4 writers, lookups during updates",
)
def updates_scenario(ctx: Context) -> list[Row]:
    """benchmarks.updates, as rows: one case per table size, the rates, and lookup latency with/without updates."""
    from benchmarks import updates

    result = run_module_main(updates.main, ["--quick"] if ctx.quick else [])
    rows = [
        Row(
            "updates",
            f"one update of {updates.ROWS_PER_UPDATE} rows",
            f"{size} table",
            cost["median_s"],
            extra={**cost, "large_over_small": result["large_over_small"]},
        )
        for size, cost in result["update_cost"].items()
    ]
    rows += [
        Row(
            "updates",
            "sustained rate",
            label,
            1.0 / rate["updates_per_s"] if rate["updates_per_s"] else None,
            extra=rate,
        )
        for label, rate in result["rate"].items()
    ]
    rows += [
        Row(
            "updates",
            "lookup of 256 ids",
            label,
            lookup["p50_ms"] / 1000 if lookup["lookups"] else None,
            extra=lookup,
        )
        for label, lookup in result["lookups"].items()
    ]
    return rows
