"""OpenShardsForWrite towards CUDA shards, as far as a CPU can see it: a rank holding CUDA shards refuses a writer
that does not open CUDA IPC handles (naming the shard, so the writer sends the bytes), a CUDA shard's answer
carries its handle, its size and its header-only segment, and the handle survives the wire as the proto field
it is (nothing pickled). The handle itself is torch's; tests/cluster/test_cuda_state_dicts_cluster.py opens
real ones on a GPU."""

from __future__ import annotations

import os

import pytest
import torch

from shardserve.core.metadata import TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.same_host import host_id
from shardserve.server.rank.errors import PathUnavailable
from shardserve.server.rank.leases import InPlace
from shardserve.server.rank.shared_memory import Segment
from shardserve.server.rank.store import ShardStore
from shardserve.server.rank.writes import in_place

HANDLE = pb.CudaIpcHandle(
    device=0,
    handle=b"\x01" * 64,
    storage_size_bytes=1 << 20,
    storage_offset_bytes=512,
    ref_counter_handle=b"/torch_1_2",
    ref_counter_offset=3,
    event_handle=b"\x02" * 64,
    event_sync_required=True,
    tensor_offset=16,
)


def _request(store: ShardStore, *, cuda_ipc: bool) -> pb.OpenShardsForWriteRequest:
    meta = ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata(
        (4, 3), TensorProperties(dtype=torch.float32)
    )
    store.allocate("t", 1, meta)
    header = pb.WriteShardHeader(name="t", version=1, shard_index=0, dtype=pb.FLOAT32, nbytes=48)
    return pb.OpenShardsForWriteRequest(shards=[header], host_id=host_id(), cuda_ipc=cuda_ipc)


def test_a_cuda_rank_refuses_a_writer_that_does_not_open_ipc_handles() -> None:
    store = ShardStore(0, shared_memory=True)
    request = _request(store, cuda_ipc=False)
    store.device = torch.device("cuda", 0)  # as a rank on cuda:0 sees itself
    with pytest.raises(PathUnavailable, match="ask with cuda_ipc") as caught:
        in_place.open_for_write(store, request)
    assert (
        caught.value.metadata["field"] == "shards[0]"
    )  # this batch only: the writer sends its bytes


def test_a_cuda_shards_answer_carries_its_handle_size_and_header(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shard = torch.zeros(4, 3)  # stands for the CUDA shard
    monkeypatch.setattr(
        in_place, "cuda_ipc_handle", lambda tensor: HANDLE if tensor is shard else None
    )
    header = Segment(os.getpid(), 7, 11, 13, 0, data_offset=0)
    answer = in_place.writable_segment(InPlace(header, False, shard))
    assert (answer.pid, answer.fd, answer.inode, answer.device_id) == (os.getpid(), 7, 11, 13)
    assert answer.data_offset == 0 and answer.nbytes == 48 and not answer.sealed
    parsed = pb.WritableSegment.FromString(answer.SerializeToString())
    assert parsed.HasField("cuda") and parsed.cuda == HANDLE


def test_a_shared_memory_shards_answer_has_no_handle() -> None:
    store = ShardStore(0, shared_memory=True)
    (answer,) = in_place.open_for_write(store, _request(store, cuda_ipc=True))
    assert not answer.HasField("cuda") and answer.nbytes == 48 and answer.data_offset == 4096
