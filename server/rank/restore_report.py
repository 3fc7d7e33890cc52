"""A rank's restore from its persist dir before it registers, with its progress told to the coordinator (what
`shardserve status` shows of a restarting rank)."""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import replace

import grpc

from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.rank.coordinators import Coordinators
from shardserve.server.rank.persistence import RestoreCount
from shardserve.server.rank.store import ShardStore

log = logging.getLogger(__name__)

RESTORE_HOLD_ENV = "SHARDSERVE_DEBUG_RESTORE_HOLD"  # PATH: after its first tensor, a restore waits while PATH exists
RESTORE_HOLD_MAX_S = 120.0


class RestoreReporter:
    """Tells the coordinator how far this rank's restore is (ReportRestore), at most every REPORT_EVERY_S and at
    the end, so `shardserve status` shows it; a coordinator not reachable yet only misses reports."""

    REPORT_EVERY_S = 0.5

    def __init__(self, coordinators: Coordinators, rank: int) -> None:
        self.coordinators = coordinators
        self.rank = rank
        self.last = RestoreCount()
        self._reported_at = 0.0

    def __call__(self, count: RestoreCount) -> None:
        """Record `count`; report it when the last report is old enough or the restore reached its end."""
        self.last = replace(count)
        hold = os.environ.get(RESTORE_HOLD_ENV, "")
        held = bool(hold) and count.done_tensors >= 1 and os.path.exists(hold)
        if (
            held
            or time.monotonic() - self._reported_at >= self.REPORT_EVERY_S
            or count.done_tensors == count.total_tensors
        ):
            self._report(loaded=False)
        if held:
            self._hold_while_exists(hold)

    def finish(self) -> None:
        """Report that every file is read (the rank registers next)."""
        self._report(loaded=True)

    def _hold_while_exists(self, path: str) -> None:
        """Debug hook of the restore tests: pause the restore while `path` exists (at most RESTORE_HOLD_MAX_S),
        reporting the progress again every REPORT_EVERY_S: a report that missed its deadline (a loaded host)
        would otherwise leave the coordinator without the progress the test waits to see."""
        log.warning("rank %d: restore held while %s exists (%s)", self.rank, path, RESTORE_HOLD_ENV)
        deadline = time.monotonic() + RESTORE_HOLD_MAX_S
        while os.path.exists(path) and time.monotonic() < deadline:
            if time.monotonic() - self._reported_at >= self.REPORT_EVERY_S:
                self._report(loaded=False)
            time.sleep(0.05)

    def _report(self, loaded: bool) -> None:
        self._reported_at = time.monotonic()
        count = self.last
        log.info(
            "rank %d restoring: %d of %d bytes, %d of %d tensors",
            self.rank,
            count.done_bytes,
            count.total_bytes,
            count.done_tensors,
            count.total_tensors,
        )
        progress = pb.RestoreProgress(
            rank=self.rank,
            pid=os.getpid(),
            hostname=socket.gethostname(),
            done_bytes=count.done_bytes,
            total_bytes=count.total_bytes,
            done_tensors=count.done_tensors,
            total_tensors=count.total_tensors,
            loaded=loaded,
        )
        address = self.coordinators.current
        try:
            self.coordinators.stub(address).ReportRestore(progress, timeout=2.0)
        except grpc.RpcError as err:  # the next report goes to the leader, if this one named it
            log.debug("restore progress not reported: %s", err.details())
            self.coordinators.moved(address, err)


def restore(store: ShardStore, reporter: RestoreReporter) -> None:
    """Load what the persist dir holds before registering, so the rank registers holding it; the coordinator
    sees the progress (and admits reads of these tensors only once they are promoted again)."""
    if store.persistence is None:
        return
    started = time.monotonic()
    log.info("rank %d restoring from %s", store.rank, store.persistence.root)
    restored = store.restore(reporter)
    reporter.finish()
    log.info(
        "rank %d restored %d versions (%d bytes) in %.2fs: %s",
        store.rank,
        len(restored),
        store.memory_used,
        time.monotonic() - started,
        restored,
    )
