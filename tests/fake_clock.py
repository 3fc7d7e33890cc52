"""A clock for code that takes one (`clock=`): time moves only when the test says, so a test of a timeout or a
lease never sleeps and never races the host's load."""

from __future__ import annotations


class FakeClock:
    """Monotonic seconds that stand still until advance()."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Let `seconds` pass."""
        if seconds < 0:
            raise ValueError(f"a monotonic clock never goes back ({seconds}s)")
        self.now += seconds
