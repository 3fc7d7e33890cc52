"""Whether this process may still run collective jobs: once one failed with a dead or hung peer, the
torch.distributed world holds abandoned operations, and every later job is refused until a restart."""
from __future__ import annotations

import threading

from server.common.errors import FailedPrecondition


class CollectivesState:
    """Usable until `mark_unusable(reason)`; then `check()` refuses with that reason."""

    def __init__(self) -> None:
        self._reason: str | None = None
        self._lock = threading.Lock()

    @property
    def unusable_reason(self) -> str | None:
        """Why collectives are refused, or None while they are usable."""
        with self._lock:
            return self._reason

    def mark_unusable(self, reason: str) -> None:
        with self._lock:
            self._reason = reason

    def check(self) -> None:
        """FailedPrecondition with the reason once collectives are unusable."""
        reason = self.unusable_reason
        if reason is not None:
            raise FailedPrecondition(reason)
