"""Registered pages: a mapping's host pages are registered with the device once, while its owner lives, and
unregistered when it goes, before the bytes can be unmapped; nothing is registered without a device, for memory
that is not the CPU's, or twice after the driver refused. A recording registrar stands in for CUDA's runtime."""

from __future__ import annotations

import gc
import mmap

import torch

from shardserve.client.paths.registered import (
    PORTABLE,
    READ_ONLY,
    RegisteredPages,
    page_span,
)


class Recorder:
    """A registrar that records its calls (and whether the bytes were still there when unregistered)."""

    def __init__(self, *, available: bool = True, accepts: bool = True) -> None:
        self._available, self._accepts = available, accepts
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def available(self) -> bool:
        return self._available

    def register(self, address: int, nbytes: int, flags: int) -> bool:
        self.registered.append((address, nbytes, flags))
        return self._accepts

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)


class Owner:
    """Stands for a cached mapping object that owns the bytes."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat


def _mapped(nbytes: int) -> torch.Tensor:
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def test_a_mapping_is_registered_once_and_unregistered_when_its_owner_goes() -> None:
    recorder = Recorder()
    pages = RegisteredPages(recorder)
    whole = _mapped(3 * mmap.PAGESIZE)
    owner = Owner(whole[mmap.PAGESIZE :])
    assert pages.pin(owner, owner.flat, read_only=True)
    assert pages.pin(owner, owner.flat, read_only=True)  # kept: no second registration
    start = whole.data_ptr() + mmap.PAGESIZE
    assert recorder.registered == [(start, 2 * mmap.PAGESIZE, PORTABLE | READ_ONLY)]
    assert pages.registered == {start: 2 * mmap.PAGESIZE}
    del owner
    gc.collect()
    assert recorder.unregistered == [start]
    assert pages.registered == {}


def test_a_registration_handed_over_lasts_as_long_as_the_new_owner() -> None:
    """A reader's later mapping object over the same pages (a segment reused for a newer version) keeps their
    registration: nothing registered again, nothing unregistered when the earlier object goes."""
    recorder = Recorder()
    pages = RegisteredPages(recorder)
    earlier = Owner(_mapped(2 * mmap.PAGESIZE))
    assert pages.pin(earlier, earlier.flat)
    later = Owner(earlier.flat)
    pages.hand_over(earlier, later)
    del earlier
    gc.collect()
    assert recorder.unregistered == []
    assert pages.pin(later, later.flat)  # registered already
    assert len(recorder.registered) == 1
    start = later.flat.data_ptr()
    del later
    gc.collect()
    assert recorder.unregistered == [start]
    assert pages.registered == {}


def test_handing_over_an_unregistered_owner_does_nothing() -> None:
    pages = RegisteredPages(Recorder())
    earlier = Owner(_mapped(mmap.PAGESIZE))
    later = Owner(earlier.flat)
    pages.hand_over(earlier, later)
    assert pages.registered == {}


def test_a_writable_mapping_is_registered_without_the_read_only_flag() -> None:
    recorder = Recorder()
    owner = Owner(_mapped(mmap.PAGESIZE))
    assert RegisteredPages(recorder).pin(owner, owner.flat)
    assert recorder.registered[0][2] == PORTABLE


def test_nothing_is_registered_without_a_device_or_for_memory_not_on_the_cpu() -> None:
    recorder = Recorder(available=False)
    owner = Owner(_mapped(mmap.PAGESIZE))
    assert not RegisteredPages(recorder).pin(owner, owner.flat)
    on_meta = Owner(torch.empty(4096, dtype=torch.uint8, device="meta"))
    assert not RegisteredPages(Recorder()).pin(on_meta, on_meta.flat)
    empty = Owner(torch.empty(0, dtype=torch.uint8))
    assert not RegisteredPages(Recorder()).pin(empty, empty.flat)
    assert recorder.registered == []


def test_a_refused_registration_is_not_asked_again_for_that_owner() -> None:
    recorder = Recorder(accepts=False)
    pages = RegisteredPages(recorder)
    owner = Owner(_mapped(mmap.PAGESIZE))
    assert not pages.pin(owner, owner.flat)
    assert not pages.pin(owner, owner.flat)
    assert len(recorder.registered) == 1 and pages.registered == {}
    del owner
    gc.collect()
    assert recorder.unregistered == []  # never registered, never unregistered


def test_spans_widen_to_whole_pages() -> None:
    page = mmap.PAGESIZE
    assert page_span(page, page) == (page, page)
    assert page_span(page + 8, 16) == (page, page)
    assert page_span(2 * page - 8, 16) == (page, 2 * page)
