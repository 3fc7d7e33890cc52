"""Packs: many small tensors of a state dict stored as one byte tensor, each at an offset of its own.

A state dict of hundreds of small tensors (biases, norms, scales) costs per tensor at every step: a catalog row,
a version on a rank to allocate, promote and drop, a region to plan and read. Weight-sync systems put such
tensors in buckets; a snapshot put with packing stores each run of small tensors as one 1-D uint8 tensor (a
*pack*) under a key of its own, and the state dict's skeleton (shardcore.state_tree) records where each packed
tensor lies in it: its key, its pack, its byte offset, its stored dtype and its shape. The coordinator and the
ranks see only the packs; the client packs on put and unpacks on get.

`plan_packs` cuts a list of small tensors into packs; `with_packs` writes them into a skeleton and `packs_of`
reads them back, checked (offsets inside their pack and aligned for their dtype, no two items overlapping, every
key once); `stored_keys` is the keys a snapshot with that skeleton holds as tensors.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from shardserve.core.dtypes import UnsupportedDTypeError, dtype_from_name, dtype_name
from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.state_tree import PACKED_FORMAT  # readers that know only format 1 refuse it

ALIGN_BYTES = (
    64  # every item starts at a multiple of this in its pack (vector loads, any dtype's alignment)
)
PACK_KEY_BASE = "_packed"  # a pack's key: this and its position ("_packed.0"), moved aside from the state dict's


class PackError(ValueError):
    """A skeleton's packs that cannot be read: the message names the pack or item and what is wrong."""


@dataclass(frozen=True)
class PackedItem:
    """One small tensor stored in a pack: its state dict `key`, its place in the pack and what it is."""

    key: str
    offset: int  # bytes from the pack's start
    dtype: torch.dtype  # as stored (a put's cast applied)
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


@dataclass(frozen=True)
class Pack:
    """One pack: the key it is stored under, its size in bytes and its items in offset order."""

    key: str
    nbytes: int
    items: tuple[PackedItem, ...]


@dataclass(frozen=True)
class Packable:
    """A tensor a put may pack: its key, the dtype it is stored in, its shape."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def plan_packs(
    tensors: Sequence[Packable], *, taken: Iterable[str], max_pack_bytes: int
) -> list[Pack]:
    """`tensors` in packs of at most `max_pack_bytes` (a larger tensor alone in one), in their order, each item
    at the next aligned offset; the packs' keys are PACK_KEY_BASE and their position, moved aside (a suffix)
    from the keys in `taken` (the state dict's own)."""
    taken = set(taken)
    packs: list[Pack] = []
    items: list[PackedItem] = []
    end = 0
    for tensor in tensors:
        item = PackedItem(tensor.key, _aligned(end), tensor.dtype, tuple(tensor.shape))
        if items and item.offset + item.nbytes > max_pack_bytes:
            packs.append(_closed(len(packs), items, end, taken))
            items, item = [], PackedItem(tensor.key, 0, tensor.dtype, tuple(tensor.shape))
        items.append(item)
        end = item.offset + item.nbytes
    if items:
        packs.append(_closed(len(packs), items, end, taken))
    return packs


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN_BYTES) * ALIGN_BYTES


def _closed(position: int, items: list[PackedItem], end: int, taken: set[str]) -> Pack:
    key = f"{PACK_KEY_BASE}.{position}"
    while key in taken:
        key += "_"
    taken.add(key)
    return Pack(key, end, tuple(items))


def with_packs(skeleton: str, packs: Sequence[Pack]) -> str:
    """`skeleton` (a state dict's, shardcore.state_tree) listing `packs`; the same text when there are none."""
    if not packs:
        return skeleton
    document = json.loads(skeleton)
    document["format"] = PACKED_FORMAT
    document["packs"] = [
        {
            "key": pack.key,
            "nbytes": pack.nbytes,
            "items": [
                [item.key, item.offset, dtype_name(item.dtype), list(item.shape)]
                for item in pack.items
            ],
        }
        for pack in packs
    ]
    return json.dumps(document, separators=(",", ":"), allow_nan=False)


def packs_of(skeleton: str) -> list[Pack]:
    """The packs a skeleton lists (none for one without), checked: PackError names the first bad one."""
    if not skeleton:
        return []
    try:
        document = json.loads(skeleton)
    except json.JSONDecodeError:
        return []  # not a skeleton at all: shardcore.state_tree says so to whoever reads the tree
    listed = document.get("packs", []) if isinstance(document, dict) else []
    if not isinstance(listed, list):
        raise PackError("packs: not a list")
    packs = [_pack(position, body) for position, body in enumerate(listed)]
    _check_keys_once(packs)
    return packs


def _pack(position: int, body: object) -> Pack:
    where = f"packs[{position}]"
    if not isinstance(body, dict) or not isinstance(body.get("items"), list):
        raise PackError(f"{where}: not a pack (key, nbytes, items)")
    key, nbytes = body.get("key"), body.get("nbytes")
    if not isinstance(key, str) or not key:
        raise PackError(f"{where}.key: not a tensor key")
    if type(nbytes) is not int or nbytes < 0:
        raise PackError(f"{where}.nbytes: {nbytes!r} is not a byte count")
    items = tuple(_item(f"{where}.items[{index}]", raw) for index, raw in enumerate(body["items"]))
    end = 0
    for item in sorted(items, key=lambda i: i.offset):
        if item.offset < end:
            raise PackError(
                f"{where}: item {item.key!r} at byte {item.offset} overlaps the one before"
            )
        end = item.offset + item.nbytes
        if end > nbytes:
            raise PackError(
                f"{where}: item {item.key!r} ends at byte {end}, past the pack's {nbytes} bytes"
            )
    return Pack(key, nbytes, items)


def _item(where: str, raw: object) -> PackedItem:
    if not (isinstance(raw, list) and len(raw) == 4):
        raise PackError(f"{where}: not an item [key, offset, dtype, shape]")
    key, offset, name, shape = raw
    if not isinstance(key, str) or not key:
        raise PackError(f"{where}: the key is not a tensor key")
    if type(offset) is not int or offset < 0:
        raise PackError(f"{where}: offset {offset!r} is not a byte offset")
    try:
        dtype = dtype_from_name(str(name))
    except UnsupportedDTypeError as err:
        raise PackError(f"{where}: {err}") from None
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise PackError(f"{where}: shape {shape!r} is not a list of sizes")
    if offset % dtype.itemsize:
        raise PackError(f"{where}: offset {offset} is not aligned for {dtype_name(dtype)}")
    return PackedItem(key, offset, dtype, tuple(shape))


def _check_keys_once(packs: Sequence[Pack]) -> None:
    seen: set[str] = set()
    for key in [p.key for p in packs] + [i.key for p in packs for i in p.items]:
        if key in seen:
            raise PackError(f"packs: key {key!r} is listed twice")
        seen.add(key)


def stored_keys(referenced: Iterable[str], packs: Sequence[Pack]) -> list[str]:
    """The keys a snapshot holds as tensors when its skeleton refers to `referenced` and lists `packs`: the
    referenced ones not packed, and the packs. PackError when a packed key is not referenced."""
    referenced = list(referenced)
    packed = {item.key for pack in packs for item in pack.items}
    unreferenced = sorted(packed - set(referenced))
    if unreferenced:
        raise PackError(f"packs: items {unreferenced[:5]} are not in the state dict's tree")
    return [key for key in referenced if key not in packed] + [pack.key for pack in packs]


def check_pack_layouts(packs: Sequence[Pack], layouts: Mapping[str, ShardedTensorMetadata]) -> None:
    """PackError unless every pack's tensor is 1-D uint8 of the pack's size (reads of an item take its bytes)."""
    for pack in packs:
        meta = layouts.get(pack.key)
        if meta is None:
            continue  # a missing key is named by the check of the keys
        if meta.dtype != torch.uint8 or tuple(meta.size) != (pack.nbytes,):
            raise PackError(
                f"pack {pack.key!r} is stored as {dtype_name(meta.dtype)} {tuple(meta.size)}; a pack is "
                f"uint8 ({pack.nbytes},)"
            )
