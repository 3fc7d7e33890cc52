"""Benchmark targets (reported beside a row, never asserted) and the GPU check's one summary table."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from benchmarks.harness import Row, Target, document, failure_row, fill_ratios
from benchmarks.summary import pytest_counts, summary_table

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="2" tests="5">
<testcase classname="tests.test_x" name="test_ok"/><testcase classname="tests.test_x" name="test_bad">
<failure message="boom"/></testcase></testsuite></testsuites>
"""


def test_a_target_is_a_least_ratio_or_a_most_seconds() -> None:
    within = Target(min_ratio=1 / 3)
    assert (
        within.text == ">= 0.33x (within 3x)" and within.met(1.0, 0.5) and not within.met(1.0, 0.2)
    )
    assert Target(min_ratio=0.7).text == ">= 0.70x"
    fast = Target(max_seconds=0.010)
    assert fast.text == "<= 10 ms" and fast.met(0.009, None) and not fast.met(0.011, 9.0)
    assert fast.met(None, None) is None and within.met(1.0, None) is None
    for bad in ({}, {"min_ratio": 1.0, "max_seconds": 1.0}, {"min_ratio": 0.0}):
        with pytest.raises(ValueError, match="target"):
            Target(**bad)


def sample_rows() -> list[Row]:
    rows = [
        Row("g", "1 GiB", "put", 0.2, baseline="copy", target=Target(min_ratio=0.7)),
        Row("g", "1 GiB", "copy", 0.1, role="baseline"),
        failure_row(
            "g",
            "2 ranks",
            "reshard",
            RuntimeError("NCCL error: invalid usage\nmore"),
            target=Target(min_ratio=0.5),
        ),
    ]
    fill_ratios(rows)
    return rows


def test_rows_carry_their_target_into_json_and_a_failure_its_first_line() -> None:
    put, _, failed = (row.to_json() for row in sample_rows())
    assert put["target"] == {
        "min_ratio": 0.7,
        "max_seconds": None,
        "text": ">= 0.70x",
        "met": False,
    }
    assert failed["seconds"] is None and failed["target"]["met"] is None
    assert failed["note"] == "failed: RuntimeError: NCCL error: invalid usage"


def test_summary_table_holds_the_tests_and_every_measured_row(tmp_path: Path) -> None:
    junit, bench = tmp_path / "tests.xml", tmp_path / "bench.json"
    junit.write_text(JUNIT)
    report = {"name": "cuda", "status": "ok", "error": None, "wall_seconds": 1.0, "rows": 3}
    bench.write_text(json.dumps(document(sample_rows(), [report], False, "python -m benchmarks")))
    assert pytest_counts(junit) == {
        "tests": 5,
        "failures": 1,
        "errors": 0,
        "skipped": 2,
        "passed": 2,
    }
    table, lines = summary_table(junit, 1, bench, 0)
    out = Console(file=io.StringIO(), width=240)
    out.print(table)
    text = out.file.getvalue()
    assert lines and "load" in lines[0]
    assert "2 passed, 1 failures, 0 errors, 2 skipped" in text
    assert "FAILED (exit 1): tests.test_x::test_bad" in text
    assert "copy 100.00 ms" in text and "0.50x" in text and ">= 0.70x" in text and "NOT met" in text
    assert "failed: RuntimeError: NCCL error: invalid usage" in text


def test_summary_says_when_a_stage_left_no_file(tmp_path: Path) -> None:
    table, lines = summary_table(tmp_path / "none.xml", 124, tmp_path / "none.json", 137)
    out = Console(file=io.StringIO(), width=240)
    out.print(table)
    text = out.file.getvalue()
    assert lines == [] and "no JUnit XML" in text and "no JSON" in text
    assert "TIMED OUT (exit 124)" in text and "TIMED OUT (exit 137)" in text
