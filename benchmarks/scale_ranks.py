"""Simulated ranks for the scale harness: many real rank instances in one process, for the coordinator to serve.

Each instance is assembled as server/rank/main.py assembles a rank: a ShardStore (version table, leases,
memory budget), the ShardServer servicer on a gRPC server of its own, and a CoordinatorLink that registers and
heartbeats. What differs, so that a few processes on a small machine hold a thousand of them:

- every instance's gRPC server is a grpc.aio server on the process's one event loop, the real servicer called
  on it (benchmarks/scale_hosting.py; without the rank's server interceptors), a longer GIL switch interval
  for the process (SWITCH_INTERVAL_S), and no bulk port, metrics endpoint or persistence; CPU shards in
  private memory (the same-host path is off: its memfds would be one per shard);
- collective jobs run no collectives: the "reshard" kind writes each new local shard as the arange fill of its
  box (shard_fill.InitFill.ARANGE), which is what moving the data of an arange-filled tensor gives, then fills
  the reservation as the real job does. The calls (AllocateShards, RunCollective, PromoteVersion, DropVersion)
  are the real ones; the data moved is not.

The instances' process is driven over stdin/stdout, one line per command: `register` registers every instance
at once and answers `registered SECONDS`; `kill RANK` stops one instance as a crash would (its server and
heartbeats gone, nothing said to the coordinator) and answers `killed RANK`; `rss` answers `rss BYTES`; EOF
stops them all. It first prints `ready COUNT RSS_BEFORE RSS_AFTER` once every instance serves.

    python -m benchmarks.scale_ranks --coordinator HOST:PORT --secret-file F --world N --first A --count C
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from benchmarks.scale_hosting import AioHosting
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.common.auth import Security
from shardserve.server.common.heap import prepare_collector
from shardserve.server.common.principals import ClusterSecret
from shardserve.server.common.rank_options import RankOptions
from shardserve.server.common.requests import check_name, check_version, parse_metadata
from shardserve.server.rank.coordinator_link import CoordinatorLink
from shardserve.server.rank.coordinators import Coordinators
from shardserve.server.rank.jobs.context import JobContext
from shardserve.server.rank.jobs.service import JobKinds
from shardserve.server.rank.main import open_store
from shardserve.server.rank.reads.bulk import BulkReads
from shardserve.server.rank.service import ShardServerServicer, add_shard_server
from shardserve.server.rank.shard_fill import InitFill, make_shard

MEMORY_LIMIT = 64 << 20  # bytes each instance may hold (tiny shards)
RANKS_PER_HOST = 8  # instances that share a simulated host name (repairs prefer another host)
REGISTER_THREADS = 64
SWITCH_INTERVAL_S = 0.05
"""How long a thread of an instances' process holds the GIL before another may take it (Python's default is
5 ms). A fan-out wakes dozens of instances' threads of one process at once; at 5 ms they handed the GIL to each
other so often that half of the process's CPU went to futex waits (perf) and a steady commit at 1,000 ranks cost
the instances 12-19 s of CPU; at 50 ms, 7.5-11 s (a rank's handlers release the GIL within a millisecond or two
anyway)."""
REGISTER_TIMEOUT_S = 120.0

log = logging.getLogger(__name__)


def simulated_reshard(job: pb.CollectiveJob, ctx: JobContext) -> None:
    """A reshard job's part on a simulated rank: its new shards filled as the arange of their boxes (no data
    moved between ranks), the reservation filled as run_reshard_job fills it."""
    spec = job.reshard
    name = check_name(spec.name, "reshard.name")
    version = check_version(spec.dst_version, "reshard.dst_version")
    dst = parse_metadata(spec.dst, "reshard.dst")
    local = dst.shards_on(ctx.rank)
    shards = {i: make_shard(dst, i, InitFill.ARANGE, 0, ctx.store.device) for i in local}
    ctx.progress.bytes_total = ctx.progress.bytes_done = sum(dst.shard_nbytes(i) for i in local)
    if local:
        ctx.store.fill_reserved(name, version, shards)


def simulated_kinds() -> JobKinds:
    kinds = JobKinds()
    kinds.register("reshard", simulated_reshard)
    return kinds


@dataclass
class SimulatedRank:
    """One rank instance: its store, its gRPC server (on the process's loop) and its link to the coordinator."""

    rank: int
    server: Any
    link: CoordinatorLink
    hosting: AioHosting

    def stop(self) -> None:
        """Stop as a crash would: heartbeats and server gone at once, nothing told to the coordinator."""
        self.link.stop()
        self.hosting.stop(self.server)


def start_rank(
    rank: int, *, world: int, coordinator: str, security: Security, hosting: AioHosting
) -> SimulatedRank:
    """One rank instance serving on a free loopback port of the process's loop, not yet registered."""
    options = RankOptions(listen="127.0.0.1:0", bulk_reads=False, log_level="WARNING")
    store = open_store(options, rank, "cpu", memory_limit=MEMORY_LIMIT, persistence=None)
    bulk = BulkReads(store, None, off_reason="a simulated rank has no bulk port")
    servicer = ShardServerServicer(store, bulk_reads=bulk, kinds=simulated_kinds())
    server, port = hosting.serve(lambda server: add_shard_server(server, servicer))
    host = f"sim-host-{rank // RANKS_PER_HOST}"
    info = pb.RankInfo(
        rank=rank,
        address=f"127.0.0.1:{port}",
        device="cpu",
        hostname=host,
        memory_limit_bytes=MEMORY_LIMIT,
        memory_limit_source="the scale harness",
        world_size=world,
        pid=os.getpid(),
        host_id=host,
        shared_memory=False,
    )
    link = CoordinatorLink(Coordinators([coordinator], security), info, store)
    return SimulatedRank(rank, server, link, hosting)


def register_all(ranks: list[SimulatedRank]) -> float:
    """Register every instance at once (as ranks starting together do) and start their heartbeats; seconds."""
    start = time.perf_counter()
    with futures.ThreadPoolExecutor(REGISTER_THREADS) as pool:
        list(pool.map(lambda r: r.link.register(REGISTER_TIMEOUT_S), ranks))
    for r in ranks:
        r.link.start()
    return time.perf_counter() - start


def serve_commands(ranks: dict[int, SimulatedRank]) -> None:
    """Answer the harness's commands (module docstring) until EOF."""
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "register":
            print(f"registered {register_all(list(ranks.values())):.6f}", flush=True)
        elif command == "kill":
            ranks.pop(int(arg)).stop()
            print(f"killed {arg}", flush=True)
        elif command == "rss":
            print(f"rss {psutil.Process().memory_info().rss}", flush=True)
        elif command:
            print(f"error unknown command {command!r}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--secret-file", required=True, help="the coordinator's cluster secret")
    parser.add_argument("--world", type=int, required=True, help="ranks in the whole simulation")
    parser.add_argument("--first", type=int, required=True, help="the first rank of this process")
    parser.add_argument("--count", type=int, required=True, help="instances in this process")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    os.environ["SHARDSERVE_SHARED_MEMORY"] = "0"
    torch.set_num_threads(1)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    security = Security(cluster=ClusterSecret.from_file(args.secret_file))
    before = psutil.Process().memory_info().rss
    hosting = AioHosting()
    ranks = {
        rank: start_rank(
            rank, world=args.world, coordinator=args.coordinator, security=security, hosting=hosting
        )
        for rank in range(args.first, args.first + args.count)
    }
    prepare_collector("simulated ranks")  # as a rank does once serving (server/common/heap.py)
    print(f"ready {len(ranks)} {before} {psutil.Process().memory_info().rss}", flush=True)
    try:
        serve_commands(ranks)
    finally:
        with futures.ThreadPoolExecutor(
            REGISTER_THREADS
        ) as pool:  # a heartbeat may be in flight in each
            list(pool.map(SimulatedRank.stop, ranks.values()))
        hosting.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
