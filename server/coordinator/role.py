"""Whether this coordinator leads: `CoordinatorRole`, the gate every Coordinator call passes (`led`).

A coordinator leads a term: it serves the calls through the `CoordinatorServer` built for that term, until the
time its lease keeper (server/coordinator/lease_keeper.py) last extended (`serve_until`, by this process's
monotonic clock). Otherwise it is a standby and every call is refused with NotLeader (UNAVAILABLE, reason
NOT_LEADER) naming the leader it last saw. The check is one clock read and a comparison, no database round
trip; the catalog's own write transactions check the term against the database (fencing). A lone coordinator
(no lease: `sole`) leads one endless term 0.
"""

from __future__ import annotations

import functools
import inspect
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardserve.server.common.errors import NotLeader
from shardserve.server.coordinator.catalog.leadership import Lease
from shardserve.server.coordinator.role_view import Role, RoleView

if TYPE_CHECKING:  # the role is built before any server: a standby never imports torch for one
    from shardserve.server.coordinator.server import CoordinatorServer


@dataclass(frozen=True)
class _Term:
    number: int
    server: CoordinatorServer
    serve_until: float


class CoordinatorRole:
    """This coordinator's role: the server of the term it leads, or the leader it saw while it stands by."""

    def __init__(
        self,
        address: str,
        *,
        lease_duration: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.address = address
        self.lease_duration = lease_duration
        self._clock = clock
        self._held: _Term | None = None
        self._seen: Lease | None = None
        self._takeovers = 0
        self._lock = threading.Lock()

    @classmethod
    def sole(cls, server: CoordinatorServer, address: str = "") -> CoordinatorRole:
        """The role of a lone coordinator: it leads `server` at once and for good (term 0, no lease)."""
        role = cls(address)
        role.lead(0, server, serve_until=math.inf)
        return role

    # ------------------------------------------------------------ the gate

    def leading(self) -> CoordinatorServer:
        """The server of the term this coordinator leads now; NotLeader when it does not (a standby, or a
        leader past the time its lease keeper last extended)."""
        held = self._held
        if held is None or self._clock() >= held.serve_until:
            raise self._not_leader()
        return held.server

    def term(self) -> int:
        """The term this coordinator leads now; NotLeader when it does not."""
        held = self._held
        if held is None or self._clock() >= held.serve_until:
            raise self._not_leader()
        return held.number

    def check_term(self, term: int) -> None:
        """NotLeader unless this coordinator still leads `term` (a call that began in it may answer)."""
        if self.term() != term:
            raise self._not_leader()

    def current(self) -> CoordinatorServer | None:
        """The server of the term held, even past its time (the metrics of a leader stepping down), or None."""
        held = self._held
        return held.server if held is not None else None

    def _not_leader(self) -> NotLeader:
        seen = self._seen
        leader = seen.address if seen is not None and seen.address != self.address else ""
        where = (
            f"the leader is at {leader} (term {seen.term})"
            if leader and seen
            else "no leader is known yet"
        )
        metadata = {"leader": leader, "term": seen.term} if leader and seen else {"leader": ""}
        return NotLeader(
            f"the coordinator at {self.address or 'this address'} does not lead: {where}",
            metadata=metadata,
        )

    # ------------------------------------------------------------ changes (the lease keeper's)

    def lead(self, term: int, server: CoordinatorServer, *, serve_until: float) -> None:
        """Lead `term` through `server` until `serve_until` (monotonic seconds)."""
        with self._lock:
            self._held = _Term(term, server, serve_until)
            self._seen = Lease(self.address, term)
            self._takeovers += 1 if term else 0

    def extend(self, term: int, *, serve_until: float) -> None:
        """The lease of `term` was renewed: serve until `serve_until` (nothing if `term` is no longer held)."""
        with self._lock:
            held = self._held
            if held is not None and held.number == term:
                self._held = _Term(term, held.server, max(held.serve_until, serve_until))

    def serve_until(self) -> float:
        """Until when the term held may serve (-inf: none is held)."""
        held = self._held
        return held.serve_until if held is not None else -math.inf

    def held_term(self) -> int | None:
        """The term held, even past its time, or None."""
        held = self._held
        return held.number if held is not None else None

    def step_down(self) -> CoordinatorServer | None:
        """Stop leading: calls are refused from now on; returns the server of the term held, for its closing."""
        with self._lock:
            held, self._held = self._held, None
            if self._seen is not None and self._seen.address == self.address:
                self._seen = None
        return held.server if held is not None else None

    def saw(self, leader: Lease | None) -> None:
        """A standby read who leads (None: nobody): NOT_LEADER answers name it."""
        with self._lock:
            if self._held is None:
                self._seen = leader

    def view(self) -> RoleView:
        """The role now, as status and the metrics show it."""
        held, seen = self._held, self._seen
        leads = held is not None and self._clock() < held.serve_until
        return RoleView(
            role=Role.LEADER if leads else Role.STANDBY,
            address=self.address,
            term=held.number if leads and held is not None else 0,
            leader=self.address if leads else (seen.address if seen is not None else ""),
            leader_term=held.number if leads and held is not None else (seen.term if seen else 0),
            lease_duration=self.lease_duration,
            takeovers=self._takeovers,
        )


def led(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a Coordinator servicer method (unary or server-streaming; its object has `role`): refused with
    NotLeader unless this coordinator leads, and failing with NotLeader (UNAVAILABLE) whatever it failed with
    when this coordinator stopped leading the term the call began in (its server closed under it, its catalog
    write refused): the caller retries at the leader."""
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def streaming(self: Any, request: Any, context: Any) -> Any:
            term = self.role.term()
            try:
                yield from method(self, request, context)
            except Exception:
                self.role.check_term(term)
                raise

        return streaming

    @functools.wraps(method)
    def unary(self: Any, request: Any, context: Any) -> Any:
        term = self.role.term()
        try:
            return method(self, request, context)
        except Exception:
            self.role.check_term(term)
            raise

    return unary
