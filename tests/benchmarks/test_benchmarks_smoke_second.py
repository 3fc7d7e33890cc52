"""The benchmark suite as a smoke test, second half of the scenarios (the first, and what is checked, in
test_benchmarks_smoke.py); a module of its own so that another worker runs it meanwhile."""

from __future__ import annotations

import pytest
from benchmark_smoke import SCENARIOS, check_scenario


@pytest.mark.parametrize("name", SCENARIOS[1::2])
def test_scenario_runs_quick_with_machine_info_and_rows(runs, name: str) -> None:
    check_scenario(*runs(name), name)


def test_reshard_scenario_has_the_cluster_row_against_a_copy_of_the_bytes_moved(runs) -> None:
    """The 2-rank cluster reshard (tiny here): its data came back right, its limit is the in-process copy_ of
    half the tensor (rows -> columns between 2 ranks), and it carries its target and the load average."""
    doc, _, _ = runs("reshard")
    rows = {r["name"]: r for r in doc["rows"] if r["case"].startswith("2-rank cluster")}
    ours, copy = rows["shardserve cluster reshard"], rows["in-process column copies"]
    assert ours["ok"] is True and ours["baseline"] == copy["name"] and copy["role"] == "baseline"
    assert ours["nbytes"] == copy["nbytes"] > 0
    assert ours["target"]["text"] == ">= 0.50x (within 2x)"
    assert ours["target"]["met"] == (ours["ratio"] >= 0.5)
    assert "load average" in ours["note"]


def test_scale_scenario_has_every_row_at_its_rank_count_with_the_data_read_back(runs) -> None:
    """The quick scale run (one small simulated cluster): a row per figure, each with its rank count, figure,
    unit and the coordinator's CPU where timed; the snapshot, the resharded and the repaired tables read back
    bit for bit (ok); the table of figures printed with the load average."""
    from benchmarks.scale import QUICK_RANKS, ROWS

    doc, _, stdout = runs("scale")
    rows = [r for r in doc["rows"] if r["group"] == "scale"]
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
    assert "load average at the start of each N" in stdout
