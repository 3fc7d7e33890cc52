"""The coordinator's repair loop: tensors that lost copies get them back from live replicas, by themselves.

A copy is due for repair when its rank came back without it (a restart: the
copy is in the catalog row's lost_shards) or its rank has been dead for
`repair_after` seconds. Once every unavailable copy of a tensor is due, the
loop plans the repaired layout (shardcore.repair: the copy's own rank when it
is back, else another live rank, on another host where possible) and runs it
as a reshard that reads only the available copies: a new version, committed
in one catalog transaction, reads on the old version until then, aborted
whole on failure and tried again on a later round. Tensors are repaired one
at a time, with the reshard's bucket rule bounding the bytes in flight per
rank. A box with no copy left cannot be repaired: the tensor stays "lost".
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.repair import LiveRank, RepairImpossible, ranks_receiving, repaired_layout
from shardserve.server.common.errors import ServiceError, TensorBusy
from shardserve.server.coordinator.catalog.interface import Catalog
from shardserve.server.coordinator.catalog.records import TensorRecord
from shardserve.server.coordinator.drivers.collectives import job_timeout
from shardserve.server.coordinator.drivers.reshard import ReshardDriver
from shardserve.server.coordinator.options import DEFAULT_REPAIR_AFTER_S
from shardserve.server.coordinator.ranks.registry import RankRegistry

log = logging.getLogger(__name__)

CHECK_EVERY_S = 0.5
SETTLED_S = 10.0
"""Once every rank has been alive this long with no registration or exit, and the last scan found every copy
available, the catalog is scanned only every SETTLED_S (not every CHECK_EVERY_S). A scan reads the versions on
dead ranks and those with lost copies only (`candidates`: indexed catalog queries), not every row."""
FINISHED_KEPT = 100
REFUSALS_NAMED = 5
"""The tensors a scan's one log line about copies that cannot be repaired names with their reason; it counts the
rest (a rank lost without replicas leaves every one of its tensors so, and a line each would flood the log)."""
RETRY_BACKOFF_S = (
    2.0,
    60.0,
)  # a failed repair of a tensor is tried again after 2 s, doubling up to 60 s


@dataclass(frozen=True)
class RepairInFlight:
    """A repair running now: the version being made, the bytes copied so far (local copies included), when
    it began, and the ranks the lost copies are copied to."""

    version: int
    bytes_done: int
    bytes_total: int
    started_unix: float
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class FinishedRepair:
    """A finished repair: the tensor, the versions, the bytes of copies rebuilt, how long it took, onto which
    ranks."""

    name: str
    from_version: int
    to_version: int
    nbytes: int
    seconds: float
    ranks: tuple[int, ...]


class RepairDriver:
    """Finds tensors with copies due for repair and repairs them, one at a time, on its own thread."""

    def __init__(
        self,
        catalog: Catalog,
        *,
        registry: RankRegistry,
        reshards: ReshardDriver,
        repair_after: float = DEFAULT_REPAIR_AFTER_S,
        job_timeout_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock`: what scans and retry back-offs are timed by (seconds, monotonic; tests pass a fake one)."""
        if repair_after < 0:
            raise ValueError(f"repair_after must be >= 0 seconds, got {repair_after}")
        self.catalog = catalog
        self.registry = registry
        self.reshards = reshards
        self.repair_after = repair_after
        self._clock = clock
        self.job_timeout_s = job_timeout(job_timeout_s, reshards.default_timeout_s)
        self._states: dict[str, RepairInFlight] = {}
        self._retry_at: dict[
            str, tuple[float, float]
        ] = {}  # name -> (next try by the clock, backoff)
        self._refused: dict[str, str] = {}  # name -> why it cannot be repaired now (logged once)
        self._completed: deque[FinishedRepair] = deque(maxlen=FINISHED_KEPT)
        self._next_due = (
            0.0  # when a copy the last scan found waiting is due, or a retry (by the clock)
        )
        self._scanned_at = float("-inf")  # when the last scan began, by the clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="coord-repair", daemon=True)

    def start(self) -> None:
        """Start checking every CHECK_EVERY_S seconds."""
        self._thread.start()

    def stop(self) -> None:
        """Stop starting repairs (the cluster is shutting down, or the coordinator closes)."""
        self._stop.set()

    def state(self, name: str) -> RepairInFlight | None:
        """The repair of `name` in flight, if any."""
        with self._lock:
            return self._states.get(name)

    def completed(self) -> list[FinishedRepair]:
        """The latest finished repairs (FINISHED_KEPT at most), oldest first."""
        with self._lock:
            return list(self._completed)

    def _loop(self) -> None:
        while not self._stop.wait(CHECK_EVERY_S):
            if not self.scan_due():
                continue
            try:
                self.run_once()
            except Exception:  # noqa: BLE001 - a background loop must log, not vanish
                log.exception("the repair round failed")

    def scan_due(self) -> bool:
        """Whether a scan may find a copy to repair now: the ranks changed (one registered, exited, died or came
        back) since the last scan or in the last SETTLED_S, a copy the last scan found waits for `repair_after`
        or a failed repair for its retry and that time has come, or SETTLED_S passed since the last scan (ranks
        the coordinator never heard of count dead late). Copies that cannot be repaired (no live copy left to
        read) are not scanned again every round while nothing changes: a scan reads each of their rows."""
        now, changed = self._clock(), self.registry.changed_at()
        return (
            now >= self._next_due
            or changed > self._scanned_at
            or now - changed < SETTLED_S
            or now - self._scanned_at >= SETTLED_S
        )

    def run_once(self) -> list[str]:
        """Repair every tensor whose copies are due now; the names repaired."""
        repaired: list[str] = []
        self._scanned_at = self._clock()
        self._next_due = min((at for at, _ in self._retry_at.values()), default=math.inf)
        candidates = self.candidates()
        # the usual scan finds none: then no rank's listing is read (a thousand ranks registering scan often)
        if not candidates:
            return repaired
        live = self._live_ranks()
        refused: list[tuple[TensorRecord, str]] = []
        for record in candidates:
            if self._stop.is_set():
                break
            due = self._due(record, live, refused)
            if due is not None and self._repair(record, *due):
                repaired.append(record.name)
        _log_refused(refused)
        return repaired

    def candidates(self) -> list[TensorRecord]:
        """The READY versions that may have an unavailable copy: those with copies a rank lost, and those with
        shards on a rank that is dead now (indexed catalog queries: the rows of the others are never read)."""
        dead = [rank for rank in self.catalog.placed_ranks() if self.registry.rank_dead(rank)]
        found = {r.key: r for r in self.catalog.with_lost_copies()}
        found.update((r.key, r) for r in self.catalog.holding(dead) if r.ready)
        return sorted(found.values(), key=lambda r: (r.name, r.version))

    def _live_ranks(self) -> tuple[list[LiveRank], dict[int, int]]:
        """The live ranks a repaired copy may go to, and the bytes each holds (read once per scan)."""
        ranks = self.registry.ranks()
        live = [
            LiveRank(r.rank, r.host_id or r.hostname, r.device or "cpu") for r in ranks if r.alive
        ]
        return live, {r.rank: r.memory_used_bytes for r in ranks}

    # ------------------------------------------------------------ deciding

    def _due(
        self,
        record: TensorRecord,
        live: tuple[list[LiveRank], dict[int, int]],
        refused: list[tuple[TensorRecord, str]],
    ) -> tuple[ShardedTensorMetadata, frozenset[int]] | None:
        """The repaired layout of `record` and the copies it must not read, when all its unavailable copies are
        due and a live rank (of `live`: _live_ranks) can take each; None otherwise. A tensor that cannot be
        repaired for a reason not seen before for it is added to `refused` (to be logged once)."""
        if not record.ready or record.promoting or self.reshards.is_running(record.name):
            return None
        retry = self._retry_at.get(record.name)
        if retry is not None and self._clock() < retry[0]:
            return None
        meta = record.metadata
        unavailable, wait_s = self._unavailable(record, meta)
        if not unavailable or wait_s > 0:
            self._refused.pop(record.name, None)
            if unavailable:  # scanned again once its last copy is due
                self._next_due = min(self._next_due, self._clock() + wait_s)
            return None
        try:
            return repaired_layout(meta, unavailable, *live), unavailable
        except RepairImpossible as err:
            if self._refused.get(record.name) != str(err):
                self._refused[record.name] = str(err)
                refused.append((record, str(err)))
            return None

    def _unavailable(
        self, record: TensorRecord, meta: ShardedTensorMetadata
    ) -> tuple[frozenset[int], float]:
        """The copies of `record` that cannot be read, and the seconds until every one of them is due for repair
        (0: all due now)."""
        lost = set(record.lost_shards)
        unavailable, wait_s = set(), 0.0
        dead_for = {rank: self.registry.dead_for(rank) for rank in meta.ranks()}
        for index, shard in enumerate(meta.shards_metadata):
            dead = dead_for[shard.rank]
            if dead is None and index not in lost:
                continue
            unavailable.add(index)
            if dead is not None and dead < self.repair_after:
                wait_s = max(wait_s, self.repair_after - dead)
        return frozenset(unavailable), wait_s

    # ------------------------------------------------------------ repairing

    def _repair(
        self, record: TensorRecord, dst: ShardedTensorMetadata, unavailable: frozenset[int]
    ) -> bool:
        """Run one tensor's repair, keeping its progress for answers; whether it committed."""
        targets = ranks_receiving(dst, unavailable)
        nbytes = sum(dst.shard_nbytes(i) for i in unavailable)
        log.warning(
            "repairing %r version %d: %d lost copies (%d bytes) onto ranks %s",
            record.name,
            record.version,
            len(unavailable),
            nbytes,
            targets,
        )
        started = time.time()
        state = RepairInFlight(0, 0, 0, started, tuple(targets))
        try:
            for step in self.reshards.repair(record, dst, unavailable, self.job_timeout_s):
                state = replace(
                    state,
                    version=step.version,
                    bytes_done=step.bytes_done,
                    bytes_total=step.bytes_total,
                )
                with self._lock:
                    self._states[record.name] = state
        except TensorBusy as err:  # the name is busy (a reshard, a put): the next round tries again
            log.info("repair of %r put off: %s", record.name, err.message)
            return False
        except Exception as err:  # noqa: BLE001 - any failure leaves the old version whole; try again later
            self._back_off(record.name)
            log.error(
                "repair of %r version %d failed (tried again in %.0f s): %s",
                record.name,
                record.version,
                self._retry_at[record.name][1],
                err.message if isinstance(err, ServiceError) else err,
            )
            return False
        finally:
            with self._lock:
                self._states.pop(record.name, None)
        self._retry_at.pop(record.name, None)
        seconds = time.time() - started
        with self._lock:
            self._completed.append(
                FinishedRepair(
                    record.name, record.version, state.version, nbytes, seconds, tuple(targets)
                )
            )
        log.warning(
            "repaired %r: version %d holds every copy again (%d bytes copied to ranks %s in %.2f s)",
            record.name,
            state.version,
            nbytes,
            targets,
            seconds,
        )
        return True

    def _back_off(self, name: str) -> None:
        _, last = self._retry_at.get(name, (0.0, RETRY_BACKOFF_S[0] / 2))
        backoff = min(RETRY_BACKOFF_S[1], last * 2)
        self._retry_at[name] = (self._clock() + backoff, backoff)


def _log_refused(refused: Sequence[tuple[TensorRecord, str]]) -> None:
    """One ERROR line for the tensors a scan found newly impossible to repair: the first REFUSALS_NAMED with
    their reason, the others counted (each is logged at DEBUG)."""
    if not refused:
        return
    if len(refused) == 1:
        record, why = refused[0]
        log.error(
            "tensor %r version %d cannot be repaired now: %s", record.name, record.version, why
        )
        return
    named = "; ".join(
        f"{record.name!r} version {record.version}: {why}"
        for record, why in refused[:REFUSALS_NAMED]
    )
    rest = len(refused) - REFUSALS_NAMED
    more = f"; and {rest} more (`shardserve status` shows the health of each)" if rest > 0 else ""
    log.error("%d tensors cannot be repaired now: %s%s", len(refused), named, more)
    if log.isEnabledFor(logging.DEBUG):
        for record, why in refused:
            log.debug(
                "tensor %r version %d cannot be repaired now: %s", record.name, record.version, why
            )
