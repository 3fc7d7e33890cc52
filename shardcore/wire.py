"""Proto message <-> shardcore dataclass conversion, and raw tensor bytes.

The only module that knows both the proto shapes and the dataclasses. Tensor
data travels as raw little-endian C-contiguous bytes; nothing is pickled.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from google.protobuf.message import Message

from shardserve.core.dtypes import dtype_from_wire, dtype_to_wire
from shardserve.core.metadata import (
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
    interned,
    parsed_placement,
)
from shardserve.core.tensor_options import TensorOptions
from shardserve.protos import shardserve_pb2 as pb

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships on is little-endian
    raise ImportError("shardserve's wire format is little-endian; this host is big-endian")


def properties_to_proto(props: TensorProperties) -> pb.TensorProperties:
    return pb.TensorProperties(
        dtype=cast(pb.DType, dtype_to_wire(props.dtype)),  # the wire enum's number
        requires_grad=props.requires_grad,
        layout="strided",
        memory_format="contiguous_format",
        pin_memory=props.pin_memory,
    )


def properties_from_proto(msg: pb.TensorProperties) -> TensorProperties:
    if msg.layout not in ("", "strided"):
        raise ValueError(
            f"tensor_properties.layout {msg.layout!r} is not supported; only 'strided'"
        )
    try:
        dtype = dtype_from_wire(msg.dtype)
    except ValueError as err:
        raise ValueError(f"tensor_properties.dtype: {err}") from None
    return TensorProperties(dtype=dtype, requires_grad=msg.requires_grad, pin_memory=msg.pin_memory)


def shard_into(msg: pb.ShardMetadata, shard: ShardMetadata) -> None:
    """Fill `msg` (a fresh shard message, added in place to its layout's) with `shard`."""
    msg.shard_offsets.extend(shard.shard_offsets)
    msg.shard_sizes.extend(shard.shard_sizes)
    if shard.placement is not None:
        msg.placement = str(shard.placement)


def shard_from_proto(msg: pb.ShardMetadata, index: int = 0) -> ShardMetadata:
    """The shard of a message; ValueError naming `index` for a bad one."""
    try:
        return _shard_of(msg)
    except (ValueError, TypeError) as err:
        raise ValueError(f"shards_metadata[{index}]: {err}") from None


def _shard_of(msg: pb.ShardMetadata) -> ShardMetadata:
    """The shard of a message. Its repeated fields are read as slices (one C call each: iterating them was most of
    a 1,000-shard layout's decode) and its placement text parsed once per distinct text."""
    text = msg.placement
    return ShardMetadata.of_ints(
        tuple(msg.shard_offsets[:]),
        tuple(msg.shard_sizes[:]),
        parsed_placement(text) if text else None,
    )


ENCODED_LAYOUTS = 4096
"""Layouts whose message is built once and copied after (a copy is one C call; building one from Python
objects costs tens of microseconds): a snapshot's answers and rank calls repeat a state dict's few layouts."""


def metadata_to_proto(meta: ShardedTensorMetadata) -> pb.ShardedTensorMetadata:
    """The message of a layout: a fresh copy, the caller's to change."""
    msg = pb.ShardedTensorMetadata()
    msg.CopyFrom(_layout_message(interned(meta)))
    return msg


def metadata_into(msg: pb.ShardedTensorMetadata, meta: ShardedTensorMetadata) -> None:
    """Set `msg` (a field of a message being built) to the layout's message: one copy, where building a
    message with metadata_to_proto(...) as a field makes two."""
    msg.CopyFrom(_layout_message(interned(meta)))


@functools.lru_cache(maxsize=ENCODED_LAYOUTS)
def _layout_message(meta: ShardedTensorMetadata) -> pb.ShardedTensorMetadata:
    """The layout's message, kept (never handed out: callers get copies). Keyed on interned layouts: a lookup
    finds its key by identity. Each shard's message is added in place and filled (a third faster than
    making each message and copying it in: a restarted coordinator's first listing builds every layout's)."""
    msg = pb.ShardedTensorMetadata(
        size=meta.size, tensor_properties=properties_to_proto(meta.tensor_properties)
    )
    add = msg.shards_metadata.add
    for shard in meta.shards_metadata:
        shard_into(add(), shard)
    return msg


CACHED_MESSAGE_BYTES = 4096
"""Messages up to this size are decoded once per decoder and the result shared (it must be immutable): puts and
reads of the same tensors repeat the same layouts, and decoding one costs ~10 us against ~1 us a lookup."""

Decoded = TypeVar("Decoded")


def decoded_once(decode: Callable[[Any], Decoded], msg: Message) -> Decoded:
    """`decode(msg)`, computed once per distinct small encoding of `msg`; failures are raised, never kept."""
    encoded = msg.SerializeToString()
    if len(encoded) > CACHED_MESSAGE_BYTES:
        return decode(msg)
    return cast(Decoded, _decode_encoded(decode, type(msg).FromString, encoded))


@functools.lru_cache(maxsize=8192)
def _decode_encoded(
    decode: Callable[[Any], Any], parse: Callable[[bytes], Message], encoded: bytes
) -> Any:
    return decode(parse(encoded))


def metadata_from_proto(msg: pb.ShardedTensorMetadata) -> ShardedTensorMetadata:
    """Dataclass from the wire; raises ValueError naming the bad field (not yet validated as a layout)."""
    return decoded_once(_decoded, msg)


def _decoded(msg: pb.ShardedTensorMetadata) -> ShardedTensorMetadata:
    try:
        shards = tuple([_shard_of(s) for s in msg.shards_metadata])
    except (ValueError, TypeError):  # the first bad shard named, found again
        for index, shard in enumerate(msg.shards_metadata):
            shard_from_proto(shard, index)
        raise
    return interned(
        ShardedTensorMetadata(shards, tuple(msg.size), properties_from_proto(msg.tensor_properties))
    )


_OOV_POLICIES = {"error": pb.OOV_ERROR, "zero": pb.OOV_ZERO, "default": pb.OOV_DEFAULT}
_OOV_NAMES = {number: name for name, number in _OOV_POLICIES.items()}


def options_to_proto(options: TensorOptions) -> pb.TensorOptions:
    """The TensorOptions message of a tensor's options."""
    return pb.TensorOptions(
        oov=_OOV_POLICIES[options.oov],
        default_row=options.default_row,
        not_durable=not options.durable,
    )


def options_from_proto(msg: pb.TensorOptions) -> TensorOptions:
    """The options of a TensorOptions message; ValueError for an OovPolicy this version does not know."""
    return _options(msg.oov, msg.default_row, msg.not_durable)


@functools.lru_cache(maxsize=256)
def _options(oov_number: pb.OovPolicy, default_row: bytes, not_durable: bool) -> TensorOptions:
    """The (immutable) options of those fields, made once: a rank reads them for every version it allocates."""
    oov = _OOV_NAMES.get(oov_number)
    if oov is None:
        raise ValueError(f"{oov_number} is not a valid OovPolicy")
    return TensorOptions(oov=oov, default_row=bytes(default_row), durable=not not_durable)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor, C-contiguous, as a zero-copy memoryview when it already is."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj() or t.is_neg() or not t.is_contiguous():
        # a lazily conjugated or negated view has no such bytes (checked first: each call is a dispatch)
        t = t.resolve_conj().resolve_neg().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    # flat first: a 0-d tensor has no dim to view
    return t.reshape(-1).view(torch.uint8).numpy().data


_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16))


def word_views(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two flat uint8 runs of the same length (byte_view's) as the widest integer words that both their
    lengths and addresses allow: torch copies 8-byte words ~10% faster than bytes on large runs."""
    for width, dtype in _WORDS:
        if (a.numel() | a.data_ptr() | b.data_ptr()) % width == 0:
            return a.view(dtype), b.view(dtype)
    return a, b


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a C-contiguous CPU tensor, for writing received chunks into."""
    if not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous tensor")
    if tensor.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    if (
        tensor.numel() == 1
    ):  # "contiguous" whatever its strides (e.g. one element of a stepped view): restride
        return tensor.as_strided((1,), (1,)).view(torch.uint8)
    return tensor.view(-1).view(torch.uint8)
