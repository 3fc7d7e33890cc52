"""The thread that makes this coordinator lead when it can and stop before it must: `LeaseKeeper`.

Every `renew_every` seconds (shardcore/lease_timing.py) one `step`: a standby tries to take the lease
(catalog/leadership.py); when it gets a term it builds and starts the coordinator's parts for that term (a
new rendezvous store, a new epoch, the catalog opened under the term) and leads. A leader renews the lease and
extends how long it serves; a renewal refused (another coordinator took over) ends its term at once, and one
that keeps failing (the database unreachable) ends it when its serving time runs out, before the lease can
pass to another. Ending a term closes its parts (calls in flight fail with UNAVAILABLE) and makes this
coordinator a standby again. `stop` resigns, so a standby takes over without waiting for the lease to lapse.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from shardserve.core.lease_timing import LeaseTiming
from shardserve.server.coordinator.catalog.leadership import Leadership
from shardserve.server.coordinator.role import CoordinatorRole

if TYPE_CHECKING:
    from shardserve.server.coordinator.server import CoordinatorServer

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Takes and keeps the lease of `leadership` for `role`; `build(term)` makes the started server of a
    term. `clock`: monotonic seconds, for when to stop serving."""

    def __init__(
        self,
        leadership: Leadership,
        role: CoordinatorRole,
        build: Callable[[int], CoordinatorServer],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.leadership = leadership
        self.role = role
        self.timing = LeaseTiming(leadership.lease_duration)
        self.holder = f"{role.address}/{uuid.uuid4().hex[:12]}"
        # told the term of each term begun, and None when one ends (metrics, the health service)
        self.on_change: Callable[[int | None], None] = lambda term: None
        self._build = build
        self._clock = clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)

    def start(self) -> LeaseKeeper:
        """One step now (a lone candidate leads before this returns), then one every renew_every seconds."""
        self.step()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.timing.renew_every):
            self.step()

    def step(self) -> None:
        """Try to lead (a standby) or renew (a leader), once."""
        term = self.role.held_term()
        if term is None:
            self._try_lead()
        else:
            self._renew(term)

    def _try_lead(self) -> None:
        started = self._clock()
        try:
            term = self.leadership.try_acquire(self.holder, self.role.address)
            if term is None:
                self.role.saw(self.leadership.leader())
                return
        except Exception as err:  # noqa: BLE001 - the database unreachable: a standby tries again later
            log.warning("could not read or take the lease: %s", err)
            return
        log.info("coordinator at %s took the lease: term %d", self.role.address, term)
        try:
            server = self._build(term)
        except Exception:  # noqa: BLE001 - a term that cannot start is handed on, not held
            log.exception("term %d could not start; resigning", term)
            self._resign(term)
            return
        self.role.lead(term, server, serve_until=self.timing.serve_until(started))
        self.on_change(term)
        log.info("coordinator at %s leads term %d", self.role.address, term)

    def _renew(self, term: int) -> None:
        started = self._clock()
        try:
            renewed: bool | None = self.leadership.renew(term)
        except Exception as err:  # noqa: BLE001 - the database unreachable: serve on until the margin
            log.warning("term %d: renewing the lease failed: %s", term, err)
            renewed = None
        if renewed:
            self.role.extend(term, serve_until=self.timing.serve_until(started))
        elif renewed is False:
            self._end_term(term, "another coordinator took the lease")
        elif self._clock() >= self.role.serve_until():
            self._end_term(term, "the lease could not be renewed in time")

    def _end_term(self, term: int, why: str) -> None:
        server = self.role.step_down()
        self.on_change(None)
        log.warning("coordinator at %s stops leading term %d: %s", self.role.address, term, why)
        if server is not None:
            server.close()
        try:  # a standby names the leader from now on
            self.role.saw(self.leadership.leader())
        except Exception as err:  # noqa: BLE001 - the database unreachable: named at a later step
            log.debug("could not read who leads: %s", err)

    def _resign(self, term: int) -> None:
        try:
            self.leadership.resign(term)
        except Exception as err:  # noqa: BLE001 - the lease then lapses by itself
            log.warning("could not resign term %d: %s", term, err)

    def stop(self) -> None:
        """Stop trying; a leader stops serving, closes its term's parts and resigns the lease."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)
        term = self.role.held_term()
        if term is not None:
            self._end_term(term, "shutting down")
            self._resign(term)
