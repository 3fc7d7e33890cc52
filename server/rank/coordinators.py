"""A rank's channels to the coordinators it is given, and which of them it calls now: `Coordinators`.

The rank may be given several coordinators sharing one catalog ("A,B"); it calls the one it takes for the
leader (shardcore/coordinator_addresses.py): a standby's NOT_LEADER answer sends it to the leader it names,
and a coordinator that cannot be reached, does not answer in time or knows no leader sends it to the next
address. The registration and heartbeats (server/rank/coordinator_link.py) and the restore reports
(server/rank/restore_report.py) go through it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import grpc

from shardserve.core.coordinator_addresses import CoordinatorAddresses
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.protos.errors import error_detail_of, leader_of
from shardserve.server.common.auth import Security, make_channel

log = logging.getLogger(__name__)


def host_of(address: str) -> str:
    """The host of HOST:PORT (IPv6 brackets dropped)."""
    return address.rpartition(":")[0].strip("[]") or address


class Coordinators:
    """The channels of a rank to the coordinators at `addresses`, and which of them it calls now."""

    def __init__(self, addresses: Sequence[str], security: Security) -> None:
        self.addresses = CoordinatorAddresses(addresses)
        self._security = security
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, pb_grpc.CoordinatorStub] = {}
        self._lock = threading.Lock()

    @property
    def current(self) -> str:
        return self.addresses.current

    def stub(self, address: str) -> pb_grpc.CoordinatorStub:
        """The (cached) stub of `address`."""
        with self._lock:
            stub = self._stubs.get(address)
            if stub is None:
                self._channels[address] = make_channel(address, self._security)
                stub = self._stubs[address] = pb_grpc.CoordinatorStub(self._channels[address])
            return stub

    def moved(self, address: str, err: grpc.RpcError) -> str | None:
        """After the call to `address` failed with `err`: where to call again (the leader a NOT_LEADER named,
        the next address, or `address` itself when it is the only one and could not be reached); None when
        `err` is the coordinator's answer."""
        code = err.code() if hasattr(err, "code") else None
        detail = error_detail_of(err)
        unreachable = detail.reason is None and code in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )
        leader = leader_of(detail)
        moved = self.addresses.after_failure(address, leader=leader, unreachable=unreachable)
        if moved is not None and moved != address:
            log.info(
                "coordinator at %s: %s; calling %s", address, code.name if code else err, moved
            )
        return moved if moved is not None else (address if unreachable else None)

    def close(self) -> None:
        with self._lock:
            channels, self._channels, self._stubs = list(self._channels.values()), {}, {}
        for channel in channels:
            channel.close()
