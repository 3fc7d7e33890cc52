"""The catalog's calls as both clients send them: each request built from checked arguments, each answer read.

The blocking `Cluster` and the asyncio `AsyncCluster` ask the coordinator the same questions (which tensors,
which ranks, drop a tensor, which snapshots); this module is where those requests are made and their answers
turned into the client's own types, so that neither client builds a protobuf message itself.
"""

from __future__ import annotations

from shardserve.client import arguments
from shardserve.client.info import RankStatus, TensorSummary, layout_of
from shardserve.protos import shardserve_pb2 as pb


def list_tensors_request(include_pending: bool) -> pb.ListTensorsRequest:
    """ListTensors of every READY tensor (and the PENDING ones with `include_pending`), each distinct layout
    sent once."""
    return pb.ListTensorsRequest(
        include_pending=arguments.flag(include_pending, "include_pending"), layouts_apart=True
    )


def tensors_listed(reply: pb.ListTensorsResponse, include_pending: bool) -> list[TensorSummary]:
    """The tensors of a ListTensors answer, sorted by name: READY ones (and PENDING ones when asked). Each of
    the answer's layouts is decoded once; an answer without any (a coordinator that sends each tensor's layout
    in full) is read as well."""
    layouts = (
        [layout_of(msg, f"layout {index}") for index, msg in enumerate(reply.layouts)]
        if len(reply.layouts)
        else None
    )
    tensors = [TensorSummary.from_proto(t, layouts) for t in reply.tensors]
    return sorted(
        (t for t in tensors if include_pending or t.state == "READY"), key=lambda t: t.name
    )


def get_tensor_request(name: str) -> pb.GetTensorRequest:
    """GetTensor of the READY version of `name` (a checked tensor name)."""
    return pb.GetTensorRequest(name=arguments.tensor_name(name))


def delete_tensor_request(name: str) -> pb.DeleteTensorRequest:
    """DeleteTensor of every version of `name` (a checked tensor name)."""
    return pb.DeleteTensorRequest(name=arguments.tensor_name(name))


def list_ranks_request() -> pb.ListRanksRequest:
    """ListRanks: every registered rank, the epoch of collective jobs, the metrics endpoints."""
    return pb.ListRanksRequest()


def ranks_listed(reply: pb.ListRanksResponse) -> list[RankStatus]:
    """The ranks of a ListRanks answer, sorted by rank."""
    return sorted((RankStatus.from_proto(r) for r in reply.ranks), key=lambda r: r.rank)


def list_snapshots_request(prefix: str) -> pb.ListSnapshotsRequest:
    """ListSnapshots of the kept snapshots of `prefix` (a checked tensor name)."""
    return pb.ListSnapshotsRequest(prefix=arguments.tensor_name(prefix, "prefix"))
