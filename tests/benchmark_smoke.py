"""The benchmark suite as a smoke test, shared by the two halves of its scenarios
(tests/benchmarks/test_benchmarks_smoke*.py, apart so that two workers run them at once). Each half's scenarios
run in one `python -m benchmarks --quick --only ...` process, as a full run does: one torch import and one
preloaded forkserver serve all of them, where a process per scenario paid for both every time.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks.harness import load_scenarios

PROJECT_ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 120
"""Hard limit of a tool's small run: ~10-20 s on an idle 2-core machine, ~45 s at load 12."""
HALF_TIMEOUT_S = 480
"""Hard limit of a half's quick run: 60-85 s on an idle 2-core machine and in the suite."""
SCENARIOS = sorted(load_scenarios())
SECOND_HALF = {"cuda", "heal", "persist", "reshard", "security", "statedict", "torchrec"}
"""The scenarios test_benchmarks_smoke_second.py runs (on the other worker); a scenario's own detail tests sit in
the module that runs it, since each half is run once (the `runs` fixture's cache)."""
FIRST_HALF = [name for name in SCENARIOS if name not in SECOND_HALF]
ROW_FIELDS = {
    "scenario",
    "group",
    "case",
    "name",
    "path",
    "role",
    "nbytes",
    "seconds",
    "gb_per_s",
    "baseline",
    "ratio",
    "ratios",
    "peak_rss",
    "peak_rss_max_bytes",
    "ok",
    "note",
}
MACHINE_FIELDS = {
    "cpu_count",
    "cpu_model",
    "memory_bytes",
    "torch",
    "grpc",
    "python",
    "load_average",
}


def run_in_session(
    argv: list[str], what: str, timeout_s: float = RUN_TIMEOUT_S, *, exits: tuple[int, ...] = (0,)
) -> tuple[str, str]:
    """Run `python -m ARGV` in a session of its own under a hard timeout, then kill the whole session (its ranks
    and baseline servers too); its exit code must be one of `exits`: (stdout, stderr)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", *argv],
        cwd=PROJECT_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=30)
        pytest.fail(f"{what} took over {timeout_s}s; output:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    assert proc.returncode in exits, (
        f"exit {proc.returncode}\nstdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}"
    )
    return stdout, stderr


def run_quick(names: list[str], out: Path) -> tuple[dict, Path, str]:
    """`python -m benchmarks --quick --only NAME... --json F --plots D` under a hard timeout: (JSON, plots dir,
    stdout). Exit 1 (a scenario failed) is left to that scenario's test: its error in the JSON then carries the
    run's stderr, where its traceback is."""
    json_path, plots = out / "bench.json", out / "plots"
    stdout, stderr = run_in_session(
        [
            "benchmarks",
            "--quick",
            "--only",
            *names,
            "--json",
            str(json_path),
            "--plots",
            str(plots),
        ],
        f"python -m benchmarks --quick --only {' '.join(names)}",
        HALF_TIMEOUT_S,
        exits=(0, 1),
    )
    if not json_path.exists():
        pytest.fail(
            f"the quick run wrote no JSON\nstdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}"
        )
    doc = json.loads(json_path.read_text())
    for report in doc["scenarios"]:
        if report["status"] != "ok":
            report["error"] = f"{report['error']}\nstderr:\n{stderr[-3000:]}"
    return doc, plots, stdout


def make_runs(
    tmp_path_factory: pytest.TempPathFactory, names: list[str]
) -> Callable[[str], tuple[dict, Path, str]]:
    """The quick run of the scenarios `names`, made on the first use of any of them and shared by the tests of a
    module (its `runs` fixture): runs(NAME) -> (JSON, plots dir, stdout) of the run that holds NAME."""
    made: list[tuple[dict, Path, str]] = []

    def get(name: str) -> tuple[dict, Path, str]:
        assert name in names, f"{name} is not among this module's scenarios {names}"
        if not made:
            made.append(run_quick(names, tmp_path_factory.mktemp("bench")))
        return made[0]

    return get


def scenario_rows(doc: dict, name: str) -> list[dict]:
    """The rows scenario `name` produced in a quick run."""
    return [row for row in doc["rows"] if row["scenario"] == name]


def check_scenario(doc: dict, plots: Path, stdout: str, name: str) -> None:
    """Scenario `name` in a quick run: machine info, the scenario ok, its rows checked (check_rows), a table and a
    plot per group."""
    assert MACHINE_FIELDS <= set(doc["machine"])
    assert doc["machine"]["cpu_count"] >= 1 and doc["machine"]["memory_bytes"] > 0
    assert doc["quick"] is True and doc["command"].startswith(
        "python -m benchmarks --quick --only "
    )
    (report,) = [r for r in doc["scenarios"] if r["name"] == name]
    assert report["status"] == "ok", report["error"]
    rows = scenario_rows(doc, name)
    assert rows and report["rows"] == len(rows)
    check_rows(rows)
    for group in {r["group"] for r in rows}:
        assert f"{group}: ratio" in stdout
        png = plots / f"{group}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def check_rows(rows: list[dict]) -> None:
    """Fields present; GB/s = bytes / seconds; ratio = its baseline's seconds / seconds; results matched."""
    by_case: dict[tuple[str, str], dict[str, dict]] = {}
    for row in rows:
        assert ROW_FIELDS <= set(row), row
        by_case.setdefault((row["group"], row["case"]), {})[row["name"]] = row
    for (group, case), rows in by_case.items():
        for row in rows.values():
            if row["nbytes"] and row["seconds"]:
                assert math.isclose(
                    row["gb_per_s"], row["nbytes"] / row["seconds"] / 1e9, rel_tol=1e-9
                )
            base = rows.get(row["baseline"])
            if row["ratio"] is not None:
                assert base is not None and base["role"] == "baseline", (group, case, row["name"])
                assert math.isclose(row["ratio"], base["seconds"] / row["seconds"], rel_tol=1e-9)
            assert row["ok"] is not False, (
                f"{group} {case} {row['name']}: result differs from the source"
            )
            if row["role"] == "subject" and group in (
                "fetch",
                "lookups",
                "reshard",
            ):  # these compare their data
                assert row["ok"] is True, f"{group} {case} {row['name']}: result never compared"
            assert all(isinstance(v, int) and v > 0 for v in row["peak_rss"].values()), row[
                "peak_rss"
            ]
