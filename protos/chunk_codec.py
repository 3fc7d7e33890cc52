"""Bulk messages encoded and decoded around their payload, saving protobuf's extra copy.

protobuf's Python API only takes `bytes` for a bytes field and hands one back
as a fresh copy. On the bulk path that is one needless copy of every chunk each
way, so this module writes and reads the proto3 wire format of `TensorChunk`
and `WriteShardRequest{chunk}` directly: an encoder joins a small prefix with a
memoryview slice of the tensor (one copy, into the message gRPC sends), a
decoder returns a memoryview into the received message. `LookupChunk` and
`LookupReply` (embedding lookup answers) are handled the same way: their small
fields go through protobuf, the row bytes around it. Client and server both
use it; the tests hold it against protobuf.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from shardserve.protos import shardserve_pb2 as pb

_WIRE_VARINT, _WIRE_I64, _WIRE_LEN, _WIRE_I32 = 0, 1, 2, 5
_TAG_OFFSET = (1 << 3) | _WIRE_VARINT  # TensorChunk.offset = 1 (int64)
_TAG_DATA = (2 << 3) | _WIRE_LEN  # TensorChunk.data = 2 (bytes)
_TAG_CHUNK = (2 << 3) | _WIRE_LEN  # WriteShardRequest.chunk = 2 (TensorChunk)
_TAG_LOOKUP_DATA = (7 << 3) | _WIRE_LEN  # LookupChunk.data = 7 (bytes), its last field
_TAG_REPLY_ITEM = (1 << 3) | _WIRE_LEN  # LookupReply.items = 1 (repeated LookupChunk)


class RawChunk(NamedTuple):
    """A TensorChunk whose data is a memoryview (of a tensor, or of a received message)."""

    offset: int
    data: memoryview


class RawWriteRequest(NamedTuple):
    """A WriteShardRequest carrying a chunk, shaped like the protobuf message the servicer reads."""

    chunk: RawChunk

    def WhichOneof(self, group: str) -> str:  # noqa: N802 - protobuf's name
        return "chunk"

    def HasField(self, field: str) -> bool:  # noqa: N802 - protobuf's name
        return field == "chunk"


def _varint(value: int) -> bytes:
    """Base-128 varint; negative int64 values as their 64-bit two's complement, like protobuf."""
    value &= (1 << 64) - 1
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _length_prefix(tag: int, size: int) -> bytes:
    """The tag and length that come before a length-delimited field's `size` bytes."""
    return bytes((tag,)) + _varint(size)


def _chunk_head(offset: int, size: int) -> bytes:
    """Everything of a serialized TensorChunk before its payload (proto3 leaves defaults out)."""
    head = bytes((_TAG_OFFSET,)) + _varint(offset) if offset else b""
    if size:
        head += _length_prefix(_TAG_DATA, size)
    return head


def encode_chunk(chunk: pb.TensorChunk | RawChunk) -> bytes:
    """Serialized TensorChunk; a RawChunk's memoryview is copied once, into the message."""
    if isinstance(chunk, pb.TensorChunk):
        serialized: bytes = chunk.SerializeToString()
        return serialized
    return b"".join((_chunk_head(chunk.offset, len(chunk.data)), chunk.data))


def encode_write_chunk(offset: int, data: memoryview) -> bytes:
    """Serialized `WriteShardRequest(chunk=TensorChunk(offset=offset, data=data))`, copying `data` once."""
    head = _chunk_head(offset, len(data))
    return b"".join((_length_prefix(_TAG_CHUNK, len(head) + len(data)), head, data))


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def _fields(buf: memoryview, what: str) -> Iterator[tuple[int, int | memoryview]]:
    """(field number, value) of a serialized message: varints as unsigned ints, length-delimited fields as
    views into `buf`; fixed-width fields (none in the messages read here) are skipped, like unknown ones."""
    pos = 0
    while pos < len(buf):
        tag, pos = _read_varint(buf, pos)
        field, wire = tag >> 3, tag & 7
        if wire == _WIRE_VARINT:
            value, pos = _read_varint(buf, pos)
            yield field, value
        elif wire == _WIRE_LEN:
            length, pos = _read_varint(buf, pos)
            if pos + length > len(buf):
                raise ValueError(f"truncated length-delimited field in {what}")
            yield field, buf[pos : pos + length]
            pos += length
        elif wire in (_WIRE_I64, _WIRE_I32):
            pos += 8 if wire == _WIRE_I64 else 4
        else:
            raise ValueError(f"unsupported wire type {wire} in {what}")
    if pos != len(buf):
        raise ValueError(f"truncated fixed-width field in {what}")


def _signed(value: int, bits: int = 64) -> int:
    """A varint read as unsigned, back to the signed int32/int64 protobuf wrote (two's complement)."""
    value &= (1 << 64) - 1
    if bits == 32:
        value &= (1 << 32) - 1
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


class RawLookupChunk(NamedTuple):
    """A LookupChunk with `counts` and `data` as memoryviews into the received message."""

    item: int = 0
    version: int = 0
    dtype: int = 0
    nbytes: int = 0
    counts: memoryview = memoryview(b"")
    offset: int = 0
    data: memoryview = memoryview(b"")


class LookupPart(NamedTuple):
    """A LookupChunk to send: its small fields in `header` (data unset) and its data as a view."""

    header: pb.LookupChunk
    data: memoryview


def _lookup_chunk_parts(part: LookupPart) -> list[bytes | memoryview]:
    head = part.header.SerializeToString()
    if not len(part.data):
        return [head]
    return [
        head,
        _length_prefix(_TAG_LOOKUP_DATA, len(part.data)),
        part.data,
    ]  # data (7) is the last field


def encode_lookup_chunk(part: LookupPart) -> bytes:
    """Serialized LookupChunk, its data copied once (into the message)."""
    return b"".join(_lookup_chunk_parts(part))


def encode_lookup_reply(parts: list[LookupPart]) -> bytes:
    """Serialized LookupReply of whole items, each item's data copied once."""
    return b"".join(lookup_reply_pieces(parts))


def lookup_reply_pieces(parts: list[LookupPart]) -> list[bytes | memoryview]:
    """A serialized LookupReply of whole items as pieces to send in order (the data not copied)."""
    out: list[bytes | memoryview] = []
    for part in parts:
        chunk = _lookup_chunk_parts(part)
        out += [_length_prefix(_TAG_REPLY_ITEM, sum(len(p) for p in chunk)), *chunk]
    return out


# LookupChunk's fields by number: varints (name, signed width; 0 for uint64) and bytes (name)
_LOOKUP_INTS = {
    1: ("item", 32),
    2: ("version", 0),
    3: ("dtype", 32),
    4: ("nbytes", 64),
    6: ("offset", 64),
}
_LOOKUP_BYTES = {5: "counts", 7: "data"}


def decode_lookup_chunk(message: bytes | memoryview) -> RawLookupChunk:
    """A serialized LookupChunk, its byte fields as views into `message` (the last value of a field wins)."""
    ints: dict[str, int] = {}
    views: dict[str, memoryview] = {}
    for field, value in _fields(memoryview(message), "LookupChunk"):
        if isinstance(value, int) and field in _LOOKUP_INTS:
            name, bits = _LOOKUP_INTS[field]
            ints[name] = _signed(value, bits) if bits else value
        elif isinstance(value, memoryview) and field in _LOOKUP_BYTES:
            views[_LOOKUP_BYTES[field]] = value
    empty = memoryview(b"")
    return RawLookupChunk(
        item=ints.get("item", 0),
        version=ints.get("version", 0),
        dtype=ints.get("dtype", 0),
        nbytes=ints.get("nbytes", 0),
        counts=views.get("counts", empty),
        offset=ints.get("offset", 0),
        data=views.get("data", empty),
    )


def decode_lookup_reply(message: bytes) -> list[RawLookupChunk]:
    """A serialized LookupReply as its items, their byte fields as views into `message`."""
    return [
        decode_lookup_chunk(value)
        for field, value in _fields(memoryview(message), "LookupReply")
        if field == 1 and isinstance(value, memoryview)
    ]


def decode_chunk(message: bytes | memoryview) -> RawChunk:
    """A serialized TensorChunk as (offset, memoryview of data), skipping unknown fields like protobuf."""
    offset, data = 0, memoryview(b"")
    for field, value in _fields(memoryview(message), "TensorChunk"):
        if field == 1 and isinstance(value, int):
            offset = _signed(value)
        elif field == 2 and isinstance(value, memoryview):
            data = value
    return RawChunk(offset, data)


def _raw_write_request(buf: memoryview) -> RawWriteRequest:
    """Parse exactly `WriteShardRequest{chunk}`; ValueError for any other shape (a header, say)."""
    if not len(buf) or buf[0] != _TAG_CHUNK:
        raise ValueError("not a chunk message")
    length, pos = _read_varint(buf, 1)
    if pos + length != len(buf):
        raise ValueError("not a single chunk field")
    chunk = decode_chunk(buf[pos:])
    if (
        chunk.offset < 0
        or len(_chunk_head(chunk.offset, len(chunk.data))) + len(chunk.data) != length
    ):
        raise ValueError("not the canonical chunk{offset, data} shape")
    return RawWriteRequest(chunk)


def decode_write_request(message: bytes) -> pb.WriteShardRequest | RawWriteRequest:
    """A received WriteShardRequest: chunks as views into `message`, anything else via protobuf."""
    try:
        return _raw_write_request(memoryview(message))
    except ValueError:
        request: pb.WriteShardRequest = pb.WriteShardRequest.FromString(message)
        return request
