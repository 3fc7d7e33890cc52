"""WriteShards on one rank (server/rank/writes/): batches inline, from a same-host memfd and on the bulk port.

A real ShardStore, the servicer called in-process, and a real bulk port on
127.0.0.1 spoken to with plain sockets: every shard bit for bit, every bad
field named, the memfd checks refusing what is not the writer's staging file,
the bulk port keeping the connection in step after a refused batch, and the
ticket's principal deciding what its connection may write.
"""

from __future__ import annotations

import os
import socket
import struct
import tempfile
import time

import grpc
import pytest
import torch
from server_helpers import Aborted, ServicerContext, recv_exactly

from shardserve.client.paths.staging import StagingFile
from shardserve.client.paths.writes import shard_write, write_request
from shardserve.core.metadata import TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.core.wire import tensor_bytes
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.bulk_wire import HEADER, KIND_READ, KIND_WRITE
from shardserve.protos.same_host import host_id
from shardserve.server.common.principals import READ, WRITE, Principal
from shardserve.server.rank.errors import WriteIncomplete
from shardserve.server.rank.reads.bulk import BulkReads
from shardserve.server.rank.store import ShardStore
from shardserve.server.rank.writes.batch import ShardWrites

TIMEOUT_S = 10.0
SOURCES = {
    "a": torch.arange(24, dtype=torch.float32).reshape(6, 4),
    "b": torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16),
    "c": torch.tensor([True, False, True, True, False]),
    "d": torch.tensor([1 + 2j, -3j], dtype=torch.complex64),
}


def new_store(shared_memory: bool = True) -> ShardStore:
    store = ShardStore(0, shared_memory=shared_memory)
    for name, source in SOURCES.items():
        meta = ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata(
            tuple(source.shape), TensorProperties(dtype=source.dtype)
        )
        store.allocate(name, 1, meta)
    return store


@pytest.fixture
def store() -> ShardStore:
    return new_store()


def writes(names=tuple(SOURCES)) -> list:
    return [shard_write(name, 1, 0, SOURCES[name]) for name in names]


def inline(batch) -> pb.WriteShardsRequest:
    request = write_request(batch)
    request.data = b"".join(tensor_bytes(w.data) for w in batch)
    return request


def assert_written(store: ShardStore, names=tuple(SOURCES)) -> None:
    for name in names:
        store.promote(name, 1)
        assert torch.equal(store.local_tensor(name, 1, 0), SOURCES[name]), name


def refused(store: ShardStore, request: pb.WriteShardsRequest) -> Aborted:
    with pytest.raises(Aborted) as caught:
        ShardWrites(store).WriteShards(request, ServicerContext())
    return caught.value


def test_an_inline_batch_writes_every_shard_bit_for_bit(store):
    reply = ShardWrites(store).WriteShards(inline(writes()), ServicerContext())
    assert reply.bytes_written == sum(s.numel() * s.element_size() for s in SOURCES.values())
    assert_written(store)


def test_a_staging_memfd_is_read_bit_for_bit(store):
    batch = writes()
    with StagingFile(
        sum(w.nbytes for w in batch) + 64
    ) as staging:  # a kept file may be larger than its batch
        staging.pack(batch)
        request = write_request(batch)
        request.shared.CopyFrom(staging.source(host_id()))
        ShardWrites(store).WriteShards(request, ServicerContext())
    assert_written(store)


def test_a_strided_source_is_packed_as_its_box():
    wide = torch.arange(48, dtype=torch.int16).reshape(6, 8)
    view = wide[:, 2:6]  # not contiguous
    write = shard_write("v", 1, 0, view)
    with StagingFile(write.nbytes) as staging:
        staging.pack([write])
        fd = os.open(f"/proc/self/fd/{staging.source('').fd}", os.O_RDONLY)
        try:
            packed = os.pread(fd, write.nbytes, 0)
        finally:
            os.close(fd)
    assert packed == bytes(tensor_bytes(view.contiguous()))


@pytest.mark.parametrize(
    "change, code, field",
    [
        (
            lambda s: s.__setattr__("host_id", "another-host"),
            grpc.StatusCode.UNIMPLEMENTED,
            "shared.host_id",
        ),
        (
            lambda s: s.__setattr__("name_secret", "short"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "shared.name_secret",
        ),
        (
            lambda s: s.__setattr__("name_secret", "x" * 32),
            grpc.StatusCode.PERMISSION_DENIED,
            "not the staging memfd",
        ),
        (
            lambda s: s.__setattr__("inode", s.inode + 1),
            grpc.StatusCode.PERMISSION_DENIED,
            "not the staging memfd",
        ),
        (lambda s: s.__setattr__("nbytes", 3), grpc.StatusCode.INVALID_ARGUMENT, "shared.nbytes"),
        (
            lambda s: s.__setattr__("nbytes", s.nbytes + 8),
            grpc.StatusCode.INVALID_ARGUMENT,
            "shared.nbytes",
        ),
        (lambda s: s.__setattr__("fd", 1 << 20), grpc.StatusCode.UNIMPLEMENTED, "cannot open fd"),
        (lambda s: s.__setattr__("pid", 1 << 22), grpc.StatusCode.UNIMPLEMENTED, "cannot open fd"),
    ],
)
def test_a_memfd_that_is_not_as_described_is_refused(store, change, code, field):
    batch = writes()
    with StagingFile(sum(w.nbytes for w in batch)) as staging:
        staging.pack(batch)
        request = write_request(batch)
        request.shared.CopyFrom(staging.source(host_id()))
        change(request.shared)
        err = refused(store, request)
    assert err.code == code and field in err.details, err
    assert (
        ShardWrites(store).WriteShards(inline(writes()), ServicerContext()).bytes_written
    )  # still serving


def test_another_file_of_the_writer_is_not_read(store):
    """A writer naming any other file it has open (here a regular file with the right inode) is refused: the rank
    reads only memfds named with the request's secret."""
    batch = writes(["a"])
    with tempfile.TemporaryFile() as other:
        other.write(bytes(tensor_bytes(SOURCES["a"])))
        other.flush()
        info = os.fstat(other.fileno())
        request = write_request(batch)
        request.shared.CopyFrom(
            pb.SharedMemorySource(
                pid=os.getpid(),
                fd=other.fileno(),
                inode=info.st_ino,
                device_id=info.st_dev,
                nbytes=info.st_size,
                host_id=host_id(),
                name_secret="s" * 32,
            )
        )
        err = refused(store, request)
    assert err.code == grpc.StatusCode.PERMISSION_DENIED, err


def test_a_rank_without_shared_memory_refuses_memfds_as_unimplemented():
    store = new_store(shared_memory=False)
    batch = writes()
    with StagingFile(sum(w.nbytes for w in batch)) as staging:
        staging.pack(batch)
        request = write_request(batch)
        request.shared.CopyFrom(staging.source(host_id()))
        err = refused(store, request)
    assert err.code == grpc.StatusCode.UNIMPLEMENTED and "does not use shared memory" in err.details


def header(source="a", **changes) -> pb.WriteShardHeader:
    base = shard_write(source, 1, 0, SOURCES[source]).header
    for key, value in changes.items():
        setattr(base, key, value)
    return base


@pytest.mark.parametrize(
    "headers, data, code, field",
    [
        ([], b"", grpc.StatusCode.INVALID_ARGUMENT, "shards"),
        (
            [header(), header("b", name="")],
            None,
            grpc.StatusCode.INVALID_ARGUMENT,
            "shards[1].name",
        ),
        (
            [header(), header("b", version=0)],
            None,
            grpc.StatusCode.INVALID_ARGUMENT,
            "shards[1].version",
        ),
        ([header(dtype=999)], None, grpc.StatusCode.INVALID_ARGUMENT, "shards[0].dtype"),
        ([header(nbytes=-1)], b"", grpc.StatusCode.INVALID_ARGUMENT, "shards[0].nbytes"),
        (
            [header(), header()],
            None,
            grpc.StatusCode.INVALID_ARGUMENT,
            "shards[1]: shard 0 of 'a' version 1 appears",
        ),
        (
            [header("b"), header(dtype=header("c").dtype)],
            None,
            grpc.StatusCode.INVALID_ARGUMENT,
            "shards[1]: header.dtype",
        ),
        (
            [header(nbytes=8)],
            b"\0" * 8,
            grpc.StatusCode.INVALID_ARGUMENT,
            "shards[0]: header.nbytes 8",
        ),
        (
            [header(shard_index=3)],
            None,
            grpc.StatusCode.INVALID_ARGUMENT,
            "shards[0]: shard_index 3",
        ),
        ([header(name="missing")], None, grpc.StatusCode.NOT_FOUND, "shards[0]"),
        ([header()], b"\0" * 5, grpc.StatusCode.INVALID_ARGUMENT, "data: 5 bytes"),
    ],
)
def test_bad_batches_name_the_field_and_leave_the_rank_serving(store, headers, data, code, field):
    request = pb.WriteShardsRequest(shards=headers)
    request.data = data if data is not None else b"\0" * sum(max(h.nbytes, 0) for h in headers)
    err = refused(store, request)
    assert err.code == code and field in err.details, err
    ShardWrites(store).WriteShards(inline(writes()), ServicerContext())
    assert_written(store)


def test_a_batch_without_a_source_is_refused(store):
    err = refused(store, write_request(writes()))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "source" in err.details


def test_a_committed_version_is_not_written(store):
    ShardWrites(store).WriteShards(inline(writes(["a"])), ServicerContext())
    store.promote("a", 1)
    err = refused(store, inline(writes(["a"])))
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION and "shards[0]" in err.details


# ---------------------------------------------------------------- the bulk port


@pytest.fixture
def port(store):
    reads = BulkReads(store, "127.0.0.1")
    yield reads
    reads.close()


def connect_with(reads: BulkReads, principal: Principal | None = None) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", reads.port), timeout=TIMEOUT_S)
    sock.sendall(reads.tickets.issue("ipv4:127.0.0.1:4242", principal))
    return sock


def send_write(
    sock: socket.socket, batch, payload: bytes | None = None
) -> tuple[grpc.StatusCode, bytes]:
    message = write_request(batch).SerializeToString()
    payload = b"".join(tensor_bytes(w.data) for w in batch) if payload is None else payload
    sock.sendall(struct.pack("<II", KIND_WRITE, len(message)) + message + payload)
    status, _, length = HEADER.unpack(recv_exactly(sock, HEADER.size))
    code = next(c for c in grpc.StatusCode if c.value[0] == status)
    return code, recv_exactly(sock, length)


def test_the_bulk_port_writes_a_batch_bit_for_bit(store, port):
    with connect_with(port) as sock:
        code, body = send_write(sock, writes())
    assert code == grpc.StatusCode.OK
    assert pb.WriteShardsResponse.FromString(body).bytes_written == sum(w.nbytes for w in writes())
    assert_written(store)


def test_a_refused_bulk_batch_is_drained_and_the_connection_stays_in_step(store, port):
    bad = writes(["a", "b"])
    ShardWrites(store).WriteShards(inline(writes(["b"])), ServicerContext())
    store.promote("b", 1)  # the second shard is refused after the first was written
    with connect_with(port) as sock:
        code, body = send_write(sock, bad)
        assert code == grpc.StatusCode.FAILED_PRECONDITION and b"shards[1]" in body
        code, _ = send_write(sock, writes(["c"]))
        assert code == grpc.StatusCode.OK
        store.promote("c", 1)
        read = pb.ReadRegionRequest(
            name="c", version=1, shard_index=0, offsets=[0], sizes=[5]
        ).SerializeToString()
        sock.sendall(struct.pack("<II", KIND_READ, len(read)) + read)
        status, _, length = HEADER.unpack(recv_exactly(sock, HEADER.size))
        assert status == 0 and recv_exactly(sock, length) == bytes(tensor_bytes(SOURCES["c"]))


def test_an_undecodable_write_frame_ends_the_connection(port):
    with connect_with(port) as sock:
        sock.sendall(struct.pack("<II", KIND_WRITE, 3) + b"\xff\xff\xff")
        status, _, length = HEADER.unpack(recv_exactly(sock, HEADER.size))
        assert status == grpc.StatusCode.INVALID_ARGUMENT.value[
            0
        ] and b"WriteShardsRequest" in recv_exactly(sock, length)
        assert sock.recv(1) == b""


@pytest.mark.parametrize(
    "principal, allowed",
    [
        (Principal("reader", "reader", frozenset({READ})), False),
        (Principal("writer", "writer", frozenset({READ, WRITE}), tensors=("other*",)), False),
        (
            Principal("writer", "writer", frozenset({READ, WRITE}), tensors=("a", "b", "c", "d")),
            True,
        ),
    ],
)
def test_the_tickets_principal_decides_what_its_connection_writes(store, port, principal, allowed):
    with connect_with(port, principal) as sock:
        code, body = send_write(sock, writes())
    if allowed:
        assert code == grpc.StatusCode.OK
        assert_written(store)
    else:
        assert code == grpc.StatusCode.PERMISSION_DENIED and principal.name.encode() in body


def _promoted(store, name: str, version: int) -> bool:
    """Whether the version promotes now (False while a shard is not fully written)."""
    try:
        store.promote(name, version)
    except WriteIncomplete:
        return False
    return True


def test_a_writer_cut_off_mid_batch_leaves_its_shard_torn_until_written_again(store, port):
    """The connection dies after half of the first shard's bytes: that shard stays torn (the promote refuses it),
    the port keeps serving, and a later write of the shard completes it."""
    batch = writes(["a", "b"])
    message = write_request(batch).SerializeToString()
    with connect_with(port) as sock:
        sock.sendall(
            struct.pack("<II", KIND_WRITE, len(message))
            + message
            + bytes(tensor_bytes(SOURCES["a"]))[:40]
        )
    with pytest.raises(WriteIncomplete, match="not fully written"):
        store.promote("a", 1)  # never published half written
    deadline = time.monotonic() + TIMEOUT_S
    # until a write lands after the rank's thread for the cut connection is done with it: before, the shard is
    # busy (ABORTED); a write that overtook that thread (a loaded host starts it late) is torn again by it
    while True:
        with connect_with(port) as sock:
            code, body = send_write(sock, writes(["a"]))
        if code == grpc.StatusCode.OK and _promoted(store, "a", 1):
            break
        if code != grpc.StatusCode.OK:
            assert code == grpc.StatusCode.ABORTED and b"being written by another stream" in body
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert torch.equal(store.local_tensor("a", 1, 0), SOURCES["a"])
