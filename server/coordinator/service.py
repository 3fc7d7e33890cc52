"""The Coordinator gRPC service: decodes each request, delegates to the coordinator's parts
(server/coordinator/server.py), and makes each answer from the records they return (answers.py).

Only a leader serves it: every method passes the role's gate (server/coordinator/role.py), which refuses it
with NOT_LEADER on a standby and turns the failure of a call whose term ended under it into NOT_LEADER."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from shardserve.core.dtypes import dtype_to_wire
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.server.common.access import caller
from shardserve.server.common.errors import InvalidArgument, rpc_errors
from shardserve.server.common.principals import ANONYMOUS
from shardserve.server.common.requests import (
    check_init,
    check_name,
    check_options,
    check_put_token,
    parse_metadata,
)
from shardserve.server.coordinator.answers import Answers
from shardserve.server.coordinator.catalog.messages import (
    init_from_proto,
    options_from_proto,
    snapshot_to_proto,
    with_writable,
)
from shardserve.server.coordinator.drivers.checkpoint import CheckpointStep, checkpoint_contents
from shardserve.server.coordinator.drivers.lifecycle import NewTensor
from shardserve.server.coordinator.drivers.reshard import ReshardPhase, ReshardStep
from shardserve.server.coordinator.drivers.snapshots import CreatedSnapshot
from shardserve.server.coordinator.ranks.messages import (
    held_from_proto,
    rank_from_proto,
    rank_to_proto,
    restore_from_proto,
    served_from_proto,
)
from shardserve.server.coordinator.requests import (
    check_host_id,
    check_reserve,
    commit_order,
    load_order,
    reshard_order,
    save_order,
    snapshot_order,
    snapshot_view,
)
from shardserve.server.coordinator.role import CoordinatorRole, led
from shardserve.server.coordinator.server import CoordinatorServer

_PHASES = {
    ReshardPhase.PREPARING: pb.RESHARD_PREPARING,
    ReshardPhase.MOVING: pb.RESHARD_MOVING,
    ReshardPhase.COMMITTING: pb.RESHARD_COMMITTING,
    ReshardPhase.DONE: pb.RESHARD_DONE,
}


def new_tensor(request: pb.CreateTensorRequest, *, authenticated: bool = False) -> NewTensor:
    """A CreateTensor request, checked field by field (InvalidArgument names the first bad one). An
    `authenticated` caller's writer_host_id is dropped, as CreateSnapshot drops it."""
    name = check_name(request.name)
    meta = parse_metadata(request.metadata)
    check_init(request.init, meta.dtype)
    check_options(request.options, meta)
    check_host_id(request.writer_host_id, "writer_host_id")
    return NewTensor(
        name=name,
        metadata=meta,
        init=init_from_proto(request.init),
        seed=request.seed,
        options=options_from_proto(request.options),
        overwrite=request.overwrite,
        source_version=request.source_version,
        put_token=check_put_token(request.put_token),
        writer_host_id="" if authenticated else request.writer_host_id,
        reserve=check_reserve(request),
    )


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """The Coordinator gRPC service: a thin layer over the parts of the `CoordinatorServer` of the term `role`
    leads."""

    def __init__(self, role: CoordinatorRole) -> None:
        self.role = role

    @property
    def coordinator(self) -> CoordinatorServer:
        """The parts of the term this coordinator leads (NotLeader on a standby)."""
        return self.role.leading()

    @property
    def answers(self) -> Answers:
        return self.role.leading().answers

    @rpc_errors
    @led
    def RegisterRank(
        self, request: pb.RegisterRankRequest, context: grpc.ServicerContext
    ) -> pb.RegisterRankResponse:
        coordinator = self.coordinator
        coordinator.upkeep.register(
            rank_from_proto(request.rank),
            held_from_proto(request.held),
            served=served_from_proto(request.held),
        )
        coordinator.collectives.rank_joined(request.rank.rank)
        return pb.RegisterRankResponse(
            heartbeat_interval_s=coordinator.registry.interval_of(request.rank.rank),
            store_port=coordinator.collectives.store_port,
        )

    @rpc_errors
    @led
    def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.ServicerContext
    ) -> pb.HeartbeatResponse:
        interval = self.coordinator.upkeep.heartbeat(request.rank, request.memory_used_bytes)
        return pb.HeartbeatResponse(heartbeat_interval_s=interval)

    @rpc_errors
    @led
    def ReportRestore(
        self, request: pb.RestoreProgress, context: grpc.ServicerContext
    ) -> pb.ReportRestoreResponse:
        self.coordinator.registry.report_restore(restore_from_proto(request))
        return pb.ReportRestoreResponse()

    @rpc_errors
    @led
    def ListRanks(
        self, request: pb.ListRanksRequest, context: grpc.ServicerContext
    ) -> pb.ListRanksResponse:
        return pb.ListRanksResponse(
            ranks=[rank_to_proto(info) for info in self.coordinator.registry.ranks()],
            epoch=self.coordinator.collectives.epochs.current,
            metrics_address=self.coordinator.metrics_address,
        )

    @rpc_errors
    @led
    def CreateTensor(
        self, request: pb.CreateTensorRequest, context: grpc.ServicerContext
    ) -> pb.TensorInfo:
        made = self.coordinator.lifecycle.create(
            new_tensor(request, authenticated=not _anonymous())
        )
        answer = self.answers.tensor(made.value, made.update_order)
        answer.writable.extend(made.writable)
        return answer

    @rpc_errors
    @led
    def CommitTensor(
        self, request: pb.CommitTensorRequest, context: grpc.ServicerContext
    ) -> pb.TensorInfo:
        committed = self.coordinator.lifecycle.commit(
            request.name, request.version, written_in_place=request.written_in_place
        )
        return self.answers.tensor(committed.value, committed.update_order)

    @rpc_errors
    @led
    def AbortTensor(
        self, request: pb.AbortTensorRequest, context: grpc.ServicerContext
    ) -> pb.AbortTensorResponse:
        lifecycle = self.coordinator.lifecycle
        if request.put_token and request.version:
            raise InvalidArgument("give either version or put_token, not both")
        if request.put_token:
            return pb.AbortTensorResponse(
                version=lifecycle.abort_put(request.name, request.put_token)
            )
        lifecycle.abort(request.name, request.version)
        return pb.AbortTensorResponse(version=request.version)

    @rpc_errors
    @led
    def GetTensor(
        self, request: pb.GetTensorRequest, context: grpc.ServicerContext
    ) -> pb.TensorInfo:
        return self.answers.tensor(self.coordinator.lifecycle.get(request.name))

    @rpc_errors
    @led
    def ListTensors(
        self, request: pb.ListTensorsRequest, context: grpc.ServicerContext
    ) -> pb.ListTensorsResponse:
        records = self.coordinator.lifecycle.list(request.include_pending)
        return self.answers.tensors(
            (r for r in records if _covers(r.name)), layouts_apart=request.layouts_apart
        )

    @rpc_errors
    @led
    def Reshard(
        self, request: pb.ReshardRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ReshardProgress]:
        for step in self.coordinator.reshards.reshard(reshard_order(request)):
            yield self._reshard_progress(step)

    @rpc_errors
    @led
    def InspectCheckpoint(
        self, request: pb.InspectCheckpointRequest, context: grpc.ServicerContext
    ) -> pb.InspectCheckpointResponse:
        return pb.InspectCheckpointResponse(
            tensors=[
                pb.CheckpointEntry(name=name, size=size, dtype=pb.DType.Name(dtype_to_wire(dtype)))
                for name, (size, dtype) in checkpoint_contents(request.path).items()
            ]
        )

    @rpc_errors
    @led
    def LoadCheckpoint(
        self, request: pb.LoadCheckpointRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.CheckpointProgress]:
        for step in self.coordinator.checkpoints.load(load_order(request)):
            yield self._checkpoint_progress(step)

    @rpc_errors
    @led
    def SaveCheckpoint(
        self, request: pb.SaveCheckpointRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.CheckpointProgress]:
        for step in self.coordinator.checkpoints.save(save_order(request)):
            yield self._checkpoint_progress(step)

    @rpc_errors
    @led
    def DeleteTensor(
        self, request: pb.DeleteTensorRequest, context: grpc.ServicerContext
    ) -> pb.DeleteTensorResponse:
        self.coordinator.lifecycle.drop(request.name)
        return pb.DeleteTensorResponse()

    @rpc_errors
    @led
    def CreateSnapshot(
        self, request: pb.CreateSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.SnapshotInfo:
        order = snapshot_order(request, authenticated=not _anonymous())
        return _created(self.coordinator.snapshots.create(order))

    @rpc_errors
    @led
    def CommitSnapshot(
        self, request: pb.CommitSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.CommitSnapshotResponse:
        view = snapshot_view(request.view)
        committed = self.coordinator.snapshots.commit(commit_order(request))
        answer = pb.CommitSnapshotResponse(committed=self.answers.snapshot(committed.record, view))
        if committed.next is not None:
            answer.next.CopyFrom(_created(committed.next))
        if view != pb.SNAPSHOT_VIEW_FULL:
            self.answers.prepare_snapshot(committed.record)
        return answer

    @rpc_errors
    @led
    def TakeReservedSnapshot(
        self, request: pb.TakeReservedSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.SnapshotInfo:
        return _created(self.coordinator.snapshots.take_reserved(request.prefix, request.committed))

    @rpc_errors
    @led
    def AbortSnapshot(
        self, request: pb.AbortSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.AbortSnapshotResponse:
        self.coordinator.snapshots.abort(request.prefix, request.number)
        return pb.AbortSnapshotResponse()

    @rpc_errors
    @led
    def GetSnapshot(
        self, request: pb.GetSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.SnapshotInfo:
        snapshot = self.coordinator.snapshots.get(request.prefix, request.number)
        return self.answers.snapshot(snapshot)

    @rpc_errors
    @led
    def ListSnapshots(
        self, request: pb.ListSnapshotsRequest, context: grpc.ServicerContext
    ) -> pb.ListSnapshotsResponse:
        snapshots = [
            s for s in self.coordinator.snapshots.list(request.prefix) if _covers(s.prefix)
        ]
        return pb.ListSnapshotsResponse(snapshots=[self.answers.snapshot(s) for s in snapshots])

    def _reshard_progress(self, step: ReshardStep) -> pb.ReshardProgress:
        progress = pb.ReshardProgress(
            phase=_PHASES[step.phase],
            bytes_done=step.bytes_done,
            bytes_total=step.bytes_total,
            version=step.version,
            max_new_shard_bytes=step.max_new_shard_bytes,
            max_staging_bytes=step.max_staging_bytes,
            mapped_bytes=step.mapped_bytes,
            sent_bytes=step.sent_bytes,
        )
        if step.tensor is not None:
            progress.tensor.CopyFrom(self.answers.tensor(step.tensor))
        return progress

    def _checkpoint_progress(self, step: CheckpointStep) -> pb.CheckpointProgress:
        return pb.CheckpointProgress(
            bytes_done=step.bytes_done,
            bytes_total=step.bytes_total,
            done=step.done,
            tensors=[self.answers.tensor(r) for r in step.tensors],
        )


def _anonymous() -> bool:
    """Whether the caller is not authenticated (a server without client auth, or no interceptor)."""
    principal = caller()
    return principal is None or principal.name == ANONYMOUS


def _covers(name: str) -> bool:
    """Whether the calling principal's tensor patterns cover `name`: listings show only those (a server
    without client auth, or a call without the interceptor, lists everything)."""
    principal = caller()
    return principal is None or principal.covers(name)


def _created(created: CreatedSnapshot) -> pb.SnapshotInfo:
    """A pending snapshot as CreateSnapshot answers it: every entry, with the shards opened for its writer."""
    return with_writable(snapshot_to_proto(created.record), created.writable)
