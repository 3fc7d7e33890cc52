"""Phrases for log lines that name many tensor versions at once (a batch of a state dict's versions)."""

from __future__ import annotations

from collections.abc import Sequence


def versions_phrase(versions: Sequence[tuple[str, int]], shown: int = 3) -> str:
    """(name, version) pairs for a log line: all of a few, the first `shown` and a count of many."""
    named = ", ".join(f"{name!r} version {version}" for name, version in versions[:shown])
    more = len(versions) - shown
    return f"{named} and {more} more" if more > 0 else named
