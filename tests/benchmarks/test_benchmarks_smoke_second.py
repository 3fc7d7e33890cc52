"""The benchmark suite as a smoke test, second half of the scenarios (the first, and what is checked, in
test_benchmarks_smoke.py); a module of its own so that another worker runs it meanwhile."""

from __future__ import annotations

import pytest
from benchmark_smoke import SCENARIOS, check_scenario


@pytest.mark.parametrize("name", SCENARIOS[1::2])
def test_scenario_runs_quick_with_machine_info_and_rows(runs, name: str) -> None:
    check_scenario(*runs(name), name)
