"""Layout value types with PyTorch's names and semantics.

`TensorProperties`, `ShardMetadata` and `ShardedTensorMetadata` mirror
`torch.distributed._shard.sharded_tensor.metadata` / `..._shard.metadata`, but
are frozen, hashable and hold plain tuples so they are cheap to compare and
send. Placements are parsed like torch's `_remote_device` ("rank:N/cpu",
"rank:N/cuda:K").
"""

from __future__ import annotations

import functools
import math
import operator
import re
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch

from shardserve.core.dtypes import dtype_to_wire

T = TypeVar("T")

_PLACEMENT_RE = re.compile(r"^rank:(\d+)/(cpu|cuda(?::\d+)?|meta)$", re.ASCII)  # ASCII digits only


PLACEMENTS_CACHED = 65536
"""Distinct placement texts kept parsed (one per rank and device of the clusters a process has seen)."""


class RemoteDevice:
    """A placement "rank:N/<device>", with torch `_remote_device`'s accessors."""

    __slots__ = ("_rank", "_device", "_text")
    _rank: int
    _device: torch.device
    _text: str  # its canonical string, made once: layouts hash and print their placements often

    def __init__(self, spec: str | RemoteDevice | tuple[int, str]) -> None:
        if isinstance(spec, RemoteDevice):
            self._rank, self._device, self._text = spec._rank, spec._device, spec._text
            return
        if isinstance(spec, tuple):
            rank, device = spec
            spec = f"rank:{int(rank)}/{device}"
        if not isinstance(spec, str):
            spec = str(spec)  # torch's _remote_device prints as "rank:N/device"
        match = _PLACEMENT_RE.match(spec.strip())
        if not match:
            raise ValueError(
                f"placement {spec!r} is not of the form 'rank:N/cpu' or 'rank:N/cuda:K'"
            )
        self._rank = int(match.group(1))
        device = match.group(2)
        self._device = torch.device("cuda:0" if device == "cuda" else device)
        self._text = f"rank:{self._rank}/{self._device}"

    def rank(self) -> int:
        return self._rank

    def device(self) -> torch.device:
        return self._device

    def worker_name(self) -> None:
        return None

    def __str__(self) -> str:
        return self._text

    def __repr__(self) -> str:
        return f"RemoteDevice({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            try:
                other = RemoteDevice(other)
            except ValueError:
                return False
        return isinstance(other, RemoteDevice) and (self._rank, self._device) == (
            other._rank,
            other._device,
        )

    def __hash__(self) -> int:
        return hash(self._text)  # as its canonical string, which it equals


def as_placement(value: str | RemoteDevice | int | None) -> RemoteDevice | None:
    """Coerce "rank:N/dev", a RemoteDevice, torch's _remote_device or a bare rank int."""
    if value is None or isinstance(value, RemoteDevice):
        return value
    if isinstance(value, int):
        return parsed_placement(f"rank:{value}/cpu")
    return parsed_placement(str(value))


@functools.lru_cache(maxsize=PLACEMENTS_CACHED)
def parsed_placement(text: str) -> RemoteDevice:
    """The RemoteDevice of a placement's text, parsed once per distinct text: a layout of a thousand shards names
    a few ranks (RemoteDevice is never changed after it is made, so one object serves every shard)."""
    return RemoteDevice(text)


@dataclass(frozen=True)
class TensorProperties:
    """torch's TensorProperties: what a tensor is, apart from its size."""

    dtype: torch.dtype = torch.float32
    layout: torch.layout = torch.strided
    requires_grad: bool = False
    memory_format: torch.memory_format = torch.contiguous_format
    pin_memory: bool = False

    def __post_init__(self) -> None:
        dtype_to_wire(self.dtype)
        if self.layout != torch.strided:
            raise ValueError(
                f"tensor_properties.layout {self.layout} is not supported; only torch.strided"
            )

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize  # a dtype of the wire's table: checked when these were made


def _int_tuple(values: Iterable[int], what: str) -> tuple[int, ...]:
    if type(values) is tuple and all(type(v) is int for v in values):
        return values  # the common case, checked fast: boxes are made on every read
    values = tuple(values)
    if any(isinstance(v, bool) for v in values):
        raise TypeError(f"{what} must hold integers, got {values!r}")
    try:
        return tuple(operator.index(v) for v in values)
    except TypeError:
        raise TypeError(f"{what} must hold integers, got {values!r}") from None


@dataclass(frozen=True)
class Box:
    """An axis-aligned region of a tensor: `offsets` and `sizes` per dim."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "offsets", _int_tuple(self.offsets, "offsets"))
        object.__setattr__(self, "sizes", _int_tuple(self.sizes, "sizes"))
        if len(self.offsets) != len(self.sizes):
            raise ValueError(
                f"offsets has {len(self.offsets)} dims but sizes has {len(self.sizes)}"
            )

    @classmethod
    def of_ints(cls, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Box:
        """A box of values that are tuples of ints of as many dims already (a shard's, checked when it was
        made): nothing checked again. A layout's health makes a box per shard, and the constructor's checks
        were most of that (2.1 us of 2.5 a box)."""
        box = object.__new__(cls)
        object.__setattr__(box, "offsets", offsets)
        object.__setattr__(box, "sizes", sizes)
        return box

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    def numel(self) -> int:
        return math.prod(self.sizes)

    def is_empty(self) -> bool:
        return 0 in self.sizes

    def contains(self, other: Box) -> bool:
        return all(
            o1 <= o2 and o2 + s2 <= o1 + s1
            for o1, s1, o2, s2 in zip(self.offsets, self.sizes, other.offsets, other.sizes)
        )


def _check_dims(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> None:
    if len(offsets) != len(sizes):
        raise ValueError(f"shard_offsets has {len(offsets)} dims but shard_sizes has {len(sizes)}")


@dataclass(frozen=True)
class ShardMetadata:
    """One shard: a box of the global tensor and the rank/device that holds it."""

    shard_offsets: tuple[int, ...]
    shard_sizes: tuple[int, ...]
    placement: RemoteDevice | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shard_offsets", _int_tuple(self.shard_offsets, "shard_offsets"))
        object.__setattr__(self, "shard_sizes", _int_tuple(self.shard_sizes, "shard_sizes"))
        object.__setattr__(self, "placement", as_placement(self.placement))
        _check_dims(self.shard_offsets, self.shard_sizes)

    @classmethod
    def of_ints(
        cls,
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
        placement: RemoteDevice | None,
    ) -> ShardMetadata:
        """A shard made from values that are tuples of ints already (a protobuf message's int64 fields): only
        their dims are checked. The coercions of the constructor cost twice the decode itself, and a reshard
        decodes every shard of the layout it is asked for (its fields set as one dict: a third of the cost of
        setting each)."""
        _check_dims(offsets, sizes)
        shard = object.__new__(cls)
        object.__setattr__(
            shard,
            "__dict__",
            {"shard_offsets": offsets, "shard_sizes": sizes, "placement": placement},
        )
        return shard

    @functools.cached_property
    def box(self) -> Box:
        return Box.of_ints(self.shard_offsets, self.shard_sizes)

    @property
    def rank(self) -> int:
        if self.placement is None:
            raise ValueError("shard has no placement")
        return self.placement.rank()

    @property
    def device(self) -> torch.device:
        if self.placement is None:
            raise ValueError("shard has no placement")
        return self.placement.device()

    def numel(self) -> int:
        return math.prod(self.shard_sizes)


@dataclass(frozen=True)
class ShardedTensorMetadata:
    """The global view of a sharded tensor: its shards, size and properties."""

    shards_metadata: tuple[ShardMetadata, ...] = ()
    size: tuple[int, ...] = ()
    tensor_properties: TensorProperties = field(default_factory=TensorProperties)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shards_metadata", tuple(self.shards_metadata))
        object.__setattr__(self, "size", _int_tuple(self.size, "size"))
        for i, shard in enumerate(self.shards_metadata):
            if not isinstance(shard, ShardMetadata):
                raise TypeError(
                    f"shards_metadata[{i}] is a {type(shard).__name__}, not ShardMetadata"
                )

    def __hash__(self) -> int:
        """The hash of its fields, computed once (a layout is immutable, and caches key on it)."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.shards_metadata, self.size, self.tensor_properties))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict[str, object]:
        """Its fields without the cached hash (string hashes differ from one process to another)."""
        return {key: value for key, value in self.__dict__.items() if key != "_hash"}

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor_properties.dtype

    @property
    def ndim(self) -> int:
        return len(self.size)

    def numel(self) -> int:
        return math.prod(self.size)

    @functools.cached_property
    def nbytes(self) -> int:
        """The bytes of one copy of the tensor (computed once: records and answers ask it for every tensor)."""
        return self.numel() * self.tensor_properties.itemsize

    def ranks(self) -> tuple[int, ...]:
        """Sorted distinct ranks that hold at least one shard (computed once: fan-outs ask it of every tensor)."""
        cached = self.__dict__.get("_ranks")
        if cached is None:
            cached = tuple(sorted({s.rank for s in self.shards_metadata}))
            object.__setattr__(self, "_ranks", cached)
        return cached

    def shards_on(self, rank: int) -> list[int]:
        """Indices (into shards_metadata) of the shards placed on `rank`, in order (the index by rank computed
        once: a rank asks it of every version it allocates, promotes and drops)."""
        by_rank = self.__dict__.get("_by_rank")
        if by_rank is None:
            by_rank = {}
            for index, shard in enumerate(self.shards_metadata):
                by_rank.setdefault(shard.rank, []).append(index)
            object.__setattr__(self, "_by_rank", by_rank)
        return list(by_rank.get(rank, ()))

    def kept(self, fact: str, compute: Callable[[], T]) -> T:
        """compute(), kept with this layout object as `fact` and answered from there after (a layout never
        changes: a check it passed or a value derived from it holds for as long as it lives). A failure is not
        kept: compute() runs again the next time."""
        facts: dict[str, Any] = self.__dict__.setdefault("_facts", {})
        if fact not in facts:
            facts[fact] = compute()
        return cast(T, facts[fact])

    def knows(self, fact: str) -> bool:
        """Whether `fact` was computed for this layout object (kept())."""
        return fact in self.__dict__.get("_facts", ())

    def shard_ranks(self) -> tuple[int, ...]:
        """The rank of every shard, in order (computed once: a reshard's plan asks it of both layouts); ValueError
        naming the first shard without a placement."""
        return self.kept("shard_ranks", self._shard_ranks)

    def _shard_ranks(self) -> tuple[int, ...]:
        for index, shard in enumerate(self.shards_metadata):
            if shard.placement is None:
                raise ValueError(f"shards_metadata[{index}].placement is missing")
        return tuple(shard.rank for shard in self.shards_metadata)

    def shard_nbytes(self, index: int) -> int:
        return self.shards_metadata[index].numel() * self.tensor_properties.itemsize

    def shards_nbytes(self) -> int:
        """The bytes of every shard, replicas counted each: what the layout holds over all its ranks."""
        return (
            sum(shard.numel() for shard in self.shards_metadata) * self.tensor_properties.itemsize
        )


_INTERNED: weakref.WeakValueDictionary[ShardedTensorMetadata, ShardedTensorMetadata] = (
    weakref.WeakValueDictionary()
)


def interned(meta: ShardedTensorMetadata) -> ShardedTensorMetadata:
    """The one live object equal to `meta` (`meta` itself when it is the first). Decoders intern what they make,
    so that the records and requests of one layout share an object: caches keyed on layouts then find it by
    identity, not by comparing every shard (a state dict's ten thousand tensors have a few layouts)."""
    found = _INTERNED.get(meta)
    if found is None:
        _INTERNED[meta] = found = meta  # a race makes two equal objects, never a wrong one
    return found


def make_metadata(
    size: Sequence[int],
    shards: Sequence[tuple[Sequence[int], Sequence[int], str | int]],
    dtype: torch.dtype = torch.float32,
) -> ShardedTensorMetadata:
    """Shorthand: metadata from (offsets, sizes, placement) triples."""
    return ShardedTensorMetadata(
        tuple(ShardMetadata(tuple(o), tuple(s), as_placement(p)) for o, s, p in shards),
        tuple(size),
        TensorProperties(dtype=dtype),
    )
