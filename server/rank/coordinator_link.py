"""A rank's link to the coordinator: it registers (retrying while the coordinator is unreachable) and heartbeats,
registering again when the coordinator does not know it (a restarted coordinator)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.server.common.auth import Security, make_channel
from shardserve.server.rank.jobs.groups import ProcessGroups
from shardserve.server.rank.store import ShardStore

log = logging.getLogger(__name__)


class CoordinatorLink:
    """Registers this rank with the coordinator and keeps it alive with heartbeats."""

    def __init__(
        self,
        address: str,
        security: Security,
        info: pb.RankInfo,
        store: ShardStore,
        groups: ProcessGroups | None = None,
    ) -> None:
        self.info = info
        self.store = store
        self.groups = groups
        self.coordinator_host = (
            address.rpartition(":")[0].strip("[]") or address
        )  # the store is on its host
        self.interval = 1.0
        self._channel = make_channel(address, security)
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)

    def register(self, timeout: float) -> None:
        """Register, retrying while the coordinator is unreachable, for at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        delay = 0.1
        while True:
            try:
                self._register_once()
                return
            except grpc.RpcError as err:
                if (
                    err.code()
                    not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                    or time.monotonic() + delay > deadline
                ):
                    raise
                log.debug("coordinator not reachable yet (%s); retrying", err.details())
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _register_once(self) -> None:
        self.info.memory_used_bytes = self.store.memory_used
        held = [pb.HeldVersion(name=n, version=v) for n, v, _ in self.store.held()]
        response = self._stub.RegisterRank(
            pb.RegisterRankRequest(rank=self.info, held=held), timeout=10.0
        )
        self.interval = response.heartbeat_interval_s or 1.0
        if self.groups is not None and response.store_port:
            self.groups.set_store(response.store_host or self.coordinator_host, response.store_port)
        log.info(
            "rank %d registered with the coordinator (heartbeat every %.2fs)",
            self.info.rank,
            self.interval,
        )

    def start(self) -> None:
        """Start heartbeating (after register() succeeded)."""
        self._thread.start()

    def _heartbeat_loop(self) -> None:
        unreachable = False
        while not self._stop.wait(self.interval):
            request = pb.HeartbeatRequest(
                rank=self.info.rank, memory_used_bytes=self.store.memory_used
            )
            try:
                answer = self._stub.Heartbeat(request, timeout=max(2.0, 2 * self.interval))
                # the coordinator lengthens the interval as the cluster grows
                self.interval = answer.heartbeat_interval_s or self.interval
                if unreachable:
                    log.info("coordinator reachable again")
                unreachable = False
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    log.warning(
                        "coordinator does not know rank %d; registering again", self.info.rank
                    )
                    self._try(self._register_once)
                elif not unreachable:
                    unreachable = True
                    log.warning("heartbeat failed: %s %s", err.code().name, err.details())

    def _try(self, action: Callable[[], None]) -> None:
        try:
            action()
        except grpc.RpcError as err:
            log.warning("registering again failed: %s %s", err.code().name, err.details())

    @property
    def stopped(self) -> bool:
        """Whether stop() ran: no heartbeat is sent any more and the heartbeat thread is gone."""
        return self._stop.is_set() and not self._thread.is_alive()

    def stop(self) -> None:
        """Stop heartbeating and close the channel (the thread may never have started)."""
        self._stop.set()
        if self._thread.is_alive():  # not started when registering failed
            self._thread.join(timeout=5.0)
        self._channel.close()
