"""Reads under a rank's death on a real cluster: 8 reader processes look up and fetch a replicas=2 table while a
rank is SIGKILLed, restarted by the launcher and repaired; no read fails and every answer is the table, bit for bit.

The run is benchmarks.heal's (small here); its figures are printed (pytest -s) and asserted only as outcomes.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import heal

pytestmark = [
    pytest.mark.timeout(400),
    pytest.mark.slow,
]  # a cluster of its own, killed and repaired under load


def test_reads_never_fail_while_a_rank_dies_restarts_and_is_repaired():
    report = heal.run(
        rows=20_000,
        dim=32,
        readers=8,
        kill_at=4.0,
        after=3.0,
        bare_baseline=False,
        quiet_repair=False,
    )
    print(json.dumps(report.to_json(), indent=1))
    assert report.failed == [] and report.wrong == 0, report.failed[:5]
    healing = report.under_load
    assert (
        healing.detect_s is not None
        and healing.readmit_s is not None
        and healing.healthy_s is not None
    )
    assert report.restarts == 1
    assert healing.repair_bytes > 0  # the restarted rank's copies were rebuilt from the replicas
    assert all(report.phases[phase]["reads"] > 0 for phase in ("before", "during", "after")), (
        report.phases
    )
