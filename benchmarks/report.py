"""The suite's printed report: machine info and one rich table per scenario group."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from benchmarks.harness import Row


def fmt_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.3f} s"


def fmt_ratio(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def fmt_mib(nbytes: int | None) -> str:
    return "-" if not nbytes else f"{nbytes / (1 << 20):,.0f}"


def fmt_target(row: Row) -> str:
    """The row's target and whether this run reached it."""
    if row.target is None:
        return "-"
    return (
        f"{row.target.text}: {({True: 'met', False: 'NOT met', None: 'no figure'})[row.target_met]}"
    )


def console() -> Console:
    """A console as wide as the terminal, or wide enough for the tables when piped."""
    return Console() if sys.stdout.isatty() else Console(width=200)


def machine_lines(machine: dict) -> list[str]:
    load = machine.get("load_average") or []
    return [
        f"CPU: {machine['cpu_model']} ({machine['cpus_usable']} usable of {machine['cpu_count']}), "
        f"memory {machine['memory_bytes'] / (1 << 30):.1f} GiB, load {' '.join(f'{x:.2f}' for x in load)}"
        f" -> {' '.join(f'{x:.2f}' for x in machine.get('load_average_end') or [])}",
        f"python {machine['python']}, torch {machine['torch']} ({machine['torch_threads']} threads), "
        f"grpc {machine['grpc']}, protobuf {machine['protobuf']}, {machine['platform']}, "
        f"commit {machine['git_commit']}, started {machine['started_utc']}",
    ]


def group_table(group: str, rows: list[Row]) -> Table:
    """Absolute figures and ratios of one group; `x baseline` = baseline seconds / seconds (> 1 is faster)."""
    table = Table(
        title=f"{group}: ratio = baseline seconds / seconds (> 1 is faster than the baseline)",
        title_justify="left",
    )
    for column in (
        "case",
        "method",
        "path",
        "MiB",
        "seconds",
        "GB/s",
        "x baseline",
        "baseline",
        "x each baseline",
        "peak RSS MiB",
        "ok",
        "target",
        "note",
    ):
        numeric = column in ("MiB", "seconds", "GB/s", "x baseline", "peak RSS MiB")
        table.add_column(column, justify="right" if numeric else "left")
    for row in rows:
        rss = max(row.peak_rss.values(), default=None)
        each = ", ".join(f"{name} {fmt_ratio(r)}" for name, r in row.ratios.items())
        table.add_row(
            row.case,
            row.name,
            row.path or "-",
            fmt_mib(row.nbytes),
            fmt_seconds(row.seconds),
            "-" if row.gb_per_s is None else f"{row.gb_per_s:.2f}",
            fmt_ratio(row.ratio),
            row.baseline or "-",
            each or "-",
            fmt_mib(rss),
            {True: "yes", False: "NO", None: "-"}[row.ok],
            fmt_target(row),
            row.note,
        )
    return table


def print_report(rows: list[Row], reports: list[dict], machine: dict) -> None:
    out = console()
    for line in machine_lines(machine):
        out.print(line)
    groups: dict[str, list[Row]] = {}
    for row in rows:
        groups.setdefault(row.group, []).append(row)
    for group, members in groups.items():
        out.print(group_table(group, members))
    for report in reports:
        status = "ok" if report["status"] == "ok" else f"FAILED: {report['error']}"
        out.print(
            f"scenario {report['name']}: {report['rows']} rows in {report['wall_seconds']:.1f}s, {status}"
        )


def markdown_table(doc: dict, group: str) -> str:
    """One group of a suite's JSON document as a Markdown table (for the README)."""
    lines = [
        "| case | method | path | seconds | GB/s | x baseline (which) | x each baseline | peak RSS MiB |",
        "|---|---|---|--:|--:|--:|---|--:|",
    ]
    for r in (r for r in doc["rows"] if r["group"] == group):
        each = ", ".join(f"{name} {fmt_ratio(x)}" for name, x in r["ratios"].items()) or "-"
        gbs = "-" if r["gb_per_s"] is None else f"{r['gb_per_s']:.2f}"
        lines.append(
            f"| {r['case']} | {r['name']} | {r['path'] or '-'} | {fmt_seconds(r['seconds'])} | {gbs} | "
            f"{fmt_ratio(r['ratio'])} ({r['baseline'] or '-'}) | {each} | "
            f"{fmt_mib(r['peak_rss_max_bytes'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.report RESULTS.json [GROUP...]`: Markdown tables of a saved run."""
    import json
    from pathlib import Path

    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m benchmarks.report RESULTS.json [GROUP...]", file=sys.stderr)
        return 2
    doc = json.loads(Path(argv[0]).read_text())
    groups = argv[1:] or list(dict.fromkeys(r["group"] for r in doc["rows"]))
    for line in machine_lines(doc["machine"]):
        print(line + "  ")
    for group in groups:
        print(f"\n**{group}**\n\n{markdown_table(doc, group)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
