"""The in-place writer's kept mappings: segments their rank still holds stay mapped, segments it let go of are
unmapped after the next batch, and the kept bytes stay within their bound. Real memfds of this process stand
for a rank's segments (/proc/<pid>/fd/<fd>, checked by inode as a rank's are)."""

from __future__ import annotations

import os

import pytest

from shardserve.client.paths.in_place import InPlaceUnavailable, InPlaceWriter, _map_writable
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
        writer._target(ADDRESS, held).fill_(7)
        writer._target(ADDRESS, freed).fill_(8)
        assert writer.mapped_segments == 2
        assert os.pread(held_fd, 4, 4096) == b"\x07" * 4  # the copy landed in the segment itself
        os.close(freed_fd)  # the rank frees that segment for good
        writer._unmap_released(ADDRESS, used=set())
        assert writer.mapped_segments == 1
        writer._target(ADDRESS, held)  # kept: no new mapping
        assert writer.mapped_segments == 1
    finally:
        os.close(held_fd)


def test_kept_mappings_stay_within_their_bytes():
    writer = InPlaceWriter(None, "host", mapped_bytes=3 * 8192)  # type: ignore[arg-type]
    fds = []
    try:
        for _ in range(5):
            fd, segment = _segment()
            fds.append(fd)
            writer._target(ADDRESS, segment)
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
            writer._target(ADDRESS, segment)
        other.inode += 1  # names a file the fd is not
        with pytest.raises(InPlaceUnavailable, match="another file"):
            _map_writable(other)
    finally:
        os.close(fd)
        os.close(other_fd)
