"""protos.chunk_codec agrees with protobuf on every shape it handles, and hands the rest to protobuf."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protos import shardserve_pb2 as pb
from protos.chunk_codec import RawChunk, RawWriteRequest, decode_write_request, encode_chunk


@given(st.integers(0, 2**63 - 1), st.binary(max_size=300))
def test_encode_chunk_matches_protobuf(offset, data):
    encoded = encode_chunk(RawChunk(offset, memoryview(data)))
    assert pb.TensorChunk.FromString(encoded) == pb.TensorChunk(offset=offset, data=data)
    assert encoded == pb.TensorChunk(offset=offset, data=data).SerializeToString()


@given(st.integers(0, 2**63 - 1), st.binary(max_size=300))
def test_decoded_chunks_are_views_with_protobufs_values(offset, data):
    message = pb.WriteShardRequest(chunk=pb.TensorChunk(offset=offset, data=data)).SerializeToString()
    decoded = decode_write_request(message)
    assert isinstance(decoded, RawWriteRequest) and decoded.WhichOneof("part") == "chunk"
    assert decoded.chunk.offset == offset and bytes(decoded.chunk.data) == data


@pytest.mark.parametrize("message", [
    pb.WriteShardRequest(header=pb.WriteShardHeader(name="x", version=3, nbytes=8)),
    pb.WriteShardRequest(),
    pb.WriteShardRequest(chunk=pb.TensorChunk(offset=-4, data=b"ab")),
])
def test_other_shapes_go_through_protobuf(message):
    decoded = decode_write_request(message.SerializeToString())
    assert isinstance(decoded, pb.WriteShardRequest) and decoded == message


def test_unknown_fields_and_truncation_fall_back_to_protobuf():
    good = pb.WriteShardRequest(chunk=pb.TensorChunk(offset=5, data=b"abc")).SerializeToString()
    with_unknown = good[:1] + bytes([good[1] + 2]) + good[2:] + b"\x18\x01"  # TensorChunk field 3 = 1
    decoded = decode_write_request(with_unknown)
    assert isinstance(decoded, pb.WriteShardRequest) and decoded.chunk.data == b"abc"
    with pytest.raises(Exception):
        decode_write_request(good[:-1])
