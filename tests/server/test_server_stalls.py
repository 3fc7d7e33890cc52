"""Stalled clients cannot starve a rank: 64 readers that stop reading and 16 writers that stop sending, all real
gRPC streams, are bounded per principal, leave threads for a well-behaved client's lookups, and are cancelled
after --stall-timeout.

The streams keep moving (a chunk read or sent every MOVE_EVERY_S) until every reader over the limit has been
refused, and only then stall: a stream cancelled for a stall frees a slot, and a reader still waiting for one
(up to the limits' admit_wait) would take it, so stalls must not begin before the refusals are done. The
writers stall under a principal of their own, so that no reader can take a slot a writer needs."""

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
TOKENS = {
    "abuser": "abuser-token-123",  # the stalled readers
    "abuser-writes": "abuser-writes-token-123",  # the stalled writers
    "reader": "reader-token-123",  # the well-behaved client
}
WRITERS, READERS = 16, 64
# the abuser's readers and writers together hold the default streams of one principal
MAX_STREAMS = {"abuser-writes": WRITERS, "abuser": StreamLimitSettings().per_principal - WRITERS}
MOVE_EVERY_S = 0.3  # well within STALL_TIMEOUT: a moving stream is never taken for stalled
CHUNK_BYTES = (
    64 << 10
)  # a reader's chunks: 256 of them in the 16 MiB, far more than it reads while moving
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
            + (f"max_streams = {MAX_STREAMS[name]}\n" if name in MAX_STREAMS else "")
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


def stalled_writes(stub, info, moving, release):
    """A writer that sends a few bytes every MOVE_EVERY_S while `moving` is set, then nothing until `release`."""

    def requests():
        yield pb.WriteShardRequest(
            header=pb.WriteShardHeader(
                name=info.name, version=info.version, dtype=pb.FLOAT32, nbytes=4 << 20
            )
        )
        offset = 0
        while moving.wait(0) and not release.wait(MOVE_EVERY_S):
            yield pb.WriteShardRequest(chunk=pb.TensorChunk(offset=offset, data=bytes(4)))
            offset += 4
        release.wait(120)  # sends nothing more: a writer that stopped

    return stub.WriteShard.future(requests(), timeout=120, metadata=bearer("abuser-writes"))


def read_while_moving(call, moving):
    """Read a chunk of `call` every MOVE_EVERY_S while `moving` is set, then stop reading (a refused call ends
    this at once)."""
    try:
        while moving.is_set():
            next(call)
            time.sleep(MOVE_EVERY_S)
    except (grpc.RpcError, StopIteration):
        pass


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
                metadata=bearer("abuser-writes"),
            )
            for i in range(WRITERS)
        ]
        lookup_latencies(reader, table, 50)  # warm
        alone = lookup_latencies(reader, table, 300)

        rank = cluster.coordinator.registry.ranks()[0].address
        channel = grpc.insecure_channel(rank, options=NO_BDP)
        stub = pb_grpc.ShardServerStub(channel)
        moving, release = threading.Event(), threading.Event()
        moving.set()
        writers = [stalled_writes(stub, info, moving, release) for info in pending]
        whole = pb.ReadRegionRequest(
            name="big",
            version=served.version,
            shard_index=0,
            offsets=[0],
            sizes=[4 << 20],
            chunk_bytes=CHUNK_BYTES,
        )
        readers = [
            stub.ReadRegion(whole, timeout=120, metadata=bearer("abuser")) for _ in range(READERS)
        ]
        reading = [
            threading.Thread(target=read_while_moving, args=(call, moving)) for call in readers
        ]
        for thread in reading:
            thread.start()
        admitted = MAX_STREAMS["abuser"]
        try:
            # every reader over the abuser's limit is refused (those that waited for a slot too) while the
            # admitted streams move: no slot is freed before
            wait_until(
                lambda: sum(call.done() for call in readers) >= len(readers) - admitted,
                ENDED_WITHIN,
                "the readers over the abuser's limit to be refused",
            )
            moving.clear()  # from now on the admitted readers and the writers are stalled
            for thread in reading:
                thread.join()
            began = time.monotonic()
            during = lookup_latencies(reader, table, 300)
            small = pb.ReadRegionRequest(
                name="big", version=served.version, shard_index=0, offsets=[0], sizes=[1024]
            )

            def abusers_slots_free_again() -> bool:
                """Every stream the abuser may hold runs: its stalled ones are gone."""
                probes = [
                    stub.ReadRegion(small, timeout=TIMEOUT, metadata=bearer("abuser"))
                    for _ in range(admitted)
                ]
                return all(
                    _code(lambda probe=probe: list(probe)) == grpc.StatusCode.OK for probe in probes
                )

            wait_until(
                lambda: all(future.done() for future in writers) and abusers_slots_free_again(),
                ENDED_WITHIN,
                "the stalled streams to be cancelled",
            )
            freed_after = time.monotonic() - began
        finally:
            moving.clear()
            release.set()
        writer_codes = [_code(future.result) for future in writers]
        assert writer_codes == [grpc.StatusCode.CANCELLED] * WRITERS, [
            _details(f.result) for f in writers[:2]
        ]
        reader_codes = [_code(lambda call=call: list(call)) for call in readers]
        assert set(reader_codes) == {grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert reader_codes.count(grpc.StatusCode.CANCELLED) == admitted
        print(
            f"\nlookup p50/p99 alone {alone[0] * 1e3:.2f}/{alone[1] * 1e3:.2f} ms, beside 64 stalled readers "
            f"and 16 stalled writers {during[0] * 1e3:.2f}/{during[1] * 1e3:.2f} ms; the stalled streams' "
            f"slots were free again {freed_after:.1f}s after they stalled (--stall-timeout {STALL_TIMEOUT}s)"
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
