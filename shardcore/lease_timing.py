"""When a coordinator that leads under a lease renews it, and until when it may serve.

A leader renews its lease every quarter of the lease's duration and serves only until three quarters of the
duration after the *start* of its last successful renewal, by its own monotonic clock: the lease it renewed
cannot run out (on the database's clock) before that, so it stops serving writes before another coordinator
can take over, with a quarter of the lease as the margin for the two clocks' drift and a slow renewal. A
standby tries to take the lease as often as the leader renews it, so it leads within 1.25 leases of the
leader's last renewal.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_LEASE_S = 3.0


@dataclass(frozen=True)
class LeaseTiming:
    """The timing of a lease of `duration` seconds (ValueError unless > 0)."""

    duration: float = DEFAULT_LEASE_S

    def __post_init__(self) -> None:
        if not self.duration > 0:
            raise ValueError(f"a lease lasts > 0 seconds, got {self.duration}")

    @property
    def renew_every(self) -> float:
        """Seconds between a leader's renewals, and between a standby's tries to take the lease."""
        return self.duration / 4

    @property
    def margin(self) -> float:
        """How long before its lease can run out a leader stops serving."""
        return self.duration / 4

    def serve_until(self, renewal_started: float) -> float:
        """Until when (monotonic seconds) a leader whose renewal started at `renewal_started` and succeeded may
        serve."""
        return renewal_started + self.duration - self.margin
