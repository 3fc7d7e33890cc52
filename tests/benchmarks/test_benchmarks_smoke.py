"""The benchmark suite as a smoke test, first half: `python -m benchmarks --quick --only NAME...` of this half's
scenarios writes JSON of the agreed shape (checks in tests/benchmark_smoke.py; the other half of the scenarios in
test_benchmarks_smoke_second.py), and the harness's own pieces.

Never asserts a timing: only that every scenario ran, that rows carry the
fields the README and plots rely on, that the figures are consistent with each
other (GB/s = bytes / seconds, ratio = baseline seconds / seconds) and that
every method's result matched its source.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from benchmark_smoke import (
    FIRST_HALF,
    SCENARIOS,
    SECOND_HALF,
    check_scenario,
    run_in_session,
    scenario_rows,
)

from benchmarks.harness import Row, fill_ratios, load_scenarios, scenario
from benchmarks.rss import RssSampler

HALF = FIRST_HALF
"""The scenarios this module's `runs` fixture runs, in one quick run."""


def test_the_suite_has_the_issue_scenarios() -> None:
    assert {"fetch", "planning", "reshard"} <= set(SCENARIOS)


def test_the_halves_share_out_every_scenario() -> None:
    assert SECOND_HALF <= set(SCENARIOS) and sorted([*FIRST_HALF, *SECOND_HALF]) == SCENARIOS


@pytest.mark.parametrize("name", HALF)
def test_scenario_runs_quick_with_machine_info_and_rows(runs, name: str) -> None:
    check_scenario(*runs(name), name)


def test_fetch_rows_compare_shardserve_with_three_baselines(runs) -> None:
    doc, _, _ = runs("fetch")
    fetch = scenario_rows(doc, "fetch")
    cases = {r["case"] for r in fetch}
    assert cases
    for case in cases:
        rows = {r["name"]: r for r in fetch if r["case"] == case}
        assert {"raw TCP socket", "torch.distributed.rpc", "memcpy"} <= set(rows)
        ours = [r for r in fetch if r["case"] == case and r["role"] == "subject"]
        assert sorted(r["path"] for r in ours) == [
            "bulk",
            "bulk",
            "grpc",
            "grpc",
            "shm",
            "shm",
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
    rows = scenario_rows(runs("lookups")[0], "lookups")
    rpc_rows = [r for r in rows if r["name"] == "torch.distributed.rpc"]
    assert len(rpc_rows) == len({r["case"] for r in rows}) > 0  # one per case
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


def test_fanout_benchmark_runs_small(tmp_path) -> None:
    """benchmarks.fanout (not a suite scenario) past the kept call threads (40 ranks: the call loop) and within
    them (2 ranks): every figure measured, the load average beside it."""
    rows = _run_tool(
        tmp_path, "benchmarks.fanout", "--ranks", "40,2", "--processes", "2", "--repeats", "2"
    )["rows"]
    assert [row["ranks"] for row in rows] == [40, 2]
    for row in rows:
        assert row["caller_cpu_s"] > 0 and row["wall_s"] > 0 and row["servers_cpu_s"] >= 0
        assert len(row["load_average"]) == 3


def test_lookup_cpu_benchmark_runs_small(tmp_path) -> None:
    """benchmarks.lookup_cpu (not a suite scenario) on a small table: 1 and 8 threads, each figure measured."""
    report = _run_tool(
        tmp_path, "benchmarks.lookup_cpu", "--rows", "4096", "--ids", "16", "--calls", "5"
    )
    assert report["transport"] == "bulk" and [row["threads"] for row in report["results"]] == [1, 8]
    for row in report["results"]:
        assert row["wall_s"] > 0 and row["client_cpu_s"] > 0 and row["ranks_cpu_s"] >= 0


def test_scale_scenario_has_every_row_at_its_rank_count_with_the_data_read_back(runs) -> None:
    """The quick scale run (one small simulated cluster): a row per figure, each with its rank count, figure,
    unit and the coordinator's CPU where timed; the snapshot, the resharded and the repaired tables read back
    bit for bit (ok); the table of figures printed with the load average."""
    from benchmarks.scale import QUICK_RANKS, ROWS

    doc, _, stdout = runs("scale")
    rows = [r for r in scenario_rows(doc, "scale") if r["group"] == "scale"]
    assert {(r["extra"]["key"], r["extra"]["ranks"]) for r in rows} == {
        (key, n) for key, *_ in ROWS for n in QUICK_RANKS
    }
    for row in rows:
        assert row["ok"] is True and row["extra"]["value"] is not None, row
        if row["extra"]["unit"] == "s":
            assert row["seconds"] == row["extra"]["value"] > 0
    timed = {r["extra"]["key"]: r for r in rows if r["extra"]["coordinator_cpu_s"] is not None}
    assert {"register_cold", "snapshot_first", "snapshot_steady", "list", "status"} <= set(timed)
    assert "scale: the coordinator at N simulated ranks" in stdout
    assert "workloads: state dict 2,000 shards, tables 400 shards" in stdout
    assert "load average at the start of each N" in stdout
