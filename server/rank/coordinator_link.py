"""A rank's link to the coordinator: it registers (retrying while no coordinator answers) and heartbeats,
registering again when the coordinator does not know it (a restarted coordinator, or a new leader).

With several coordinators (server/rank/coordinators.py), a heartbeat that a standby refused or that found no
one is sent again soon where it was sent (the leader named, or the next address); the new leader, which does
not know the rank, answers NOT_FOUND, and the rank registers with it, with the versions it holds and the new
leader's rendezvous store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.rank.coordinators import Coordinators, host_of
from shardserve.server.rank.jobs.groups import ProcessGroups
from shardserve.server.rank.store import ShardStore
from shardserve.server.rank.wire import held_messages

log = logging.getLogger(__name__)

MOVED_PAUSE_S = (
    0.1  # the pause before a heartbeat sent elsewhere after a failure (a failover under way)
)


def wait_before_next(sent_at: float, now: float, interval: float) -> float:
    """Seconds to wait before the next heartbeat: heartbeats start `interval` apart, however long the last one
    took to be answered (waiting a whole interval after a slow answer would make a loaded coordinator see gaps
    of the interval plus its own delay, and take a live rank for dead sooner)."""
    return min(max(sent_at + interval - now, 0.0), interval)


class CoordinatorLink:
    """Registers this rank with the leader of `coordinators` and keeps it alive with heartbeats."""

    def __init__(
        self,
        coordinators: Coordinators,
        info: pb.RankInfo,
        store: ShardStore,
        groups: ProcessGroups | None = None,
    ) -> None:
        self.info = info
        self.store = store
        self.groups = groups
        self.interval = 1.0
        self.coordinators = coordinators
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)

    def register(self, timeout: float) -> None:
        """Register with the leader, retrying while no coordinator answers as one, for at most `timeout` s."""
        deadline = time.monotonic() + timeout
        delay = 0.1
        while True:
            address = self.coordinators.current
            try:
                self._register_once(address)
                return
            except grpc.RpcError as err:
                retry = self.coordinators.moved(address, err)
                if retry is None or time.monotonic() + delay > deadline:
                    raise
                log.debug("no leading coordinator at %s yet (%s); retrying", address, err.details())
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _register_once(self, address: str) -> None:
        self.info.memory_used_bytes = self.store.memory_used
        response = self.coordinators.stub(address).RegisterRank(
            pb.RegisterRankRequest(rank=self.info, held=held_messages(self.store.held())),
            timeout=10.0,
        )
        self.interval = response.heartbeat_interval_s or 1.0
        if self.groups is not None and response.store_port:
            self.groups.set_store(response.store_host or host_of(address), response.store_port)
        log.info(
            "rank %d registered with the coordinator at %s (heartbeat every %.2fs)",
            self.info.rank,
            address,
            self.interval,
        )

    def start(self) -> None:
        """Start heartbeating (after register() succeeded)."""
        self._thread.start()

    def _heartbeat_loop(self) -> None:
        unreachable = False
        wait = self.interval
        while not self._stop.wait(wait):
            sent_at, wait = time.monotonic(), self.interval
            address = self.coordinators.current
            request = pb.HeartbeatRequest(
                rank=self.info.rank, memory_used_bytes=self.store.memory_used
            )
            try:
                answer = self.coordinators.stub(address).Heartbeat(
                    request, timeout=max(2.0, 2 * self.interval)
                )
                # the coordinator lengthens the interval as the cluster grows
                self.interval = answer.heartbeat_interval_s or self.interval
                wait = wait_before_next(sent_at, time.monotonic(), self.interval)
                if unreachable:
                    log.info("coordinator at %s reachable again", address)
                unreachable = False
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    log.warning(
                        "coordinator at %s does not know rank %d; registering again",
                        address,
                        self.info.rank,
                    )
                    self._try(lambda: self._register_once(address))
                    continue
                if self.coordinators.moved(address, err) not in (None, address):
                    wait = min(self.interval, MOVED_PAUSE_S)  # find the leader soon
                if not unreachable:
                    unreachable = True
                    log.warning("heartbeat failed: %s %s", err.code().name, err.details())

    def _try(self, action: Callable[[], None]) -> None:
        try:
            action()
        except grpc.RpcError as err:
            log.warning("registering again failed: %s %s", err.code().name, err.details())
            self.coordinators.moved(self.coordinators.current, err)

    @property
    def stopped(self) -> bool:
        """Whether stop() ran: no heartbeat is sent any more and the heartbeat thread is gone."""
        return self._stop.is_set() and not self._thread.is_alive()

    def stop(self) -> None:
        """Stop heartbeating and close the channels (the thread may never have started)."""
        self._stop.set()
        if self._thread.is_alive():  # not started when registering failed
            self._thread.join(timeout=5.0)
        self.coordinators.close()
