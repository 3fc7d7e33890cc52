"""Collective jobs from the coordinator: job numbering, epochs, and running one job on its ranks.

The `JobSequencer` gives each job a `seq` from the catalog's growing counter
and, per participant, `after_seq` (that rank's previous job), so every rank
enters the collectives of two jobs in one order. `CollectiveRunner` sends
RunCollective to every participant in parallel, sums their progress and fails
the job as soon as one rank fails (after a short grace to hear the others),
naming the rank that is down or hung. Every job carries the current epoch
(server/coordinator/drivers/rendezvous.py) and runs on the process group of (epoch,
participants); any failed job ends its epoch, so the next job forms new groups
over the live ranks and nothing needs a restart. See
server/rank/jobs/service.py for the rank side.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Generator, Sequence

import grpc

from shardserve.protos.errors import Reason
from shardserve.server.common.errors import InvalidArgument, ServiceError
from shardserve.server.common.tracing import carry_context
from shardserve.server.coordinator.drivers.rendezvous import Epochs, RendezvousStore
from shardserve.server.coordinator.metrics import JobTracker
from shardserve.server.coordinator.ranks.collective_calls import (
    Answer,
    CallFailed,
    JobNumbers,
    JobRequest,
    RankProgress,
    cancel_on,
    job_kind,
)
from shardserve.server.coordinator.ranks.jobs import CollectiveJob, JobReport
from shardserve.server.coordinator.ranks.registry import RankRegistry

log = logging.getLogger(__name__)

MIN_JOB_TIMEOUT_S = 1.0
_FAILURE_GRACE_S = (
    2.0  # after one rank failed, how long to hear the others before naming the culprit
)
_RPC_SLACK_S = 15.0  # how long past the job's own timeout a started job's rank is waited for
_CONTROL_TIMEOUT_S = 10.0


class CollectiveJobError(ServiceError):
    """A collective job failed; `culprits` are the ranks that are down or hung (empty: a plain failure)."""

    code = grpc.StatusCode.ABORTED
    reason = Reason.JOB_FAILED

    def __init__(self, message: str, culprits: Sequence[int] = ()) -> None:
        if culprits:
            super().__init__(
                message,
                grpc.StatusCode.UNAVAILABLE,
                reason=Reason.RANK_UNAVAILABLE,
                metadata={"ranks": ",".join(map(str, culprits))},
            )
        else:
            super().__init__(message)
        self.culprits = tuple(culprits)


class JobSequencer:
    """Numbers collective jobs and remembers each rank's last job, so ranks chain them in one order."""

    def __init__(self, next_number: Callable[[], int]) -> None:
        self._next_number = next_number
        self._last: dict[int, int] = {}
        self._lock = threading.Lock()

    def assign(self, ranks: Sequence[int]) -> tuple[int, dict[int, int]]:
        """(seq of a new job over `ranks`, {rank: after_seq})."""
        with self._lock:
            seq = self._next_number()
            after = {r: self._last.get(r, 0) for r in ranks}
            self._last.update({r: seq for r in ranks})
        return seq, after

    def forget(self, rank: int) -> None:
        """`rank` is a new process: its first job follows none (the old process's last job never reaches it)."""
        with self._lock:
            self._last.pop(rank, None)


class CollectiveRunner:
    """Runs one collective job on its participants and reports their summed progress."""

    def __init__(
        self,
        registry: RankRegistry,
        next_number: Callable[[], int],
        store_port: int = 0,
        store_host: str = "0.0.0.0",
    ) -> None:
        self.registry = registry
        self.sequencer = JobSequencer(next_number)
        self.epochs = Epochs(next_number)
        self.tracker = JobTracker()
        self._store_port, self._store_host = store_port, store_host
        self._rendezvous: RendezvousStore | None = None
        self._assign_lock = threading.Lock()

    def start(self) -> None:
        """Open the rendezvous store, on `store_port` of `store_host`."""
        self._rendezvous = RendezvousStore(self._store_port, self._store_host)

    @property
    def store_port(self) -> int:
        """The port of the rendezvous store (ranks learn it when they register)."""
        if self._rendezvous is None:
            raise RuntimeError("the collective runner is not started")
        return self._rendezvous.port

    def close(self) -> None:
        """Stop the rendezvous store."""
        if self._rendezvous is not None:
            self._rendezvous.close()

    def rank_joined(self, rank: int) -> None:
        """A rank (re)registered: a new process, which holds none of the current epoch's groups and has run none
        of the jobs numbered so far."""
        with self._assign_lock:
            self.sequencer.forget(rank)
            self.epochs.end(self.epochs.current, f"rank {rank} registered")

    def run(
        self, job: CollectiveJob, ranks: Sequence[int], what: str
    ) -> Generator[tuple[int, int], None, dict[int, JobReport]]:
        """Yield (bytes_done, bytes_total) while the job runs; return every rank's final report.

        Raises CollectiveJobError naming the ranks that are down or hung. The job's `seq` and `epoch` are
        assigned here; on failure the job is cancelled on every participant and its epoch ends.
        The job is tracked in `self.tracker` while it runs (metrics, `shardserve top`).
        """
        job_id = self.tracker.start(job_kind(job), len(set(ranks)))
        ok = False
        try:
            finals = yield from self._run(job, ranks, what, job_id)
            ok = True
            return {rank: final.report for rank, final in finals.items()}
        finally:
            self.tracker.end(job_id, ok)

    def _run(
        self, job: CollectiveJob, ranks: Sequence[int], what: str, job_id: int
    ) -> Generator[tuple[int, int], None, dict[int, RankProgress]]:
        ranks = sorted(set(ranks))
        entries = {r: self.registry.entry(r) for r in ranks}
        with self._assign_lock:  # seq and epoch in one order: a later job never has an older epoch
            seq, after = self.sequencer.assign(ranks)
            epoch = self.epochs.current
        request = JobRequest(job)
        answers: queue.Queue[tuple[int, Answer]] = queue.Queue()
        calls = [  # each bounded by the watch below, which cancels it
            request.run_on(entry.stub, rank, JobNumbers(seq, epoch, ranks, after[rank]), answers)
            for rank, entry in entries.items()
        ]
        latest = {r: RankProgress() for r in ranks}
        finals: dict[int, RankProgress] = {}
        failures: dict[int, Answer] = {}
        watch = JobWatch(ranks, job.timeout_s + _RPC_SLACK_S)
        try:
            while len(finals) + len(failures) < len(ranks):
                try:
                    rank, answer = answers.get(
                        timeout=watch.seconds_left(finals.keys() | failures.keys())
                    )
                except queue.Empty:  # the wait ran to the first limit: that rank is given up
                    break
                watch.heard(rank, answer)
                if isinstance(answer, RankProgress) and not (answer.done and answer.error):
                    latest[rank] = answer
                    if answer.done:
                        finals[rank] = answer
                    done = sum(p.bytes_done for p in latest.values())
                    total = sum(p.bytes_total for p in latest.values())
                    self.tracker.progress(job_id, done, total)
                    yield done, total
                    continue
                failures[rank] = answer
                watch.failed()
        finally:
            for call in calls:
                call.cancel()
        missing = [r for r in ranks if r not in finals and r not in failures]
        if failures or missing:
            self.epochs.end(epoch, f"{what} failed")  # its groups may hold abandoned operations
            self._cancel(seq, ranks)
            raise self._failure(what, failures, missing)
        return finals

    def _cancel(self, seq: int, ranks: Sequence[int]) -> None:
        """CancelCollective on every participant, in the background: a stopped rank must not delay the error."""

        def cancel(rank: int) -> None:
            try:
                cancel_on(self.registry.entry(rank).stub, seq, timeout=_CONTROL_TIMEOUT_S)
            except (grpc.RpcError, ServiceError):
                pass  # a dead rank runs nothing

        for rank in ranks:
            threading.Thread(
                target=carry_context(cancel),
                args=(rank,),
                name=f"cancel-{seq}-rank-{rank}",
                daemon=True,
            ).start()

    def _failure(
        self, what: str, failures: dict[int, Answer], missing: list[int]
    ) -> CollectiveJobError:
        """The error naming the rank(s) that are down or hung, or else the ranks' own errors."""
        down = {
            r
            for r, f in failures.items()
            if isinstance(f, CallFailed) and f.code == grpc.StatusCode.UNAVAILABLE
        }
        down |= {r for r in set(failures) | set(missing) if not self.registry.rank_alive(r)}
        reporters = {
            r for r, f in failures.items() if isinstance(f, RankProgress) and f.failed_peers
        }
        named = {
            p for f in failures.values() if isinstance(f, RankProgress) for p in f.failed_peers
        }
        culprits = down | (named - reporters)
        if not culprits and (named or missing):
            culprits = named | set(missing)
        details = "; ".join(f"rank {r}: {_describe(f)}" for r, f in sorted(failures.items()))
        if not culprits:
            return CollectiveJobError(f"{what} failed: {details}")
        parts = [
            f"rank {r} is down"
            if r in down or not self.registry.rank_alive(r)
            else f"rank {r} did not answer in time (hung?)"
            for r in sorted(culprits)
        ]
        log.error("%s failed: %s (%s)", what, ", ".join(parts), details)
        return CollectiveJobError(
            f"{what} failed: {', '.join(parts)}; the old version stays served, and later "
            f"jobs run in a new epoch over the live ranks. Details: {details or 'no answer'}",
            sorted(culprits),
        )


class JobWatch:
    """When the coordinator stops waiting for a collective job's ranks.

    A rank's job may first wait behind that rank's earlier jobs (another
    tensor's reshard, say); meanwhile the rank streams progress every 0.2 s,
    and it is given up only once silent for SILENCE_S. From its `started`
    message on it has `run_s` (the job's timeout plus slack). After any rank
    failed, the others get _FAILURE_GRACE_S more, to name the culprit.
    """

    SILENCE_S = 30.0

    def __init__(
        self, ranks: Sequence[int], run_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        now = clock()
        self.run_s = run_s
        self.limits = {
            rank: now + self.SILENCE_S for rank in ranks
        }  # per rank: when it is given up
        self.running: set[int] = set()
        self.give_up = float("inf")

    def heard(self, rank: int, answer: Answer) -> None:
        now = self._clock()
        if isinstance(answer, RankProgress) and answer.started and rank not in self.running:
            self.running.add(rank)
            self.limits[rank] = now + self.run_s
        elif rank not in self.running:
            self.limits[rank] = now + self.SILENCE_S

    def failed(self) -> None:
        self.give_up = min(self.give_up, self._clock() + _FAILURE_GRACE_S)

    def seconds_left(self, ended: set[int]) -> float:
        """Seconds until a rank that has not ended is given up (0: now)."""
        pending = [limit for rank, limit in self.limits.items() if rank not in ended]
        return max(0.0, min([self.give_up, *pending]) - self._clock())


def _describe(failure: Answer) -> str:
    if isinstance(failure, CallFailed):
        return f"{failure.code.name}: {failure.details}"
    return failure.error


def job_timeout(value: float, default: float) -> float:
    """A collective job's timeout_s: 0 for `default`, else at least MIN_JOB_TIMEOUT_S. A job that times out
    ends its epoch, and a timeout too short for any job to finish would make every job fail."""
    if not (value == 0 or MIN_JOB_TIMEOUT_S <= value < math.inf):  # NaN fails this too
        raise InvalidArgument(
            f"timeout_s {value} must be 0 (the default, {default:g} s) or a finite number of "
            f"seconds >= {MIN_JOB_TIMEOUT_S:g}"
        )
    return value or default
