"""protos.chunk_codec agrees with protobuf on every shape it handles, and hands the rest to protobuf; shardcore.wire's
raw tensor bytes."""

from __future__ import annotations

import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.chunk_codec import (
    LookupPart,
    RawChunk,
    RawWriteRequest,
    decode_lookup_chunk,
    decode_lookup_reply,
    decode_write_request,
    encode_chunk,
    encode_lookup_chunk,
    encode_lookup_reply,
)


@given(st.integers(0, 2**63 - 1), st.binary(max_size=300))
def test_encode_chunk_matches_protobuf(offset, data):
    encoded = encode_chunk(RawChunk(offset, memoryview(data)))
    assert pb.TensorChunk.FromString(encoded) == pb.TensorChunk(offset=offset, data=data)
    assert encoded == pb.TensorChunk(offset=offset, data=data).SerializeToString()


@given(st.integers(0, 2**63 - 1), st.binary(max_size=300))
def test_decoded_chunks_are_views_with_protobufs_values(offset, data):
    message = pb.WriteShardRequest(
        chunk=pb.TensorChunk(offset=offset, data=data)
    ).SerializeToString()
    decoded = decode_write_request(message)
    assert isinstance(decoded, RawWriteRequest) and decoded.WhichOneof("part") == "chunk"
    assert decoded.chunk.offset == offset and bytes(decoded.chunk.data) == data


@pytest.mark.parametrize(
    "length", [127, 128, (1 << 14) - 1, 1 << 14, 1 << 20, (1 << 21) - 1, 1 << 21, 4 << 20]
)
def test_real_chunk_sizes_match_protobuf(length):
    """Lengths whose varint takes 1, 2, 3 and 4 bytes: real chunks are about 1 MiB."""
    data = torch.randint(
        0, 256, (length,), dtype=torch.uint8, generator=torch.Generator().manual_seed(length)
    )
    data = data.numpy().tobytes()
    encoded = encode_chunk(RawChunk(12345, memoryview(data)))
    assert encoded == pb.TensorChunk(offset=12345, data=data).SerializeToString()
    message = pb.WriteShardRequest(
        chunk=pb.TensorChunk(offset=12345, data=data)
    ).SerializeToString()
    decoded = decode_write_request(message)
    assert isinstance(decoded, RawWriteRequest)
    assert decoded.chunk.offset == 12345 and bytes(decoded.chunk.data) == data


@pytest.mark.parametrize(
    "message",
    [
        pb.WriteShardRequest(header=pb.WriteShardHeader(name="x", version=3, nbytes=8)),
        pb.WriteShardRequest(),
        pb.WriteShardRequest(chunk=pb.TensorChunk(offset=-4, data=b"ab")),
    ],
)
def test_other_shapes_go_through_protobuf(message):
    decoded = decode_write_request(message.SerializeToString())
    assert isinstance(decoded, pb.WriteShardRequest) and decoded == message


def test_unknown_fields_and_truncation_fall_back_to_protobuf():
    good = pb.WriteShardRequest(chunk=pb.TensorChunk(offset=5, data=b"abc")).SerializeToString()
    with_unknown = (
        good[:1] + bytes([good[1] + 2]) + good[2:] + b"\x18\x01"
    )  # TensorChunk field 3 = 1
    decoded = decode_write_request(with_unknown)
    assert isinstance(decoded, pb.WriteShardRequest) and decoded.chunk.data == b"abc"
    with pytest.raises(DecodeError):  # protobuf's own parser, not an error of the fast path
        decode_write_request(good[:-1])


lookup_chunks = st.builds(
    lambda item, version, dtype, nbytes, counts, offset, data: (
        pb.LookupChunk(
            item=item, version=version, dtype=dtype, nbytes=nbytes, counts=counts, offset=offset
        ),
        data,
    ),
    st.integers(-(2**31), 2**31 - 1),
    st.integers(0, 2**64 - 1),
    st.integers(0, 20),
    st.integers(-(2**63), 2**63 - 1),
    st.binary(max_size=40),
    st.integers(-(2**63), 2**63 - 1),
    st.binary(max_size=300),
)


def _with_data(header: pb.LookupChunk, data: bytes) -> pb.LookupChunk:
    full = pb.LookupChunk()
    full.CopyFrom(header)
    full.data = data
    return full


@given(lookup_chunks)
def test_lookup_chunks_encode_and_decode_like_protobuf(chunk):
    header, data = chunk
    reference = _with_data(header, data)
    encoded = encode_lookup_chunk(LookupPart(header, memoryview(data)))
    assert encoded == reference.SerializeToString()
    decoded = decode_lookup_chunk(encoded)
    assert (decoded.item, decoded.version, decoded.dtype, decoded.nbytes, decoded.offset) == (
        reference.item,
        reference.version,
        reference.dtype,
        reference.nbytes,
        reference.offset,
    )
    assert bytes(decoded.counts) == reference.counts and bytes(decoded.data) == data
    assert isinstance(decoded.data, memoryview)


@given(st.lists(lookup_chunks, max_size=4))
def test_lookup_replies_encode_and_decode_like_protobuf(chunks):
    reference = pb.LookupReply(items=[_with_data(header, data) for header, data in chunks])
    encoded = encode_lookup_reply([LookupPart(header, memoryview(data)) for header, data in chunks])
    assert encoded == reference.SerializeToString()
    decoded = decode_lookup_reply(encoded)
    assert [(d.item, d.version, bytes(d.counts), bytes(d.data)) for d in decoded] == [
        (r.item, r.version, r.counts, r.data) for r in reference.items
    ]


def test_lookup_decoder_skips_unknown_fields_and_rejects_truncation():
    message = pb.LookupChunk(item=2, version=9, data=b"rows").SerializeToString()
    unknown = bytes([(12 << 3) | 0, 5, (13 << 3) | 2, 2, 1, 2])
    decoded = decode_lookup_chunk(unknown + message)
    assert (decoded.item, decoded.version, bytes(decoded.data)) == (2, 9, b"rows")
    with pytest.raises(ValueError, match="truncated"):
        decode_lookup_chunk(message[:-1])
    with pytest.raises(ValueError, match="truncated"):
        decode_lookup_reply(
            pb.LookupReply(items=[pb.LookupChunk(data=b"rows")]).SerializeToString()[:-2]
        )


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor(3.5),
        torch.tensor(7, dtype=torch.int16),
        torch.arange(6.0).view(2, 3).t(),
        torch.empty(0, 4),
    ],
)
def test_tensor_bytes_of_scalars_strided_and_empty_tensors(tensor):
    from shardserve.core.wire import byte_view, tensor_bytes

    raw = bytes(tensor_bytes(tensor))
    assert raw == tensor.contiguous().numpy().tobytes()
    back = torch.empty_like(tensor.contiguous())
    byte_view(back).numpy()[:] = list(raw)
    assert torch.equal(back, tensor)


def test_tensor_bytes_of_conjugated_and_negated_views():
    """put() of z.conj() or of a negative view sends the values the caller sees, not the unresolved storage."""
    from shardserve.core.wire import tensor_bytes

    z = torch.tensor([1 + 2j, 3 - 1j])
    assert bytes(tensor_bytes(z.conj())) == torch.tensor([1 - 2j, 3 + 1j]).numpy().tobytes()
    x = torch.tensor([1.0, -2.0])
    assert bytes(tensor_bytes(torch._neg_view(x))) == torch.tensor([-1.0, 2.0]).numpy().tobytes()
