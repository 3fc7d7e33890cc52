"""No client can starve a server: bounded streaming calls per principal, capacity kept for small calls, and
stalled streams cancelled.

A streaming call (client- or server-streaming) holds one of the server's gRPC
threads for its whole life, and a peer that stops reading (or sending) holds it
for ever. So:

- at most `max_streams` streaming calls run at once; `small_calls` threads of
  the pool are never given to streams, so unary calls (lookups, health,
  control) always find one;
- one principal (or, without client auth, one peer IP) runs at most
  `per_principal` of them (a principal's `max_streams` in the tokens file
  overrides); a call over a limit waits up to `admit_wait` seconds for a slot
  (at most `max_waiting` calls wait at once), then gets RESOURCE_EXHAUSTED;
- a watched stream (the bulk reads and writes: ReadRegion, Lookup, WriteShard)
  that moves no message for `stall_timeout` seconds (a reader that stopped
  reading, a writer that stopped sending) is cancelled, freeing its thread.

Calls made with the cluster credential (collective jobs, which wait on each
other for minutes) are not limited.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from shardserve.protos.errors import Reason
from shardserve.server.common.access import replace_behavior
from shardserve.server.common.errors import abort
from shardserve.server.common.principals import ANONYMOUS, CLUSTER_PRINCIPAL, Principal

log = logging.getLogger(__name__)

WATCHED_METHODS = frozenset(
    {
        "/shardserve.v1.ShardServer/ReadRegion",
        "/shardserve.v1.ShardServer/Lookup",
        "/shardserve.v1.ShardServer/WriteShard",
    }
)
DEFAULT_STALL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class StreamLimitSettings:
    """The numbers of one server's limits (see the module docstring)."""

    workers: int = 64
    small_calls: int = 16
    per_principal: int = 24
    max_waiting: int = 8
    admit_wait: float = 2.0
    stall_timeout: float = DEFAULT_STALL_TIMEOUT_S

    def __post_init__(self) -> None:
        if not 0 < self.small_calls + self.max_waiting < self.workers:
            raise ValueError(
                f"small_calls {self.small_calls} + max_waiting {self.max_waiting} must leave "
                f"threads for streams out of {self.workers} workers"
            )
        if self.per_principal < 1:
            raise ValueError(f"per_principal must be >= 1, got {self.per_principal}")
        if not self.stall_timeout > 0:
            raise ValueError(f"--stall-timeout must be > 0 seconds, got {self.stall_timeout}")

    @property
    def max_streams(self) -> int:
        return self.workers - self.small_calls - self.max_waiting


class _Watched:
    """One watched stream: its context and when it last moved a message."""

    __slots__ = ("context", "method", "who", "moved")

    def __init__(self, context: grpc.ServicerContext, method: str, who: str) -> None:
        self.context, self.method, self.who = context, method, who
        self.moved = time.monotonic()


class StreamLimits:
    """Admission of streaming calls and the stall watchdog of one server; `wrap` is the AccessInterceptor hook."""

    def __init__(self, settings: StreamLimitSettings = StreamLimitSettings()) -> None:
        self.settings = settings
        self._lock = threading.Condition()
        self._running = 0
        self._waiting = 0
        self._by_key: dict[str, int] = {}
        self._watched: dict[int, _Watched] = {}
        self.cancelled_stalls = 0
        self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def wrap(
        self, principal: Principal, method: str, handler: grpc.RpcMethodHandler
    ) -> grpc.RpcMethodHandler:
        """`handler` admitted against the limits and, for watched methods, watched for stalls."""
        if (
            not (handler.request_streaming or handler.response_streaming)
            or principal.name == CLUSTER_PRINCIPAL
        ):
            return handler
        limit = principal.max_streams or self.settings.per_principal
        watched = method in WATCHED_METHODS
        if handler.request_streaming:
            behavior = handler.stream_stream or handler.stream_unary
        else:
            behavior = handler.unary_stream

        def run(request: Any, context: grpc.ServicerContext) -> Any:
            key = (
                principal.name
                if principal.name != ANONYMOUS
                else f"peer {_peer_host(context.peer())}"
            )
            self._admit(key, limit, context, method)
            slot = _Slot(self, key, self._watch_call(context, method, key) if watched else None)
            context.add_callback(slot.release)  # however the call ends, cancelled included
            if slot.entry is not None and handler.request_streaming:
                request = _moving(request, slot.entry)
            try:
                answer = behavior(request, context)
            except BaseException:
                slot.release()
                raise
            if handler.response_streaming:
                return _released_after(answer, slot)
            slot.release()
            return answer

        return replace_behavior(handler, run)

    # ------------------------------------------------------------ admission

    def _admit(self, key: str, limit: int, context: grpc.ServicerContext, method: str) -> None:
        deadline = time.monotonic() + self.settings.admit_wait
        with self._lock:
            if not self._fits(key, limit) and self._waiting >= self.settings.max_waiting:
                self._refuse(context, key, limit, method)
            self._waiting += 1
            try:
                while not self._fits(key, limit):
                    left = deadline - time.monotonic()
                    if left <= 0 or not context.is_active():
                        self._refuse(context, key, limit, method)
                    self._lock.wait(left)
            finally:
                self._waiting -= 1
            self._running += 1
            self._by_key[key] = self._by_key.get(key, 0) + 1

    def _fits(self, key: str, limit: int) -> bool:
        return self._running < self.settings.max_streams and self._by_key.get(key, 0) < limit

    def _refuse(self, context: grpc.ServicerContext, key: str, limit: int, method: str) -> None:
        self.refused += 1
        held = self._by_key.get(key, 0)
        message = (
            f"too many streaming calls: {key} holds {held} of its {limit}"
            if held >= limit
            else f"too many streaming calls: this server runs {self._running} of its {self.settings.max_streams}"
        )
        log.warning("refused %s: %s", method, message)
        abort(
            context,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            message + "; retry later",
            reason=Reason.OVERLOADED,
            metadata={"peer": key},
        )

    def release_slot(self, key: str, entry: _Watched | None) -> None:
        with self._lock:
            self._running -= 1
            left = self._by_key[key] - 1
            if left:
                self._by_key[key] = left
            else:
                del self._by_key[key]
            if entry is not None:
                self._watched.pop(id(entry), None)
            self._lock.notify_all()

    # ------------------------------------------------------------ stalls

    def _watch_call(self, context: grpc.ServicerContext, method: str, key: str) -> _Watched:
        entry = _Watched(context, method, key)
        with self._lock:
            self._watched[id(entry)] = entry
        return entry

    def _watch(self) -> None:
        period = min(1.0, self.settings.stall_timeout / 4)
        while not self._stop.wait(period):
            now = time.monotonic()
            with self._lock:
                stalled = [
                    e for e in self._watched.values() if now - e.moved > self.settings.stall_timeout
                ]
                for entry in stalled:
                    self._watched.pop(id(entry), None)
            for entry in stalled:
                self.cancelled_stalls += 1
                log.warning(
                    "cancelled %s of %s (%s): no message moved for %.1fs (--stall-timeout)",
                    entry.method,
                    entry.who,
                    entry.context.peer(),
                    self.settings.stall_timeout,
                )
                entry.context.cancel()


class _Slot:
    """One admitted call's place in the limits, given back exactly once."""

    def __init__(self, limits: StreamLimits, key: str, entry: _Watched | None) -> None:
        self.limits, self.key, self.entry = limits, key, entry
        self._released = threading.Lock()

    def release(self) -> None:
        if self._released.acquire(blocking=False):
            self.limits.release_slot(self.key, self.entry)

    def moved(self) -> None:
        if self.entry is not None:
            self.entry.moved = time.monotonic()


def _released_after(answers: Iterator[Any], slot: _Slot) -> Iterator[Any]:
    try:
        for answer in answers:
            slot.moved()
            yield answer
            slot.moved()
    finally:
        slot.release()


def _moving(requests: Iterator[Any], entry: _Watched) -> Iterator[Any]:
    for request in requests:
        entry.moved = time.monotonic()
        yield request


def _peer_host(peer: str) -> str:
    """The host part of a gRPC peer string ("ipv4:1.2.3.4:5" -> "1.2.3.4")."""
    return peer.split(":", 1)[-1].rsplit(":", 1)[0] if peer.startswith(("ipv4:", "ipv6:")) else peer
