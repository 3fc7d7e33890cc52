"""The benchmark suite as a smoke test: `python -m benchmarks --quick --only NAME` per scenario
writes JSON of the agreed shape.

Never asserts a timing: only that every scenario ran, that rows carry the
fields the README and plots rely on, that the figures are consistent with each
other (GB/s = bytes / seconds, ratio = baseline seconds / seconds) and that
every method's result matched its source.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks.harness import Row, fill_ratios, load_scenarios, scenario
from benchmarks.rss import RssSampler

PROJECT_ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 120  # hard limit per `--quick --only NAME` run: ~10-20 s on an idle 2-core machine, ~45 s at load 12
SCENARIOS = sorted(load_scenarios())
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


def run_in_session(argv: list[str], what: str, timeout_s: float = RUN_TIMEOUT_S) -> tuple[str, str]:
    """Run `python -m ARGV` in a session of its own under a hard timeout, then kill the whole session (its ranks
    and baseline servers too); its exit must be 0: (stdout, stderr)."""
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
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}"
    )
    return stdout, stderr


def run_quick(name: str, out: Path) -> tuple[dict, Path, str]:
    """`python -m benchmarks --quick --only NAME --json F --plots D` under a hard timeout: (JSON, plots dir, stdout)."""
    json_path, plots = out / "bench.json", out / "plots"
    stdout, _ = run_in_session(
        ["benchmarks", "--quick", "--only", name, "--json", str(json_path), "--plots", str(plots)],
        f"python -m benchmarks --quick --only {name}",
    )
    return json.loads(json_path.read_text()), plots, stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Callable[[str], tuple[dict, Path, str]]:
    """Each scenario's quick run, made on first use and shared by the tests of this module."""
    cache: dict[str, tuple[dict, Path, str]] = {}

    def get(name: str) -> tuple[dict, Path, str]:
        if name not in cache:
            cache[name] = run_quick(name, tmp_path_factory.mktemp(f"bench-{name}"))
        return cache[name]

    return get


def test_the_suite_has_the_issue_scenarios() -> None:
    assert {"fetch", "planning", "reshard"} <= set(SCENARIOS)


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_runs_quick_with_machine_info_and_rows(runs, name: str) -> None:
    doc, plots, stdout = runs(name)
    assert MACHINE_FIELDS <= set(doc["machine"])
    assert doc["machine"]["cpu_count"] >= 1 and doc["machine"]["memory_bytes"] > 0
    assert doc["quick"] is True and doc["command"].startswith(
        f"python -m benchmarks --quick --only {name}"
    )
    assert [(r["name"], r["status"]) for r in doc["scenarios"]] == [(name, "ok")], doc["scenarios"]
    assert doc["rows"] and all(row["scenario"] == name for row in doc["rows"])
    check_rows(doc["rows"])
    for group in {r["group"] for r in doc["rows"]}:
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


def test_fetch_rows_compare_shardserve_with_three_baselines(runs) -> None:
    doc, _, _ = runs("fetch")
    fetch = [r for r in doc["rows"] if r["scenario"] == "fetch"]
    cases = {r["case"] for r in fetch}
    assert cases
    for case in cases:
        rows = {r["name"]: r for r in fetch if r["case"] == case}
        assert {"raw TCP socket", "torch.distributed.rpc", "memcpy"} <= set(rows)
        ours = [r for r in fetch if r["case"] == case and r["role"] == "subject"]
        assert sorted(r["path"] for r in ours) == [
            "grpc",
            "grpc",
            "shm",
            "shm",
            "tcp",
            "tcp",
        ]  # 1, 2 shards a path
        for row in ours:
            assert row["ok"] is True and row["nbytes"] == 1 << 20
            assert row["baseline"] == "raw TCP socket" and row["ratio"] > 0
            assert set(row["ratios"]) == {"raw TCP socket", "torch.distributed.rpc", "memcpy"}
            assert {"rank 0 server", "rank 1 server"} <= set(row["peak_rss"])
        assert set(rows["raw TCP socket"]["peak_rss"]) == {"socket server"}
        assert set(rows["torch.distributed.rpc"]["peak_rss"]) == {"rpc server"}
        check_rpc_row_is_the_faster_transport(rows["torch.distributed.rpc"])


def check_rpc_row_is_the_faster_transport(row: dict) -> None:
    """An rpc baseline row holds each TensorPipe transport's figure and is the faster one, named in its path."""
    by_transport = row["extra"]["seconds_by_transport"]
    assert set(by_transport) == {"shm", "uv"}
    fastest = min(by_transport, key=by_transport.get)
    assert row["path"] == f"tensorpipe {fastest}" and row["seconds"] == by_transport[fastest]
    assert row["role"] == "baseline" and row["ok"] is True


def test_lookup_rows_take_the_faster_rpc_transport(runs) -> None:
    doc, _, _ = runs("lookups")
    rpc_rows = [r for r in doc["rows"] if r["name"] == "torch.distributed.rpc"]
    assert len(rpc_rows) == len({r["case"] for r in doc["rows"]}) > 0  # one per case
    for row in rpc_rows:
        check_rpc_row_is_the_faster_transport(row)


def test_fill_ratios_against_named_and_default_baselines() -> None:
    rows = [
        Row("g", "c", "ours", 2.0, baseline="slow"),
        Row("g", "c", "fast", 1.0, role="baseline"),
        Row("g", "c", "slow", 8.0, role="baseline"),
        Row("g", "other", "alone", 1.0),
    ]
    fill_ratios(rows)
    ours, fast, slow, alone = rows
    assert ours.ratio == 4.0 and ours.ratios == {"fast": 0.5, "slow": 4.0}
    assert fast.baseline == "fast" and fast.ratio == 1.0 and fast.ratios == {"slow": 8.0}
    assert slow.baseline == "fast" and slow.ratio == 0.125 and slow.ratios == {"fast": 0.125}
    assert alone.baseline is None and alone.ratio is None and alone.ratios == {}


def test_row_and_registry_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="role"):
        Row("g", "c", "x", 1.0, role="winner")
    with pytest.raises(ValueError, match="seconds"):
        Row("g", "c", "x", 0.0)
    with pytest.raises(ValueError, match="case"):
        Row("g", "", "x", 1.0)
    with pytest.raises(ValueError, match="scenario name"):
        scenario("two words")
    load_scenarios()
    with pytest.raises(ValueError, match="registered twice"):
        scenario("fetch")(lambda ctx: [])


def test_rpc_baseline_names_a_tensorpipe_transport() -> None:
    from benchmarks.baselines import rpc_backend_options

    assert rpc_backend_options(12345, "uv").init_method == "tcp://127.0.0.1:12345"
    with pytest.raises(ValueError, match="transport"):
        rpc_backend_options(12345, "ibv")


def test_rss_sampler_sees_a_child_allocate() -> None:
    script = (
        "import sys, time; b = bytearray(200 << 20); b[::4096] = b'x' * len(b[::4096]); "
        "print('ready', flush=True); time.sleep(30)"
    )
    with RssSampler(interval_s=0.01) as sampler:
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        try:
            sampler.label(child.pid, "allocator")
            with sampler.window([child.pid]) as peaks:
                assert child.stdout.readline().strip() == "ready"
                time.sleep(0.5)
        finally:
            child.kill()
            child.wait(timeout=10)
    assert set(peaks) == {"allocator"}
    assert peaks["allocator"] >= 200 << 20


def _run_tool(tmp_path, module: str, *args: str) -> dict:  # type: ignore[no-untyped-def]
    """Run a benchmark tool (not a suite scenario) with `--json`; its exit must be 0; returns the JSON."""
    json_path = tmp_path / f"{module}.json"
    run_in_session([module, *args, "--json", str(json_path)], f"python -m {module}", timeout_s=120)
    return json.loads(json_path.read_text())


def test_cluster_reshard_benchmark_runs_small(tmp_path) -> None:
    """benchmarks.reshard_cluster (not a suite scenario) at 1 MiB: both cluster runs and the plain world report."""
    (row,) = _run_tool(
        tmp_path, "benchmarks.reshard_cluster", "--size-mib", "1", "--ranks", "2", "--repeats", "1"
    )["rows"]
    for key in ("bare_s", "run_reshard_s", "cluster_reshard_s", "cluster_reshard_no_recycling_s"):
        assert row[key] > 0, key
    assert row["world"] == 2 and row["max_new_shard_bytes"] == 512 * 256 * 4


def test_lookup_cpu_benchmark_runs_small(tmp_path) -> None:
    """benchmarks.lookup_cpu (not a suite scenario) on a small table: 1 and 8 threads, each figure measured."""
    report = _run_tool(
        tmp_path, "benchmarks.lookup_cpu", "--rows", "4096", "--ids", "16", "--calls", "5"
    )
    assert report["transport"] == "tcp" and [row["threads"] for row in report["results"]] == [1, 8]
    for row in report["results"]:
        assert row["wall_s"] > 0 and row["client_cpu_s"] > 0 and row["ranks_cpu_s"] >= 0
