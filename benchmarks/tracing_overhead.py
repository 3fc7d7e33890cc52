"""Tracing on against off: a lookup's p50/p99 on two identical clusters, in the same run.

One 2-rank cluster runs with `--tracing file:DIR` (every RPC a span on the
client and on the rank, each written as one JSON line as it ends), the other
without; a client with tracing on (its spans written the same way) reads the
first, a client with tracing off the second; the clusters take turns each
round. Lookups of 64 ids over gRPC (the only path tracing sees) and a 4 MiB
fetch over gRPC.

    python -m benchmarks.tracing_overhead [--rounds 300] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import torch

from benchmarks.latency import p50_p99_ms, write_json
from benchmarks.metrics_overhead import measure

ROWS, COLUMNS = 65536, 256  # float32: 64 MiB
FETCH_ROWS = 4096  # 4 MiB


def client_provider(folder: Path):  # type: ignore[no-untyped-def]
    """A tracer provider writing client spans as JSON lines under `folder`, in batches, as the servers do."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    out = open(folder / "client.jsonl", "a", buffering=1)
    provider = TracerProvider()
    provider.add_span_processor(
        BatchSpanProcessor(
            ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n"),
            schedule_delay_millis=200,
        )
    )
    return provider


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.tracing_overhead", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rounds", type=int, default=300, help="lookups per cluster")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")

    from shardserve import connect
    from shardserve.server.common.rank_options import RankOptions
    from shardserve.server.launcher import LocalCluster

    table = torch.randn(ROWS, COLUMNS)
    ids = torch.randint(0, ROWS, (64,), generator=torch.Generator().manual_seed(0))
    results = {}
    with ExitStack() as stack:
        spans = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        clusters = {}
        for mode in (
            "off",
            "on",
        ):  # off first: the coordinator of "on" turns tracing on in this process
            state = stack.enter_context(tempfile.TemporaryDirectory())
            clusters[mode] = stack.enter_context(
                LocalCluster(
                    ranks=2,
                    state_dir=state,
                    rank_options=RankOptions(
                        log_level="WARNING", tracing=f"file:{spans}" if mode == "on" else None
                    ),
                    start_method="forkserver",
                )
            )
            with connect(clusters[mode].address, tracing=False) as writer:
                writer.put("overhead", table)
        tracing = {"on": client_provider(spans), "off": False}
        clients = {
            mode: stack.enter_context(connect(c.address, transport="grpc", tracing=tracing[mode]))
            for mode, c in clusters.items()
        }
        tensors = {mode: client.tensor("overhead") for mode, client in clients.items()}
        cases = {
            "lookup 64 ids": (lambda t: t.lookup(ids), args.rounds),
            "fetch 4 MiB": (
                lambda t: t.fetch((0, 0), (FETCH_ROWS, COLUMNS)),
                max(1, args.rounds // 10),
            ),
        }
        for what, (read, rounds) in cases.items():
            measure(read, max(1, rounds // 10), tensors)  # warm up both
            for mode, values in measure(read, rounds, tensors).items():
                key = f"grpc {what} tracing {mode}"
                results[key] = p50_p99_ms(values)
                print(
                    f"{key:34s} p50 {results[key]['p50_ms']:9.3f} ms  p99 {results[key]['p99_ms']:9.3f} ms",
                    flush=True,
                )
        results["spans written"] = sum(
            len(p.read_text().splitlines()) for p in spans.glob("*.jsonl")
        )
        print(f"spans written: {results['spans written']}", flush=True)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
