"""Latency figures the standalone benchmark modules share: nearest-rank percentiles, p50/p99 in ms, JSON out."""

from __future__ import annotations

import json
import statistics


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank `q` quantile of `values` (nan when there are none)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def p50_p99_ms(values_ms: list[float]) -> dict[str, float]:
    """{"p50_ms": median, "p99_ms": nearest-rank p99} of latencies already in ms."""
    return {"p50_ms": statistics.median(values_ms), "p99_ms": percentile(values_ms, 0.99)}


def write_json(path: str | None, results: dict) -> None:
    """Write `results` as indented JSON to `path` (nothing when no path was asked for)."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
