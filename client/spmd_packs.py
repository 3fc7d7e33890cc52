"""Packed puts and gets of a state dict's small plain tensors (shardcore.packs).

`spmd.put_state_dict(..., pack=True)` stores the plain tensors of at most PACK_ITEM_BYTES each as a few 1-D
uint8 tensors (packs of at most PACK_BYTES) and lists where each one lies in the state dict's skeleton: the
coordinator and the ranks then hold, commit and serve a few tensors where there were hundreds. The writer
copies the small tensors into its pack buffers in one foreach copy (converted to the put's dtype), through
views made once and kept with the buffers for the prefix's next put. A get reads each pack it needs whole and
copies every packed tensor's boxes out of it (converted to the output's dtype, as unpacked tensors are).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardserve.client.casts import check_read_cast, stored_as
from shardserve.client.errors import InvalidArgumentError
from shardserve.client.session import Session
from shardserve.client.spmd_pieces import Piece, distributed_types
from shardserve.core.dtypes import SUPPORTED_DTYPES
from shardserve.core.metadata import Box
from shardserve.core.packs import (
    Pack,
    Packable,
    PackedItem,
    PackError,
    packs_of,
    plan_packs,
    with_packs,
)
from shardserve.core.regions import check_box, local_view

PACK_ITEM_BYTES = 64 << 10  # plain tensors up to this size are packed
PACK_BYTES = 16 << 20  # the most bytes of one pack (a larger tensor is never packed)


@dataclass(frozen=True)
class PackedState:
    """A state dict's tensors with its small plain ones replaced by their packs, and the skeleton listing
    them; `done()` gives the packs' memory back for the prefix's next put."""

    tensors: dict[str, Any]
    skeleton: str
    done: Callable[[], None] = lambda: None


class _Buffers:
    """The memory of some packs and each item's view of it (made once: ~10 us a view), kept for the next call
    made with the same `key` (what the packs were made from); a put's also keeps its skeleton with the packs."""

    def __init__(self, key: Hashable, packs: Sequence[Pack], device: torch.device) -> None:
        self.key, self.packs = key, tuple(packs)
        self.memory = {
            pack.key: torch.empty(pack.nbytes, dtype=torch.uint8, device=device) for pack in packs
        }
        self.views = {
            item.key: item_view(self.memory[pack.key], item)
            for pack in packs
            for item in pack.items
        }
        self._skeleton: tuple[str, str] = ("", "")  # a skeleton and the same listing the packs

    def listed_in(self, skeleton: str) -> str:
        """`skeleton` listing these packs (the last answer again for the same skeleton: a steady put's)."""
        if self._skeleton[0] != skeleton:
            self._skeleton = (skeleton, with_packs(skeleton, self.packs))
        return self._skeleton[1]


class PackBuffers:
    """One client's pack buffers by prefix, for its puts or its gets: a call takes its prefix's (two calls for
    one prefix at once never share them) and keeps them for the next one when it is done."""

    def __init__(self) -> None:
        self._by_prefix: dict[str, _Buffers] = {}
        self._lock = threading.Lock()

    def take(self, prefix: str, key: Hashable, make: Callable[[], _Buffers]) -> _Buffers:
        """The prefix's kept buffers if they were made from `key`, else `make()`'s."""
        with self._lock:
            kept = self._by_prefix.pop(prefix, None)
        return kept if kept is not None and kept.key == key else make()

    def keep(self, prefix: str, buffers: _Buffers) -> None:
        with self._lock:
            self._by_prefix[prefix] = buffers


_by_session: weakref.WeakKeyDictionary[Session, dict[str, PackBuffers]] = (
    weakref.WeakKeyDictionary()
)
_by_session_guard = threading.Lock()


def pack_buffers(session: Session, use: str) -> PackBuffers:
    """The pack buffers of `session`'s puts or gets (`use`: "put", "get"; gone with the session)."""
    with _by_session_guard:
        return _by_session.setdefault(session, {}).setdefault(use, PackBuffers())


def most_common_device(devices: Iterable[torch.device]) -> torch.device:
    """The device most of `devices` are on (ties: the first by name, the same choice on every rank of a job;
    none: the CPU)."""
    counts = Counter(devices)
    return min(counts, key=lambda d: (-counts[d], str(d))) if counts else torch.device("cpu")


def item_view(memory: torch.Tensor, item: PackedItem) -> torch.Tensor:
    """The packed tensor `item` as a view of its pack's bytes."""
    return memory[item.offset : item.offset + item.nbytes].view(item.dtype).view(item.shape)


# ---------------------------------------------------------------- put


def pack_state(
    session: Session,
    prefix: str,
    tensors: Mapping[str, Any],
    skeleton: str,
    *,
    cast: torch.dtype | None,
    writer: bool,
) -> PackedState:
    """`tensors` with the small plain ones of the most common device packed (filled when this process is the
    plain tensors' `writer`, else stood for by unwritten buffers of the packs' size: their pages are never
    touched), and `skeleton` listing them."""
    small = _packable(tensors, cast)
    if len(small) < 2:
        return PackedState(dict(tensors), skeleton)
    device = most_common_device(t.device for t, _ in small.values())
    chosen = [
        (key, stored, tuple(t.shape)) for key, (t, stored) in small.items() if t.device == device
    ]
    # what a plan is made from (plain tuples: compared fast at every steady put); the pack keys are moved
    # aside from the state dict's
    made_from = (tuple(chosen), device, frozenset(tensors))
    kept = pack_buffers(session, "put")
    buffers = kept.take(
        prefix,
        made_from,
        lambda: _Buffers(
            made_from,
            plan_packs([Packable(*c) for c in chosen], taken=tensors, max_pack_bytes=PACK_BYTES),
            device,
        ),
    )
    out = {key: value for key, value in tensors.items() if key not in buffers.views}
    out.update(buffers.memory)
    if writer:
        sources = [small[key][0] for key, _, _ in chosen]
        torch._foreach_copy_(
            [buffers.views[key] for key, _, _ in chosen],
            [t.detach() if t.requires_grad else t for t in sources],
        )
    return PackedState(out, buffers.listed_in(skeleton), lambda: kept.keep(prefix, buffers))


def _packable(
    tensors: Mapping[str, Any], cast: torch.dtype | None
) -> dict[str, tuple[torch.Tensor, torch.dtype]]:
    """The plain dense tensors of at most PACK_ITEM_BYTES (as stored, and as they are) of a supported dtype,
    each with the dtype it is stored in."""
    distributed = distributed_types()
    stored_of: dict[torch.dtype, torch.dtype] = {}  # a state dict has a few dtypes
    out = {}
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor) or isinstance(value, distributed):
            continue
        if value.layout != torch.strided or value.device.type not in ("cpu", "cuda"):
            continue
        dtype = value.dtype
        if dtype not in stored_of:
            if dtype not in SUPPORTED_DTYPES:
                continue
            stored_of[dtype] = stored_as(dtype, cast, key)
        stored = stored_of[dtype]
        if value.numel() * max(stored.itemsize, dtype.itemsize) <= PACK_ITEM_BYTES:
            out[key] = (value, stored)
    return out


# ---------------------------------------------------------------- get


@dataclass
class PackedRead:
    """A get's targets with its packed keys' pieces set aside: `plain` (every other key, and each needed pack
    read whole into a buffer), then `unpack()` fills the packed keys' pieces from those buffers; `done()` gives
    the buffers back for the prefix's next get."""

    plain: dict[str, list[Piece]]
    copies: list[tuple[torch.Tensor, torch.Tensor]]  # (destination, source view of a pack's buffer)
    _release: Callable[[], None] = lambda: None

    def unpack(self) -> None:
        """Fill each destination from its pack's buffer (converted to its dtype), one foreach copy per device."""
        by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for into, source in self.copies:
            dests, sources = by_device.setdefault(into.device, ([], []))
            dests.append(into)
            sources.append(source if into.device == source.device else source.to(into.device))
        for dests, sources in by_device.values():
            torch._foreach_copy_(dests, sources)

    def done(self) -> None:
        self._release()


def packed_read(
    session: Session, prefix: str, skeleton: str, targets: Mapping[str, list[Piece]]
) -> PackedRead:
    """The reads and copies of a get of `targets` from a snapshot of `prefix` whose skeleton is `skeleton`; a
    packed key whose piece does not fit it, or of a dtype it cannot be converted to, is INVALID_ARGUMENT naming
    it."""
    packs = stored_packs(skeleton)
    where = {item.key: (pack, item) for pack in packs for item in pack.items}
    if not any(key in where for key in targets):
        return PackedRead(dict(targets), [])
    kept = pack_buffers(session, "get")
    # where most packed pieces land: the packs are read there (a GPU reader's cross to the device once, whole)
    outs = (out.device for key, pieces in targets.items() if key in where for _, out in pieces)
    device = most_common_device(outs)
    buffers = kept.take(prefix, (packs, device), lambda: _Buffers((packs, device), packs, device))
    plain = {key: pieces for key, pieces in targets.items() if key not in where}
    needed: set[str] = set()
    copies = []
    for key, pieces in targets.items():
        if key in where:
            pack, item = where[key]
            copies += _copies(key, item, buffers.views[key], pieces)
            needed.add(pack.key)
    for pack in packs:
        if pack.key in needed:
            plain[pack.key] = [(Box((0,), (pack.nbytes,)), buffers.memory[pack.key])]
    return PackedRead(plain, copies, lambda: kept.keep(prefix, buffers))


@functools.lru_cache(maxsize=8)
def stored_packs(skeleton: str) -> tuple[Pack, ...]:
    """The packs a stored skeleton lists (a steady get reads the same text every step); INVALID_ARGUMENT
    when they are not well formed."""
    try:
        return tuple(packs_of(skeleton))
    except PackError as err:
        raise InvalidArgumentError(f"the snapshot's packs: {err}") from None


def _copies(
    key: str, item: PackedItem, whole: torch.Tensor, pieces: Sequence[Piece]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for box, into in pieces:
        if into.dtype != item.dtype:
            check_read_cast(item.dtype, into.dtype, key)
        if box.sizes == item.shape and not any(box.offsets):
            out.append(
                (into, whole)
            )  # the whole tensor (a plain tensor's piece): its view as it is
            continue
        try:
            check_box(item.shape, box)
        except ValueError as err:
            raise InvalidArgumentError(
                f"{key!r}: {err} (the stored tensor has shape {item.shape})"
            ) from None
        out.append((into, local_view(whole, Box((0,) * len(item.shape), item.shape), box)))
    return out
