"""The coordinator's cost of one fan-out to N ranks: `RankCalls.promote_many` (the real registry and fan-out)
to N loopback servers spread over a few processes, each answering PromoteMany at once.

It measures the caller's CPU and wall time per fan-out and the servers' CPU, median of `--repeats`, and prints
the load average beside them. A fan-out to more ranks than the coordinator keeps call threads for (32) runs on
its call loop (grpc.aio); fewer run as blocking calls on kept threads. The servers are plain gRPC servers, not
rank services, so the figures are the fan-out's own: what the coordinator pays per rank a commit calls.

    python -m benchmarks.fanout [--ranks 100,1000] [--processes 8] [--repeats 10] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import statistics
import time
from concurrent import futures
from multiprocessing.queues import Queue

import grpc
import psutil

from shardserve.protos import shardserve_pb2 as pb

SERVICE = "shardserve.v1.ShardServer"
VERSIONS_PER_RANK = 2  # each rank promotes two tensors, as a rank of a state dict's snapshot does
WARMUP = 3  # fan-outs before timing: channels made, connections open
START_TIMEOUT_S = 120.0


def _promoted(
    request: pb.PromoteManyRequest, _context: grpc.ServicerContext
) -> pb.PromoteManyResponse:
    return pb.PromoteManyResponse(
        checksums=[
            pb.ShardChecksum(name=v.name, version=v.version, shard_index=0, checksum=7)
            for v in request.versions
        ]
    )


def _serve(count: int, bound: Queue) -> None:
    """Serve PromoteMany on `count` loopback ports the system picks (a server of 2 threads each), put the ports
    on `bound`, and serve until killed (picking a port free in the parent and binding it here raced other
    processes for it: a server that failed to bind left the tool waiting)."""
    handler = grpc.unary_unary_rpc_method_handler(
        _promoted,
        request_deserializer=pb.PromoteManyRequest.FromString,
        response_serializer=pb.PromoteManyResponse.SerializeToString,
    )
    servers, ports = [], []
    for _ in range(count):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"PromoteMany": handler}),)
        )
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        server.start()
        servers.append(server)
    bound.put(ports)
    servers[0].wait_for_termination()


def _cpu_seconds(processes: list[multiprocessing.Process]) -> float:
    total = 0.0
    for process in processes:
        times = psutil.Process(process.pid).cpu_times()
        total += times.user + times.system
    return total


def measure(ranks: int, *, processes: int, repeats: int) -> dict:
    """One row: the median caller CPU, wall and servers' CPU of `repeats` fan-outs to `ranks` ranks."""
    from shardserve.server.coordinator.ranks.calls import RankCalls
    from shardserve.server.coordinator.ranks.heartbeats import HeartbeatPolicy
    from shardserve.server.coordinator.ranks.info import RankInfo
    from shardserve.server.coordinator.ranks.registry import RankRegistry

    context = multiprocessing.get_context("spawn")
    bound: Queue = context.Queue()
    servers = []
    for first in range(min(processes, ranks)):
        count = len(range(first, ranks, processes))
        server = context.Process(target=_serve, args=(count, bound), daemon=True)
        server.start()
        servers.append(server)
    registry = RankRegistry(heartbeats=HeartbeatPolicy(dead_after=3600.0))
    calls = RankCalls(registry, rpc_timeout=60.0)
    try:
        ports: list[int] = []
        for _ in servers:
            try:
                ports += bound.get(timeout=START_TIMEOUT_S)
            except queue.Empty:
                raise RuntimeError("a server process did not start") from None
        for rank, port in enumerate(ports):
            registry.register(
                RankInfo(
                    rank=rank, address=f"127.0.0.1:{port}", device="cpu", world_size=ranks, pid=rank
                ),
                [],
            )
        versions = {
            rank: [(f"t{rank % 100}.{k}", 5) for k in range(VERSIONS_PER_RANK)]
            for rank in range(ranks)
        }
        for _ in range(WARMUP):
            calls.promote_many(versions, "warm-up")
        cpu, wall, served = [], [], []
        for _ in range(repeats):
            servers_before, start, cpu_before = (
                _cpu_seconds(servers),
                time.perf_counter(),
                time.process_time(),
            )
            calls.promote_many(versions, "fan-out")
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_before)
            served.append(_cpu_seconds(servers) - servers_before)
    finally:
        calls.close()
        registry.close()
        for server in servers:
            server.kill()
            server.join()
    return {
        "ranks": ranks,
        "caller_cpu_s": statistics.median(cpu),
        "wall_s": statistics.median(wall),
        "servers_cpu_s": statistics.median(served),
        "load_average": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ranks", default="100,1000", help="comma-separated rank counts (default 100,1000)"
    )
    parser.add_argument("--processes", type=int, default=8, help="server processes (default 8)")
    parser.add_argument(
        "--repeats", type=int, default=10, help="timed fan-outs per rank count (default 10)"
    )
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    counts = [int(n) for n in args.ranks.split(",")]
    if any(n < 1 for n in counts) or args.processes < 1 or args.repeats < 1:
        parser.error("--ranks, --processes and --repeats must be positive")
    rows = []
    print(f"load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for count in counts:
        row = measure(count, processes=args.processes, repeats=args.repeats)
        rows.append(row)
        print(
            f"N={count}: caller CPU {row['caller_cpu_s'] * 1e3:.1f} ms, wall {row['wall_s'] * 1e3:.1f} ms, "
            f"servers' CPU {row['servers_cpu_s'] * 1e3:.1f} ms per fan-out (median of {args.repeats}); "
            f"load {row['load_average'][0]:.2f}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
