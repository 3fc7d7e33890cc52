"""TensorChunk messages encoded and decoded around the payload, saving protobuf's extra copy.

protobuf's Python API only takes `bytes` for a bytes field and hands one back
as a fresh copy. On the bulk path that is one needless copy of every chunk each
way, so these two functions write and read the proto3 wire format of
`WriteShardRequest{chunk: TensorChunk{offset, data}}` and `TensorChunk`
directly: the encoder joins a small prefix with a memoryview slice of the
shard (one copy, into the message gRPC sends), the decoder returns a memoryview
into the received message. Both are checked against protobuf in the tests.
"""
from __future__ import annotations

from typing import NamedTuple

_WIRE_VARINT, _WIRE_I64, _WIRE_LEN, _WIRE_I32 = 0, 1, 2, 5
_TAG_OFFSET = (1 << 3) | _WIRE_VARINT       # TensorChunk.offset = 1 (int64)
_TAG_DATA = (2 << 3) | _WIRE_LEN            # TensorChunk.data = 2 (bytes)
_TAG_CHUNK = (2 << 3) | _WIRE_LEN           # WriteShardRequest.chunk = 2 (TensorChunk)


class DecodedChunk(NamedTuple):
    """A received TensorChunk: byte offset in the region and a view of its payload."""

    offset: int
    data: memoryview


def _varint(value: int) -> bytes:
    """Base-128 varint; negative int64 values as their 64-bit two's complement, like protobuf."""
    value &= (1 << 64) - 1
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_write_chunk(offset: int, data: memoryview) -> bytes:
    """Serialized `WriteShardRequest(chunk=TensorChunk(offset=offset, data=data))`, copying `data` once."""
    head = b""
    if offset:  # proto3 leaves fields at their default out
        head += bytes((_TAG_OFFSET,)) + _varint(offset)
    if len(data):
        head += bytes((_TAG_DATA,)) + _varint(len(data))
    return b"".join((bytes((_TAG_CHUNK,)), _varint(len(head) + len(data)), head, data))


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint in TensorChunk")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes in TensorChunk")


def decode_chunk(message: bytes) -> DecodedChunk:
    """A serialized TensorChunk as (offset, memoryview of data), skipping unknown fields like protobuf."""
    buf = memoryview(message)
    pos, offset, data = 0, 0, buf[0:0]
    while pos < len(buf):
        tag, pos = _read_varint(buf, pos)
        field, wire = tag >> 3, tag & 7
        if wire == _WIRE_VARINT:
            value, pos = _read_varint(buf, pos)
            if field == 1:
                offset = value - (1 << 64) if value >= 1 << 63 else value
        elif wire == _WIRE_LEN:
            length, pos = _read_varint(buf, pos)
            if pos + length > len(buf):
                raise ValueError("truncated length-delimited field in TensorChunk")
            if field == 2:
                data = buf[pos:pos + length]
            pos += length
        elif wire in (_WIRE_I64, _WIRE_I32):
            pos += 8 if wire == _WIRE_I64 else 4
        else:
            raise ValueError(f"unsupported wire type {wire} in TensorChunk")
    if pos != len(buf):
        raise ValueError("truncated fixed-width field in TensorChunk")
    return DecodedChunk(offset, data)
