"""One table for a GPU check (scripts/device-cuda-check.sh): pytest's counts, then every measured row of a
benchmark run with its limit, ratio and target.

The tests come from pytest's JUnit XML, the rows from `python -m benchmarks --json`; a stage that timed out
or left no file is a line of the table saying so, never a crash of the summary.

    python -m benchmarks.summary --junit cuda-tests.xml --tests-status 0 --bench cuda-bench.json --bench-status 0
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from rich.table import Table

from benchmarks.report import console, fmt_ratio, fmt_seconds, machine_lines

TIMED_OUT = 124  # timeout(1)'s status; 137 when it had to kill
KILLED = 137
COUNTS = ("tests", "failures", "errors", "skipped")


def pytest_counts(junit: Path) -> dict[str, int] | None:
    """{tests, failures, errors, skipped, passed} summed over the XML's test suites; None without a file."""
    if not junit.is_file():
        return None
    root = ElementTree.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(suite.get(key, 0)) for suite in suites) for key in COUNTS}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def failed_tests(junit: Path, most: int = 8) -> list[str]:
    """The ids of the first `most` failed or erroring tests of the XML."""
    if not junit.is_file():
        return []
    names = [
        f"{case.get('classname', '')}::{case.get('name', '')}"
        for case in ElementTree.parse(junit).getroot().iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return names[:most]


def stage_result(status: int, ok_text: str) -> str:
    if status in (TIMED_OUT, KILLED):
        return f"TIMED OUT (exit {status})"
    return ok_text if status == 0 else f"FAILED (exit {status})"


def tests_line(junit: Path, status: int) -> tuple[str, ...]:
    counts = pytest_counts(junit)
    if counts is None:
        return (
            "pytest",
            "-",
            "no JUnit XML",
            "-",
            "-",
            "every test passes",
            stage_result(status, "?"),
        )
    value = ", ".join(f"{counts[key]} {key}" for key in ("passed", "failures", "errors", "skipped"))
    failed = "; ".join(failed_tests(junit))
    return (
        "pytest",
        f"{counts['tests']} tests",
        value,
        "-",
        "-",
        "every test passes",
        stage_result(status, "ok") + (f": {failed}" if failed else ""),
    )


def row_line(row: dict, baselines: dict[tuple[str, str, str], dict]) -> tuple[str, ...]:
    """A measured (subject) row: its figure, its baseline's, the ratio, the target and whether it is met."""
    base = baselines.get((row["group"], row["case"], row["baseline"] or ""))
    limit = "-" if base is None else f"{base['name']} {fmt_seconds(base['seconds'])}"
    target = row.get("target") or {}
    met = {True: "met", False: "NOT met", None: "-"}[target.get("met")]
    return (
        f"{row['group']}: {row['name']}",
        row["case"],
        fmt_seconds(row["seconds"]) + (f" ({row['path']})" if row.get("path") else ""),
        limit,
        fmt_ratio(row["ratio"]),
        target.get("text", "-"),
        "; ".join(part for part in (met if target else "", row["note"]) if part) or "-",
    )


def summary_table(
    junit: Path, tests_status: int, bench: Path, bench_status: int
) -> tuple[Table, list[str]]:
    """The table, and the lines to print above it (the benchmark's machine and load average)."""
    table = Table(
        title="GPU check: tests and benchmark rows against their limits", title_justify="left"
    )
    for column in ("check", "case", "value", "limit (same run)", "ratio", "target", "result"):
        table.add_column(column, justify="right" if column in ("value", "ratio") else "left")
    table.add_row(*tests_line(junit, tests_status))
    if not bench.is_file():
        table.add_row("benchmark", "-", "no JSON", "-", "-", "-", stage_result(bench_status, "?"))
        return table, []
    doc = json.loads(bench.read_text())
    for report in doc["scenarios"]:
        status = "ok" if report["status"] == "ok" else f"FAILED: {report['error']}"
        table.add_row(
            f"benchmark {report['name']}",
            f"{report['rows']} rows",
            f"{report['wall_seconds']:.1f} s",
            "-",
            "-",
            "-",
            stage_result(bench_status, status),
        )
    baselines = {
        (r["group"], r["case"], r["name"]): r for r in doc["rows"] if r["role"] == "baseline"
    }
    for row in doc["rows"]:
        if row["role"] == "subject":
            table.add_row(*row_line(row, baselines))
    return table, machine_lines(doc["machine"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.summary", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--junit", type=Path, required=True, help="pytest's --junitxml file")
    parser.add_argument("--tests-status", type=int, required=True, help="pytest's exit status")
    parser.add_argument(
        "--bench", type=Path, required=True, help="python -m benchmarks --json file"
    )
    parser.add_argument(
        "--bench-status", type=int, required=True, help="the benchmark's exit status"
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    table, lines = summary_table(args.junit, args.tests_status, args.bench, args.bench_status)
    out = console()
    for line in lines:
        out.print(line)
    out.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
