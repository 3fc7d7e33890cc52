"""The client's calls to the coordinators: one place that finds the leader and follows it.

A client is given one coordinator or several ("A,B": coordinators sharing one catalog, one of which leads). It
calls the one it takes for the leader (shardcore/coordinator_addresses.py). A standby answers UNAVAILABLE,
reason NOT_LEADER, naming the leader: the call goes there at once. An answer that names no leader (none is
known yet), or a coordinator that cannot be reached when there are others, sends the call to the next
address after a short pause, again and again within the call's deadline: so a new client's first call, and
any call during a failover, waits for the new leader instead of failing. A call that ran out its deadline at
one coordinator (hung, or paused) is raised, and the next call starts at the next address. With one address,
a coordinator that cannot be reached fails the call at once, as it always did.

A call refused with NOT_LEADER changed nothing; a call cut off with the connection may have been made before
the coordinator died, so calls are repeated at the new leader at least once: the put lifecycle allows it
(client/session.py: a commit of a committed version answers it; a create whose answer was lost leaves a
pending version that the coordinator aborts after its pending timeout).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from shardserve.client.channel import Channel
from shardserve.client.errors import ShardServeError, error_from_rpc
from shardserve.client.info import CoordinatorStatus
from shardserve.core.coordinator_addresses import CoordinatorAddresses, parse_addresses
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.protos.errors import error_detail_of, leader_of

FIRST_PAUSE_S = 0.05  # the pause before asking the next coordinator, doubling up to MAX_PAUSE_S
MAX_PAUSE_S = 0.5
STREAM_SLACK_S = 60.0  # a progress stream's deadline beyond the bound of the work it follows
ROLE_TIMEOUT_S = 5.0  # how long `roles()` waits for each coordinator's answer


@dataclass(frozen=True)
class Next:
    """Where a call goes after a failure that is not the leader's answer: `address`, after `pause` seconds."""

    address: str
    pause: float


def after_failure(
    addresses: CoordinatorAddresses, address: str, err: grpc.RpcError, pause: float
) -> Next | None:
    """Where to call after the call to `address` failed with `err` (the pause so far `pause`): None when the
    failure is the answer (raise it); the leader a NOT_LEADER answer named, at once; else the next address
    (when no leader is known, or `address` cannot be reached and there are others), after `pause`. A deadline
    run out is raised, and the next call starts at the next address (when there are others)."""
    code = err.code() if hasattr(err, "code") else None
    detail = error_detail_of(err)
    leader = leader_of(detail)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        addresses.after_failure(address, leader=None, unreachable=True)
        return None
    unreachable = code == grpc.StatusCode.UNAVAILABLE and detail.reason is None
    moved = addresses.after_failure(address, leader=leader, unreachable=unreachable)
    if moved is None:
        return None
    return Next(moved, 0.0 if leader and leader != address else pause)


class Coordinators:
    """The coordinators of `text` ("HOST:PORT[,HOST:PORT...]"), called through `channel` (its credentials,
    deadline and pool); ValueError naming `field` for a malformed list."""

    def __init__(self, text: str, channel: Channel, *, field: str = "address") -> None:
        self.addresses = CoordinatorAddresses(parse_addresses(text, field))
        self.channel = channel
        self._stubs: dict[str, pb_grpc.CoordinatorStub] = {}
        self._lock = threading.Lock()

    @property
    def where(self) -> str:
        """The coordinator called now, as errors name it."""
        return f"coordinator at {self.addresses.current}"

    def stub(self, address: str) -> pb_grpc.CoordinatorStub:
        """The (cached) Coordinator stub of `address`."""
        with self._lock:
            stub = self._stubs.get(address)
            if stub is None:
                stub = self._stubs[address] = self.channel.coordinator(address)
            return stub

    def roles(self) -> list[CoordinatorStatus]:
        """The role of every coordinator given (and of a leader they name that was not given), each asked
        once (Leadership.GetRole, which standbys answer too)."""
        asked: list[str] = list(self.addresses.addresses)
        found: list[CoordinatorStatus] = []
        while len(found) < len(asked):
            role = self._role(asked[len(found)])
            found.append(role)
            if role.leader and role.leader not in asked:
                asked.append(role.leader)
        return found

    def _role(self, address: str) -> CoordinatorStatus:
        stub = pb_grpc.LeadershipStub(self.channel.channel(address))
        try:
            info = stub.GetRole(
                pb.GetRoleRequest(), timeout=ROLE_TIMEOUT_S, metadata=self.channel.metadata
            )
        except grpc.RpcError as err:
            error = error_from_rpc(err, f"coordinator at {address}")
            return CoordinatorStatus(address, "unreachable", error=str(error))
        return CoordinatorStatus.from_proto(address, info)

    def call(self, method: str, request: Any, *, timeout: float | None = None) -> Any:
        """The unary `method` at the leader, within `timeout` (the client's deadline when None); errors as
        ShardServeErrors."""
        self.channel.check_open()
        deadline = time.monotonic() + (self.channel.timeout if timeout is None else timeout)
        return self._at_leader(
            lambda stub, left: getattr(stub, method)(
                request, timeout=left, metadata=self.channel.metadata
            ),
            deadline,
        )

    def follow(
        self,
        method: str,
        request: Any,
        work_timeout: float,
        report: Callable[[Any], None],
    ) -> list[Any]:
        """The progress stream `method` at the leader: report(message) for each, in order; returns them. Its
        deadline is `work_timeout` plus slack; a stream refused before its first message goes to the leader,
        one that failed later is raised. The call is cancelled however it ends (Ctrl-C in `report` too),
        which aborts the work on the coordinator."""
        self.channel.check_open()
        deadline = time.monotonic() + work_timeout + STREAM_SLACK_S
        messages: list[Any] = []

        def stream(stub: pb_grpc.CoordinatorStub, left: float) -> list[Any]:
            call = getattr(stub, method)(request, timeout=left, metadata=self.channel.metadata)
            try:
                for message in call:
                    messages.append(message)
                    report(message)
            except grpc.RpcError as err:
                if messages:  # under way: its work ended with it, and is not made again
                    raise _Started(err) from None
                raise
            finally:
                call.cancel()
            return messages

        try:
            return self._at_leader(stream, deadline)
        except _Started as started:
            raise error_from_rpc(started.err, self.where) from None

    def _at_leader(self, attempt: Callable[[Any, float], Any], deadline: float) -> Any:
        """`attempt(stub, seconds left)` at the coordinator taken for the leader, again where after_failure
        sends it, while the deadline allows; the error raised is the last NOT_LEADER answer when the last
        failure was a leader it named not answering."""
        address, pause = self.addresses.current, FIRST_PAUSE_S
        refusal: Refusal | None = None
        while True:
            try:
                return attempt(self.stub(address), max(deadline - time.monotonic(), 0.001))
            except grpc.RpcError as err:
                refusal = Refusal.of(err, address) or refusal
                moved = after_failure(self.addresses, address, err, pause)
                if moved is None or time.monotonic() + moved.pause >= deadline:
                    raise Refusal.last(err, address, refusal) from None
                if moved.pause:
                    time.sleep(moved.pause)
                    pause = min(2 * pause, MAX_PAUSE_S)
                address = moved.address


@dataclass(frozen=True)
class Refusal:
    """A NOT_LEADER answer and the coordinator that gave it."""

    err: grpc.RpcError
    address: str

    @classmethod
    def of(cls, err: grpc.RpcError, address: str) -> Refusal | None:
        """`err` from `address` when it is a NOT_LEADER answer, else None."""
        return cls(err, address) if leader_of(error_detail_of(err)) is not None else None

    @staticmethod
    def last(err: grpc.RpcError, address: str, refusal: Refusal | None) -> ShardServeError:
        """The error to raise when the calls end with `err` from `address`: `refusal` instead when `err` says
        only that a coordinator did not answer (the leader it named, say), else `err`."""
        detail = error_detail_of(err)
        silent = detail.reason is None and err.code() in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )
        if silent and refusal is not None:
            return error_from_rpc(refusal.err, f"coordinator at {refusal.address}")
        return error_from_rpc(err, f"coordinator at {address}")


class _Started(Exception):
    """A progress stream failed after its first message (raised as it is, never made again)."""

    def __init__(self, err: grpc.RpcError) -> None:
        super().__init__(str(err))
        self.err = err
