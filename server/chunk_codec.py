"""The bulk messages encoded and decoded around their payload, saving protobuf's extra copy.

protobuf's Python API only takes `bytes` for a bytes field and hands one back
as a fresh copy. ReadRegion's answers are encoded here as a small prefix joined
with a memoryview slice of the shard (one copy, into the message gRPC sends);
WriteShard's chunk messages are decoded to a memoryview into the received
message, which the store copies straight into the shard. Anything not in the
canonical shape (a header, unknown fields) goes through protobuf unchanged.
"""
from __future__ import annotations

from typing import NamedTuple

from protos import shardserve_pb2 as pb

_TAG_OFFSET = 0x08  # TensorChunk.offset = 1, varint
_TAG_DATA = 0x12    # TensorChunk.data = 2, length-delimited
_TAG_CHUNK = 0x12   # WriteShardRequest.chunk = 2, length-delimited


def _varint(value: int) -> bytes:
    """Base-128 varint (non-negative values only: offsets and lengths)."""
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_chunk(chunk: "pb.TensorChunk | RawChunk") -> bytes:
    """Serialized TensorChunk; a RawChunk's memoryview is copied once, into the message."""
    if isinstance(chunk, pb.TensorChunk):
        return chunk.SerializeToString()
    head = (bytes((_TAG_OFFSET,)) + _varint(chunk.offset)) if chunk.offset else b""
    if len(chunk.data):
        head += bytes((_TAG_DATA,)) + _varint(len(chunk.data))
    return b"".join((head, chunk.data))


class RawChunk(NamedTuple):
    """A TensorChunk whose data is a memoryview (of a shard, or of a received message)."""

    offset: int
    data: memoryview


class RawWriteRequest(NamedTuple):
    """A WriteShardRequest carrying a chunk, shaped like the protobuf message the servicer reads."""

    chunk: RawChunk

    def WhichOneof(self, group: str) -> str:  # noqa: N802 - protobuf's name
        return "chunk"

    def HasField(self, field: str) -> bool:  # noqa: N802 - protobuf's name
        return field == "chunk"


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while pos < len(buf) and shift < 64:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise ValueError("bad varint")


def _raw_chunk(buf: memoryview) -> RawWriteRequest:
    """Parse exactly chunk{offset?, data?}; ValueError for any other shape."""
    if not len(buf) or buf[0] != _TAG_CHUNK:
        raise ValueError("not a chunk message")
    length, pos = _read_varint(buf, 1)
    if pos + length != len(buf):
        raise ValueError("not a single chunk field")
    offset, data = 0, buf[0:0]
    if pos < len(buf) and buf[pos] == _TAG_OFFSET:
        offset, pos = _read_varint(buf, pos + 1)
        if offset >= 1 << 63:
            raise ValueError("negative offset")  # let protobuf decode it; the writer names it
    if pos < len(buf) and buf[pos] == _TAG_DATA:
        size, pos = _read_varint(buf, pos + 1)
        data, pos = buf[pos:pos + size], pos + size
    if pos != len(buf):
        raise ValueError("trailing fields")
    return RawWriteRequest(RawChunk(offset, data))


def decode_write_request(message: bytes) -> "pb.WriteShardRequest | RawWriteRequest":
    """A received WriteShardRequest: chunks as views into `message`, anything else via protobuf."""
    try:
        return _raw_chunk(memoryview(message))
    except ValueError:
        return pb.WriteShardRequest.FromString(message)
