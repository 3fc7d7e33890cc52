"""The command line the state-dict side benchmarks share (statedict_casts, statedict_delta, statedict_verify):
the size flags, a 2-rank cluster of its own for the rows, and the rows printed."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from typing import Any

from benchmarks.harness import Row, coordinator_options

MiB = 1 << 20


def size_parser(description: str, *, quick_help: str) -> argparse.ArgumentParser:
    """A parser with --tensors, --each-mib and --quick (callers add their own flags)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--tensors", type=int, default=None, help="tensors in the state dict")
    parser.add_argument("--each-mib", type=float, default=None, help="MiB of fp32 per tensor")
    parser.add_argument("--quick", action="store_true", help=quick_help)
    return parser


def each_bytes(args: argparse.Namespace) -> int | None:
    """--each-mib in bytes (None: the rows' default)."""
    return int(args.each_mib * MiB) if args.each_mib else None


def run_on_two_ranks(make_rows: Callable[[Any], list[Row]], *, width: int = 48) -> None:
    """Start a 2-rank cluster, make the rows on it, stop it and print them."""
    from shardserve.server.launcher import LocalCluster

    with tempfile.TemporaryDirectory(prefix="shardserve-bench-") as state_dir:
        cluster = LocalCluster(
            2,
            state_dir=state_dir,
            coordinator_options=coordinator_options(),
            start_method="forkserver",
        ).start(timeout=120)
        try:
            rows = make_rows(cluster)
        finally:
            cluster.stop()
    for row in rows:
        print(f"{row.case:{width}} {row.name:24} {row.seconds * 1e3:9.1f} ms  ok={row.ok}")
