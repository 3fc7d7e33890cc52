"""The benchmark suite as a smoke test, second half of the scenarios (the first, and what is checked, in
test_benchmarks_smoke.py); a module of its own so that another worker runs it meanwhile."""

from __future__ import annotations

import pytest
from benchmark_smoke import SECOND_HALF, check_scenario, scenario_rows

HALF = sorted(SECOND_HALF)
"""The scenarios this module's `runs` fixture runs, in one quick run."""


@pytest.mark.parametrize("name", HALF)
def test_scenario_runs_quick_with_machine_info_and_rows(runs, name: str) -> None:
    check_scenario(*runs(name), name)


def test_reshard_scenario_has_the_cluster_row_against_a_copy_of_the_bytes_moved(runs) -> None:
    """The 2-rank cluster reshard (tiny here): its data came back right, its limit is the in-process copy_ of
    half the tensor (rows -> columns between 2 ranks), and it carries its target and the load average."""
    rows = {
        r["name"]: r
        for r in scenario_rows(runs("reshard")[0], "reshard")
        if r["case"].startswith("2-rank cluster")
    }
    ours, copy = rows["shardserve cluster reshard"], rows["in-process column copies"]
    assert ours["ok"] is True and ours["baseline"] == copy["name"] and copy["role"] == "baseline"
    assert ours["nbytes"] == copy["nbytes"] > 0
    assert ours["target"]["text"] == ">= 0.50x (within 2x)"
    assert ours["target"]["met"] == (ours["ratio"] >= 0.5)
    assert "load average" in ours["note"]
