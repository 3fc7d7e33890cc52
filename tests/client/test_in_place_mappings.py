"""The in-place writer's kept mappings: segments their rank still holds stay mapped, segments it let go of are
unmapped after the next batch, and the kept bytes stay within their bound. Real memfds of this process stand
for a rank's segments (/proc/<pid>/fd/<fd>, checked by inode as a rank's are). CUDA shards' handles are kept
the same way (opened once; the rank's extra count given back); here they open as CPU bytes."""

from __future__ import annotations

import os

import pytest
import torch

from shardserve.client.paths import in_place
from shardserve.client.paths.in_place import InPlaceUnavailable, InPlaceWriter, _map_writable
from shardserve.client.paths.writes import shard_write
from shardserve.protos import shardserve_pb2 as pb

ADDRESS = "127.0.0.1:1"


def _segment(nbytes: int = 8192, *, sealed: bool = False) -> tuple[int, pb.WritableSegment]:
    fd = os.memfd_create("segment", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    info = os.fstat(fd)
    return fd, pb.WritableSegment(
        pid=os.getpid(),
        fd=fd,
        inode=info.st_ino,
        device_id=info.st_dev,
        data_offset=4096,
        nbytes=nbytes - 4096,
        sealed=sealed,
    )


def test_segments_the_rank_let_go_of_are_unmapped_and_held_ones_kept():
    writer = InPlaceWriter(None, "host")  # type: ignore[arg-type]  # no call reaches the channel here
    held_fd, held = _segment()
    freed_fd, freed = _segment()
    try:
        writer.mappings.target(ADDRESS, held).fill_(7)
        writer.mappings.target(ADDRESS, freed).fill_(8)
        assert writer.mapped_segments == 2
        assert os.pread(held_fd, 4, 4096) == b"\x07" * 4  # the copy landed in the segment itself
        os.close(freed_fd)  # the rank frees that segment for good
        writer.mappings.unmap_released(ADDRESS, used=set())
        assert writer.mapped_segments == 1
        writer.mappings.target(ADDRESS, held)  # kept: no new mapping
        assert writer.mapped_segments == 1
    finally:
        os.close(held_fd)


def test_a_writer_checks_which_segments_were_let_go_at_most_every_sweep_interval():
    """Writes into segments opened with their allocation (no call to the rank): a segment the rank let go is
    unmapped by the first batch written SWEEP_S or more after the last check, not by every batch (each check
    costs a stat per kept segment)."""
    now = [100.0]
    writer = InPlaceWriter(None, "host", clock=lambda: now[0])  # type: ignore[arg-type]
    held_fd, held = _segment()
    freed_fd, freed = _segment()
    data = torch.arange(1024, dtype=torch.int32)  # the segments' 4096 bytes
    try:
        for index, segment in enumerate((held, freed)):
            write = shard_write("w", 1, index, data, segment=segment)
            assert writer.write(ADDRESS, [write]) == (4096, [])
        assert os.pread(freed_fd, 4096, 4096) == data.numpy().tobytes()
        assert writer.mapped_segments == 2
        os.close(freed_fd)  # the rank frees that segment for good
        now[0] += in_place.SWEEP_S / 2
        writer.write(ADDRESS, [shard_write("w", 1, 0, data, segment=held)])
        assert writer.mapped_segments == 2  # not checked yet
        now[0] += in_place.SWEEP_S
        writer.write(ADDRESS, [shard_write("w", 1, 0, data, segment=held)])
        assert writer.mapped_segments == 1
    finally:
        os.close(held_fd)


class _Rank:
    """The OpenShardsForWrite of a rank, answering `answers` in turn; the requests kept."""

    timeout, metadata = 5.0, ()

    def __init__(self, *answers: list[pb.WritableSegment]) -> None:
        self.answers = list(answers)
        self.requests: list[pb.OpenShardsForWriteRequest] = []

    def shard_server(self, address: str) -> _Rank:
        return self

    def OpenShardsForWrite(self, request, timeout, metadata):  # noqa: N802 - the gRPC method's name
        self.requests.append(request)
        return pb.OpenShardsForWriteResponse(segments=self.answers.pop(0))


def test_memory_a_writer_never_mapped_is_asked_for_fresh_and_filled_in_place():
    """One segment of a snapshot's batch is memory this writer never mapped, sealed since: the writer asks the
    rank for that shard `fresh` and fills the new segment in place, the other one where it was."""
    mappable_fd, mappable = _segment()
    sealed_fd, sealed = _segment(sealed=True)
    fresh_fd, fresh = _segment()
    rank = _Rank([fresh])
    writer = InPlaceWriter(rank, "host")  # type: ignore[arg-type]
    data = torch.arange(1024, dtype=torch.int32)
    try:
        writes = [
            shard_write("w", 1, index, data + index, segment=segment)
            for index, segment in enumerate((mappable, sealed))
        ]
        assert writer.write(ADDRESS, writes) == (8192, [])
        [request] = rank.requests
        assert request.fresh and [h.shard_index for h in request.shards] == [1]
        assert os.pread(mappable_fd, 4096, 4096) == data.numpy().tobytes()
        assert os.pread(fresh_fd, 4096, 4096) == (data + 1).numpy().tobytes()
        assert os.pread(sealed_fd, 4096, 4096) == bytes(4096)  # untouched
        assert writer.mapped_segments == 2
    finally:
        for fd in (mappable_fd, sealed_fd, fresh_fd):
            os.close(fd)


def test_memory_the_rank_does_not_renew_is_left_for_another_path():
    """A rank that answers the same sealed memory (one that cannot move the shard): that write is left, the rest
    of the batch written in place."""
    mappable_fd, mappable = _segment()
    sealed_fd, sealed = _segment(sealed=True)
    writer = InPlaceWriter(_Rank([sealed]), "host")  # type: ignore[arg-type]
    data = torch.arange(1024, dtype=torch.int32)
    try:
        writes = [
            shard_write("w", 1, index, data, segment=segment)
            for index, segment in enumerate((mappable, sealed))
        ]
        assert writer.write(ADDRESS, writes) == (4096, [writes[1]])
        assert os.pread(sealed_fd, 4096, 4096) == bytes(4096)
    finally:
        os.close(mappable_fd)
        os.close(sealed_fd)


def test_kept_mappings_stay_within_their_bytes():
    writer = InPlaceWriter(None, "host", mapped_bytes=3 * 8192)  # type: ignore[arg-type]
    fds = []
    try:
        for _ in range(5):
            fd, segment = _segment()
            fds.append(fd)
            writer.mappings.target(ADDRESS, segment)
        assert writer.mapped_segments == 3
    finally:
        for fd in fds:
            os.close(fd)


def test_a_sealed_segment_never_mapped_and_another_file_are_refused():
    writer = InPlaceWriter(None, "host")  # type: ignore[arg-type]
    fd, segment = _segment(sealed=True)
    other_fd, other = _segment()
    try:
        with pytest.raises(InPlaceUnavailable, match="never mapped"):
            writer.mappings.target(ADDRESS, segment)
        other.inode += 1  # names a file the fd is not
        with pytest.raises(InPlaceUnavailable, match="another file"):
            _map_writable(other)
    finally:
        os.close(fd)
        os.close(other_fd)


def _cuda_segment(header_fd: int, handle: bytes, nbytes: int = 64) -> pb.WritableSegment:
    """A CUDA shard's answer: its header-only segment (a memfd of this process) and an IPC handle."""
    info = os.fstat(header_fd)
    segment = pb.WritableSegment(
        pid=os.getpid(), fd=header_fd, inode=info.st_ino, device_id=info.st_dev, nbytes=nbytes
    )
    segment.cuda.CopyFrom(
        pb.CudaIpcHandle(handle=handle, storage_size_bytes=4 * nbytes, tensor_offset=4)
    )
    return segment


@pytest.fixture
def ipc(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """CUDA handles opened as CPU bytes, and the IPC counts given back, recorded."""
    calls: dict[str, list] = {"opened": [], "released": []}

    def open_handle(h: pb.CudaIpcHandle, byte_offset: int, nbytes: int) -> torch.Tensor:
        calls["opened"].append((h.handle, byte_offset))
        return torch.zeros(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(in_place, "open_cuda_handle", open_handle)
    monkeypatch.setattr(
        in_place, "release_cuda_count", lambda h: calls["released"].append(h.handle)
    )
    return calls


def test_a_cuda_handle_is_opened_once_and_the_ranks_extra_count_given_back(ipc) -> None:
    writer = InPlaceWriter(None, "host")  # type: ignore[arg-type]
    fd = os.memfd_create("header", os.MFD_CLOEXEC)
    try:
        first = writer.mappings.target(ADDRESS, _cuda_segment(fd, b"h1"), itemsize=2)
        assert first.numel() == 64 and ipc["opened"] == [
            (b"h1", 8)
        ]  # tensor_offset 4 elements of 2 bytes
        again = writer.mappings.target(ADDRESS, _cuda_segment(fd, b"h1"), itemsize=2)
        assert again is first and ipc["released"] == [b"h1"]  # kept; the rank's new count returned
        writer.mappings.target(
            ADDRESS, _cuda_segment(fd, b"h2"), itemsize=2
        )  # another shard behind the header
        assert [h for h, _ in ipc["opened"]] == [b"h1", b"h2"] and writer.mapped_segments == 1
    finally:
        os.close(fd)
    writer.mappings.unmap_released(
        ADDRESS, used=set()
    )  # the rank closed the header: the handle goes
    assert writer.mapped_segments == 0


def test_handles_not_opened_are_given_back_when_a_batch_fails_or_a_shard_is_left(ipc) -> None:
    writer = InPlaceWriter(None, "host")  # type: ignore[arg-type]
    fd = os.memfd_create("header", os.MFD_CLOEXEC)
    try:
        segments = [_cuda_segment(fd, b"a"), _cuda_segment(fd, b"b")]
        writes = [shard_write("t", 1, i, torch.zeros(16, dtype=torch.float32)) for i in range(2)]
        with pytest.raises(InPlaceUnavailable, match="answered 2 segments for 1 shards"):
            writer.targets(ADDRESS, writes[:1], segments)
        assert ipc["released"] == [b"a", b"b"] and ipc["opened"] == []
        segments[0].sealed = True  # never mapped: left for another path, its count given back
        ipc["released"].clear()
        first, second = writer.targets(ADDRESS, writes, segments)
        assert first is None and second is not None
        assert ipc["released"] == [b"a"] and ipc["opened"] == [(b"b", 4 * 4)]
    finally:
        os.close(fd)
