"""How often ranks heartbeat, and when a rank that stopped is dead: the interval grows with the cluster.

Every heartbeat costs the coordinator one gRPC call (about half a millisecond of CPU on one core, almost all
of it gRPC's own), so a fixed interval makes the idle cost grow with the ranks: a thousand ranks at one second
take half a core. The coordinator therefore tells each rank its interval, in the RegisterRank answer and in
every Heartbeat answer: the configured interval, or longer, so that all the ranks of the world together (the
world size they declare, or the registered ranks where there are more) send at most `rate` heartbeats a second
(100 by default: about 6% of a core); the first ranks of a large world are told its interval from the start.
A rank is dead once it has been silent for DEAD_AFTER_INTERVALS of the interval it was last told (unless
`dead_after` fixes it): a dead rank is noticed within twice its interval, and a live one is taken for dead only
when a heartbeat is a whole interval late.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_RATE = 100.0
DEAD_AFTER_INTERVALS = 2.0
REREGISTER_S = 3.0
"""What a rank that outlived a coordinator restart may take past the silence that marks a rank dead to register
again: its channel's reconnect (about a second at most), the refused heartbeat and the registration, with room
for a busy host."""


@dataclass(frozen=True)
class HeartbeatPolicy:
    """The intervals ranks are told and when a silent rank is dead (seconds; see the module docstring).

    `interval`: the shortest interval; `rate`: heartbeats per second the coordinator takes from all its ranks
    together (0: no limit, every rank at `interval`); `dead_after`: a fixed silence that marks a rank dead
    (None: DEAD_AFTER_INTERVALS times the interval that rank was told)."""

    interval: float = 1.0
    rate: float = DEFAULT_RATE
    dead_after: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.interval < math.inf:
            raise ValueError(f"--heartbeat-interval must be > 0 seconds, got {self.interval}")
        if not 0 <= self.rate < math.inf:
            raise ValueError(f"--heartbeat-rate must be >= 0 (0: no limit), got {self.rate}")
        if self.dead_after is not None and not 0 < self.dead_after < math.inf:
            raise ValueError(f"--dead-after must be > 0 seconds, got {self.dead_after}")

    def interval_for(self, ranks: int) -> float:
        """The interval to tell each of `ranks` registered ranks."""
        if not self.rate:
            return self.interval
        return max(self.interval, ranks / self.rate)

    def dead_after_for(self, interval: float) -> float:
        """Seconds of silence that mark dead a rank told `interval`."""
        return self.dead_after if self.dead_after is not None else DEAD_AFTER_INTERVALS * interval

    def unregistered_grace(self, world: int) -> float:
        """Seconds after a coordinator began during which a rank of a `world` that never registered with it is
        not dead yet: a rank that outlived a coordinator restart registers again at its next heartbeat, so this
        is the silence that marks a registered rank dead at the interval a world of that size is told, and
        REREGISTER_S more (0 ranks known: the shortest interval)."""
        return self.dead_after_for(self.interval_for(world)) + REREGISTER_S
