"""The Coordinator gRPC service: decodes each request and delegates to the `Coordinator` (lifecycle) or its
reshard and checkpoint drivers."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.server.common.errors import InvalidArgument, rpc_errors
from shardserve.server.coordinator.checkpoint import inspect_checkpoint
from shardserve.server.coordinator.lifecycle import Coordinator


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """The Coordinator gRPC service: a thin layer over `Coordinator`."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    @rpc_errors
    def RegisterRank(
        self, request: pb.RegisterRankRequest, context: grpc.ServicerContext
    ) -> pb.RegisterRankResponse:
        interval = self.coordinator.register(request.rank, request.held)
        collectives = self.coordinator.collectives
        collectives.rank_joined(request.rank.rank)
        return pb.RegisterRankResponse(
            heartbeat_interval_s=interval, store_port=collectives.rendezvous.port
        )

    @rpc_errors
    def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.ServicerContext
    ) -> pb.HeartbeatResponse:
        self.coordinator.heartbeat(request.rank, request.memory_used_bytes)
        return pb.HeartbeatResponse()

    @rpc_errors
    def ReportRestore(
        self, request: pb.RestoreProgress, context: grpc.ServicerContext
    ) -> pb.ReportRestoreResponse:
        self.coordinator.registry.report_restore(request)
        return pb.ReportRestoreResponse()

    @rpc_errors
    def ListRanks(
        self, request: pb.ListRanksRequest, context: grpc.ServicerContext
    ) -> pb.ListRanksResponse:
        return pb.ListRanksResponse(
            ranks=self.coordinator.registry.ranks(),
            epoch=self.coordinator.collectives.epochs.current,
            metrics_address=self.coordinator.metrics_address,
        )

    @rpc_errors
    def CreateTensor(
        self, request: pb.CreateTensorRequest, context: grpc.ServicerContext
    ) -> pb.TensorInfo:
        return self.coordinator.create(request)

    @rpc_errors
    def CommitTensor(
        self, request: pb.CommitTensorRequest, context: grpc.ServicerContext
    ) -> pb.TensorInfo:
        return self.coordinator.commit(request.name, request.version)

    @rpc_errors
    def AbortTensor(
        self, request: pb.AbortTensorRequest, context: grpc.ServicerContext
    ) -> pb.AbortTensorResponse:
        if request.put_token and request.version:
            raise InvalidArgument("give either version or put_token, not both")
        if request.put_token:
            return pb.AbortTensorResponse(
                version=self.coordinator.abort_put(request.name, request.put_token)
            )
        self.coordinator.abort(request.name, request.version)
        return pb.AbortTensorResponse(version=request.version)

    @rpc_errors
    def GetTensor(
        self, request: pb.GetTensorRequest, context: grpc.ServicerContext
    ) -> pb.TensorInfo:
        return self.coordinator.get(request.name)

    @rpc_errors
    def ListTensors(
        self, request: pb.ListTensorsRequest, context: grpc.ServicerContext
    ) -> pb.ListTensorsResponse:
        return pb.ListTensorsResponse(tensors=self.coordinator.list(request.include_pending))

    @rpc_errors
    def Reshard(
        self, request: pb.ReshardRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ReshardProgress]:
        yield from self.coordinator.reshards.reshard(request)

    @rpc_errors
    def InspectCheckpoint(
        self, request: pb.InspectCheckpointRequest, context: grpc.ServicerContext
    ) -> pb.InspectCheckpointResponse:
        return inspect_checkpoint(request.path)

    @rpc_errors
    def LoadCheckpoint(
        self, request: pb.LoadCheckpointRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.CheckpointProgress]:
        yield from self.coordinator.checkpoints.load(request)

    @rpc_errors
    def SaveCheckpoint(
        self, request: pb.SaveCheckpointRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.CheckpointProgress]:
        yield from self.coordinator.checkpoints.save(request)

    @rpc_errors
    def DeleteTensor(
        self, request: pb.DeleteTensorRequest, context: grpc.ServicerContext
    ) -> pb.DeleteTensorResponse:
        self.coordinator.delete(request.name)
        return pb.DeleteTensorResponse()

    @rpc_errors
    def CreateSnapshot(
        self, request: pb.CreateSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.SnapshotInfo:
        return self.coordinator.snapshots.create(request)

    @rpc_errors
    def CommitSnapshot(
        self, request: pb.CommitSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.SnapshotInfo:
        return self.coordinator.snapshots.commit(request.prefix, request.number)

    @rpc_errors
    def AbortSnapshot(
        self, request: pb.AbortSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.AbortSnapshotResponse:
        self.coordinator.snapshots.abort(request.prefix, request.number)
        return pb.AbortSnapshotResponse()

    @rpc_errors
    def GetSnapshot(
        self, request: pb.GetSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.SnapshotInfo:
        return self.coordinator.snapshots.get(request.prefix, request.number)

    @rpc_errors
    def ListSnapshots(
        self, request: pb.ListSnapshotsRequest, context: grpc.ServicerContext
    ) -> pb.ListSnapshotsResponse:
        return pb.ListSnapshotsResponse(snapshots=self.coordinator.snapshots.list(request.prefix))
