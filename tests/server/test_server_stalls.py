"""Stalled clients cannot starve a rank: 64 readers that stop reading and 16 writers that stop sending, all real
gRPC streams, are bounded per principal, leave threads for a well-behaved client's lookups, and are cancelled
after --stall-timeout."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from server_helpers import TIMEOUT
from waiting import wait_until

from shardserve import connect
from shardserve.core.wire import metadata_to_proto
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.server.common.auth import Security
from shardserve.server.common.principals import PrincipalBook, token_sha256
from shardserve.server.common.rank_options import RankOptions
from shardserve.server.common.stream_limits import StreamLimitSettings

STALL_TIMEOUT = 3.0
ENDED_WITHIN = STALL_TIMEOUT + 20.0  # the watchdog's period and a loaded 2-core host on top
TOKENS = {"abuser": "abuser-token-123", "reader": "reader-token-123"}
NO_BDP = [
    ("grpc.http2.bdp_probe", 0),
    ("grpc.max_receive_message_length", 64 << 20),
]  # small windows: stalls bite


@pytest.fixture(scope="module")
def cluster(make_cluster, tmp_path_factory):
    path = tmp_path_factory.mktemp("tokens") / "tokens.toml"
    path.write_text(
        "".join(
            f'[[principal]]\nname = "{name}"\ntoken_sha256 = "{token_sha256(token)}"\n'
            f'role = "write"\n'
            for name, token in TOKENS.items()
        )
    )
    return make_cluster(
        ranks=1,
        security=Security(principals=PrincipalBook(str(path))),
        rank_options=RankOptions(stall_timeout=STALL_TIMEOUT),
    )


def bearer(name):
    return (("authorization", f"Bearer {TOKENS[name]}"),)


def lookup_latencies(client, table, count):
    seconds = []
    for i in range(count):
        ids = torch.tensor([i % 1000, (7 * i) % 1000, 999])
        start = time.perf_counter()
        rows = client.lookup({"table": ids})["table"]
        seconds.append(time.perf_counter() - start)
        assert torch.equal(rows, table[ids])
    seconds.sort()
    return seconds[len(seconds) // 2], seconds[int(len(seconds) * 0.99)]


def stalled_writes(stub, info, release):
    def requests():
        yield pb.WriteShardRequest(
            header=pb.WriteShardHeader(
                name=info.name, version=info.version, dtype=pb.FLOAT32, nbytes=4 << 20
            )
        )
        release.wait(120)  # sends nothing more: a writer that stopped

    return stub.WriteShard.future(requests(), timeout=120, metadata=bearer("abuser"))


def test_stalled_readers_and_writers_neither_starve_lookups_nor_live_on(cluster):
    table = torch.randn(1000, 64)
    big = torch.randn(4 << 20)  # 16 MiB: far over a stream's flow-control window
    with connect(cluster.address, token=TOKENS["reader"], transport="grpc") as reader:
        reader.put("table", table)
        served = reader.put("big", big)
        meta = reader.put("shape", torch.zeros(1 << 20)).metadata()  # 4 MiB, one shard
        coordinator = reader.session.channel.coordinator(cluster.address)
        pending = [
            coordinator.CreateTensor(
                pb.CreateTensorRequest(name=f"pending{i}", metadata=metadata_to_proto(meta)),
                timeout=TIMEOUT,
                metadata=bearer("abuser"),
            )
            for i in range(16)
        ]
        lookup_latencies(reader, table, 50)  # warm
        alone = lookup_latencies(reader, table, 300)

        rank = cluster.coordinator.registry.ranks()[0].address
        channel = grpc.insecure_channel(rank, options=NO_BDP)
        stub = pb_grpc.ShardServerStub(channel)
        release = threading.Event()
        writers = [stalled_writes(stub, info, release) for info in pending]
        whole = pb.ReadRegionRequest(
            name="big", version=served.version, shard_index=0, offsets=[0], sizes=[4 << 20]
        )
        readers = [
            stub.ReadRegion(whole, timeout=120, metadata=bearer("abuser")) for _ in range(64)
        ]
        admitted = StreamLimitSettings().per_principal - len(writers)
        began = time.monotonic()
        try:
            # every reader has reached the rank: all but the admitted ones are refused already (a late one could
            # otherwise take a slot the stalled streams freed, and run to its end once read below)
            wait_until(
                lambda: sum(call.done() for call in readers) >= len(readers) - admitted,
                ENDED_WITHIN,
                "the readers over the abuser's limit to be refused",
            )
            time.sleep(0.5)  # the stalled streams are in
            during = lookup_latencies(reader, table, 300)
            small = pb.ReadRegionRequest(
                name="big", version=served.version, shard_index=0, offsets=[0], sizes=[1024]
            )

            def abusers_slots_free_again() -> (
                bool
            ):  # every one of its streams runs: the stalled ones are gone
                probes = [
                    stub.ReadRegion(small, timeout=TIMEOUT, metadata=bearer("abuser"))
                    for _ in range(StreamLimitSettings().per_principal)
                ]
                return all(
                    _code(lambda probe=probe: list(probe)) == grpc.StatusCode.OK for probe in probes
                )

            wait_until(
                abusers_slots_free_again, ENDED_WITHIN, "the stalled streams to be cancelled"
            )
            freed_after = time.monotonic() - began
        finally:
            release.set()
        writer_codes = [_code(future.result) for future in writers]
        assert writer_codes == [grpc.StatusCode.CANCELLED] * 16, [
            _details(f.result) for f in writers[:2]
        ]
        reader_codes = [_code(lambda call=call: list(call)) for call in readers]
        assert set(reader_codes) == {grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert reader_codes.count(grpc.StatusCode.CANCELLED) == admitted
        print(
            f"\nlookup p50/p99 alone {alone[0] * 1e3:.2f}/{alone[1] * 1e3:.2f} ms, beside 64 stalled readers "
            f"and 16 stalled writers {during[0] * 1e3:.2f}/{during[1] * 1e3:.2f} ms; the stalled streams' "
            f"slots were free again after {freed_after:.1f}s (--stall-timeout {STALL_TIMEOUT}s)"
        )
        channel.close()


def _code(call):
    try:
        call()
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def _details(call):
    try:
        call()
    except grpc.RpcError as err:
        return err.details()
    return ""
