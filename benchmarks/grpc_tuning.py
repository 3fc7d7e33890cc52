"""gRPC read path tuning: chunk size and parallel streams per shard, for one 64 MiB box.

Reads the same box of a 1-rank cluster over ShardServer.ReadRegion with
chunk_bytes 256 KiB / 1 MiB / 4 MiB / 16 MiB, then split into 1, 2 and 4 row
bands read in parallel (one stream each), and prints the median seconds and
GB/s of each, plus a memcpy of the same bytes and the client-side copy of the
received chunks alone (what one extra copy costs). The figures chose the
defaults in server/rank/service.py and client/paths/grpc.py.

    python -m benchmarks.grpc_tuning [--mib 64] [--repeat 7] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

import torch

from benchmarks.baselines import median_seconds

COLUMNS = 4096


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.grpc_tuning", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    from shardserve import connect
    from shardserve.client.paths.kinds import PathKind
    from shardserve.core.specs import ChunkShardingSpec
    from shardserve.core.wire import byte_view
    from shardserve.protos import shardserve_pb2 as pb
    from shardserve.server.common.rank_options import RankOptions
    from shardserve.server.launcher import LocalCluster

    rows = (args.mib << 20) // (COLUMNS * 4)
    source = torch.randn(rows, COLUMNS)
    out = torch.empty_like(source)
    nbytes = source.numel() * 4
    results = []
    with tempfile.TemporaryDirectory(prefix="shardserve-tuning-") as state:
        cluster = LocalCluster(
            ranks=1,
            state_dir=state,
            rank_options=RankOptions(log_level="WARNING"),
            start_method="forkserver",
        ).start(timeout=180)
        try:
            with connect(cluster.address, timeout=120, transport="grpc") as c:
                c.put("tune", source, ChunkShardingSpec(0, ["rank:0/cpu"]))
                session, address = c.session, c.session.address_of(0)

                def read(band_rows: int, chunk: int) -> None:
                    def one(start: int) -> None:
                        n = min(band_rows, rows - start)
                        request = pb.ReadRegionRequest(
                            name="tune",
                            version=1,
                            shard_index=0,
                            offsets=(start, 0),
                            sizes=(n, COLUMNS),
                            chunk_bytes=chunk,
                        )
                        session.paths.path(PathKind.GRPC).read_stream(
                            address, request, byte_view(out[start : start + n])
                        )

                    session.run_all([lambda s=s: one(s) for s in range(0, rows, band_rows)])

                for chunk in (256 << 10, 1 << 20, 4 << 20, 16 << 20):
                    seconds = median_seconds(lambda: read(rows, chunk), args.repeat)
                    results.append(
                        {"method": f"1 stream, chunk {chunk >> 10} KiB", "seconds": seconds}
                    )
                for streams in (2, 4):
                    for chunk in (1 << 20, 4 << 20):
                        seconds = median_seconds(
                            lambda: read(-(-rows // streams), chunk), args.repeat
                        )
                        results.append(
                            {
                                "method": f"{streams} streams, chunk {chunk >> 10} KiB",
                                "seconds": seconds,
                            }
                        )
                assert torch.equal(out, source)
        finally:
            cluster.stop()
    chunks = [bytes(1 << 20) for _ in range(nbytes >> 20)]
    flat = byte_view(out).numpy()

    def copy_chunks() -> None:
        for i, chunk in enumerate(chunks):
            flat[i << 20 : (i + 1) << 20] = memoryview(chunk)

    results.append(
        {
            "method": "client copy of 1 MiB chunks alone",
            "seconds": median_seconds(copy_chunks, args.repeat),
        }
    )
    results.append(
        {"method": "memcpy", "seconds": median_seconds(lambda: out.copy_(source), args.repeat)}
    )
    print(f"{'method':<40} {'ms':>9} {'GB/s':>7}")
    for r in results:
        r["gb_per_s"] = nbytes / r["seconds"] / 1e9
        print(f"{r['method']:<40} {r['seconds'] * 1e3:>9.2f} {r['gb_per_s']:>7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mib": args.mib, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
