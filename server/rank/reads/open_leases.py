"""The leases OpenShard(s) hand out: time-bounded holds on a rank's versions, so that the memory a same-host
reader maps stays that version's until the reader says it is done (ReleaseShard) or the lease expires."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

from shardserve.server.rank.errors import Overloaded

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30.0
MAX_LEASES = 4096  # leases held at once per rank (each pins a version; expiry scans them all)
MAX_LEASE_S = 300.0


class Leases:
    """Time-bounded holds on store versions, taken by OpenShard and ended by ReleaseShard or expiry."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._held: dict[int, tuple[AbstractContextManager, float]] = {}
        self._lock = threading.Lock()
        self._reaper: threading.Thread | None = None

    def hold(self, lease: AbstractContextManager, seconds: float) -> int:
        """Keep `lease` (an entered store lease) for at most `seconds`; returns its id."""
        with self._lock:
            if len(self._held) >= MAX_LEASES:
                raise Overloaded(
                    f"this rank holds {MAX_LEASES} shared-memory leases already; release "
                    f"some (ReleaseShard) or wait for them to expire"
                )
            lease_id = 0
            while (
                not lease_id or lease_id in self._held
            ):  # random: no client ends another's lease by guessing
                lease_id = secrets.randbits(63)
            self._held[lease_id] = (lease, self._clock() + seconds)
            if self._reaper is None:
                self._reaper = threading.Thread(
                    target=self._reap_forever, name="shm-lease-reaper", daemon=True
                )
                self._reaper.start()
        return lease_id

    def held_ids(self) -> list[int]:
        """The ids of the leases held now."""
        with self._lock:
            return list(self._held)

    def release(self, lease_ids: list[int]) -> int:
        """End the given leases (unknown or expired ids are ignored); returns how many ended."""
        with self._lock:
            ended = [self._held.pop(i)[0] for i in lease_ids if i in self._held]
        for lease in ended:
            lease.__exit__(None, None, None)
        return len(ended)

    def expire(self) -> int:
        """End every lease past its time (a client that died or forgot); returns how many."""
        now = self._clock()
        with self._lock:
            late = [i for i, (_, until) in self._held.items() if until <= now]
        if late:
            log.info("expiring %d shared-memory leases", len(late))
        return self.release(late)

    def __len__(self) -> int:
        return len(self._held)

    def _reap_forever(self) -> None:
        while True:
            time.sleep(1.0)
            self.expire()


def lease_seconds(requested: float) -> float:
    """The lease a request gets: the default for 0, capped at MAX_LEASE_S."""
    if not requested >= 0:  # NaN too: a lease that never expires would pin its version for good
        raise ValueError(f"lease_s {requested} is negative or not a number")
    return min(requested or DEFAULT_LEASE_S, MAX_LEASE_S)
