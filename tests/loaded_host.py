"""The coordinator options of test clusters: a rank is dead after SILENCE_S without a heartbeat.

On a loaded 2-core CI host (several test processes, each with its clusters and clients) a live rank's heartbeat
can arrive seconds late, and twice a short interval would take it for dead and fail the call under way. The test
clusters learn of a killed rank from its supervisor (the process's exit), at once, so a long silence costs them
nothing; the tests of the silence itself (a SIGSTOPped rank) set their own options.
"""

from __future__ import annotations

from shardserve.server.coordinator_process import CoordinatorOptions

SILENCE_S = 10.0


def coordinator_options(**fields: float) -> CoordinatorOptions:
    """CoordinatorOptions(**fields), a rank dead after SILENCE_S of silence."""
    return CoordinatorOptions(dead_after=SILENCE_S, **fields)  # type: ignore[arg-type]
