"""`python -m benchmarks [--quick] [--ranks N,N] [--shards N] [--json FILE] [--plots DIR] [--only NAME...]`: the suite.

Runs every registered scenario (see benchmarks.harness) with its baselines in
the same run, prints machine info and a table of absolute figures and ratios
per group, and optionally writes the JSON document and PNG plots. Exits 1 if
a scenario failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from benchmarks.harness import document, load_scenarios, run_scenarios
from benchmarks.machine import machine_info
from benchmarks.report import print_report
from benchmarks.scale import SHARDS, SHARDS_STEP


def rank_counts(text: str) -> tuple[int, ...]:
    """`--ranks 10,100`: positive rank counts, in the order given."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ranks {text!r} is not a list like 10,100") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--ranks {text!r}: every count must be >= 1")
    return counts


def shard_count(text: str) -> int:
    """`--shards 10000`: a positive count of whole tables (multiples of SHARDS_STEP)."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shards {text!r} is not a number") from None
    if count < SHARDS_STEP or count % SHARDS_STEP:
        raise argparse.ArgumentTypeError(f"--shards {count}: a positive multiple of {SHARDS_STEP}")
    return count


def parse_args(argv: list[str], names: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes and few repeats (a smoke test)"
    )
    parser.add_argument(
        "--ranks",
        type=rank_counts,
        metavar="N,N,...",
        help="rank counts for the scenarios that simulate ranks (scale; default 10,100,1000)",
    )
    parser.add_argument(
        "--shards",
        type=shard_count,
        metavar="N",
        help=f"shards of the scale scenario's state dict, and of its tables (default {SHARDS:,}; the same at "
        f"every rank count, so that the growth from one count to the next is the coordinator's)",
    )
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")
    parser.add_argument("--plots", metavar="DIR", help="write one PNG per scenario group into DIR")
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        choices=names,
        help=f"run only these scenarios (of: {', '.join(names)})",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    registry = load_scenarios()
    args = parse_args(argv, list(registry))
    selected = args.only or list(registry)
    machine = machine_info()
    rows, reports = run_scenarios(selected, args.quick, args.ranks, shards=args.shards)
    machine["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    print_report(rows, reports, machine)
    doc = document(rows, reports, args.quick, " ".join(["python -m benchmarks", *argv]), machine)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2))
    if args.plots:
        from benchmarks.plots import write_plots

        for path in write_plots(doc, Path(args.plots)):
            print(f"wrote {path}")
    return 0 if all(r["status"] == "ok" for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
