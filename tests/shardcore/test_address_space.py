"""Address ranges: a file's writable mapping moved into a range still writes it after its writes are sealed."""

import fcntl
import mmap
import os

import pytest
import torch
from page_tables import resident_bytes_at

from shardserve.core.address_space import PAGE, AddressRange, WritableMapping, moves_supported

pytestmark = pytest.mark.skipif(
    not moves_supported(), reason="the kernel cannot move shared mappings"
)


F_SEAL_FUTURE_WRITE = 0x0010  # <linux/fcntl.h>


def seal_writes(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)


def _memfd(nbytes: int) -> int:
    fd = os.memfd_create("test-block", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    return fd


def test_a_window_moved_in_writes_the_file_after_its_writes_are_sealed():
    fd = _memfd(4 * PAGE)
    try:
        writer = WritableMapping(fd, 4 * PAGE)
        writer.tensor().fill_(1)
        seal_writes(fd)
        with pytest.raises(OSError):
            os.pwrite(fd, b"x", 0)  # the seal holds for the file's handles
        with pytest.raises(OSError):
            mmap.mmap(fd, PAGE)  # and for new writable mappings
        space = AddressRange(2 * PAGE)
        space.move_in(0, 2 * PAGE, writer, PAGE)  # the file's pages 1 and 2
        window = space.tensor(2 * PAGE)
        window.fill_(7)
        assert os.pread(fd, 4 * PAGE, 0) == b"\x01" * PAGE + b"\x07" * 2 * PAGE + b"\x01" * PAGE
        writer.tensor()[PAGE : PAGE + 4].fill_(9)  # the writer keeps its window: both see one file
        assert window[:4].tolist() == [9, 9, 9, 9]
    finally:
        os.close(fd)


def test_a_mapping_made_elsewhere_is_wrapped_whole_and_kept_alive():
    fd = _memfd(2 * PAGE)
    try:
        mapped = mmap.mmap(fd, 2 * PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        flat = torch.frombuffer(mapped, dtype=torch.uint8)
        seal_writes(fd)
        writer = WritableMapping.over(flat)
        assert writer.size == 2 * PAGE and writer.tensor() is flat
        space = AddressRange(PAGE)
        space.move_in(0, PAGE, writer, PAGE)
        space.tensor(PAGE).fill_(3)
        assert os.pread(fd, PAGE, PAGE) == b"\x03" * PAGE
    finally:
        del flat
        os.close(fd)


def test_a_sealed_file_refuses_a_writable_window_placed_afresh():
    """What move_in is for: `place` makes a new mapping, which the seal refuses."""
    fd = _memfd(PAGE)
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        seal_writes(fd)
        with pytest.raises(OSError):
            AddressRange(PAGE).place(0, PAGE, fd, 0, writable=True)
    finally:
        os.close(fd)


def test_a_window_populated_before_it_is_moved_in_takes_its_pages_along():
    """A window moved out leaves the writer without its pages; populate() maps them again in one call, and the
    move takes them into the range (writes there fault nothing in)."""
    nbytes = 64 * PAGE
    fd = _memfd(nbytes)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        writer = WritableMapping(fd, nbytes)
        space = AddressRange(nbytes)
        space.move_in(0, nbytes, writer, 0)
        assert resident_bytes_at(writer.address, nbytes) == 0  # the pages went with the first move
        if not writer.populate(0, nbytes):
            pytest.skip("the kernel has no MADV_POPULATE_WRITE (Linux 5.14)")
        assert resident_bytes_at(writer.address, nbytes) == nbytes
        again = AddressRange(nbytes)
        again.move_in(0, nbytes, writer, 0)
        assert resident_bytes_at(again.address, nbytes) == nbytes
        again.tensor(nbytes).fill_(5)
        assert os.pread(fd, nbytes, 0) == b"\x05" * nbytes
        assert not writer.populate(0, 0)
    finally:
        os.close(fd)
