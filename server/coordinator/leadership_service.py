"""The Leadership gRPC service: every coordinator, leader or standby, says what it does now and whom it knows
to lead (`shardserve status` asks each coordinator it is given)."""

from __future__ import annotations

import grpc

from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.server.common.errors import rpc_errors
from shardserve.server.coordinator.role import CoordinatorRole
from shardserve.server.coordinator.role_view import Role, RoleView

_ROLES = {Role.LEADER: pb.ROLE_LEADER, Role.STANDBY: pb.ROLE_STANDBY}


def role_to_proto(view: RoleView) -> pb.RoleInfo:
    """The RoleInfo answer of `view`."""
    return pb.RoleInfo(
        role=_ROLES[view.role],
        address=view.address,
        term=view.term,
        leader_address=view.leader,
        leader_term=view.leader_term,
        lease_duration_s=view.lease_duration,
        takeovers=view.takeovers,
    )


class LeadershipServicer(pb_grpc.LeadershipServicer):
    """Answers GetRole from this coordinator's `role`, whatever it is."""

    def __init__(self, role: CoordinatorRole) -> None:
        self.role = role

    @rpc_errors
    def GetRole(self, request: pb.GetRoleRequest, context: grpc.ServicerContext) -> pb.RoleInfo:
        return role_to_proto(self.role.view())
