"""A rank's RunCollective / CancelCollective: checks, ordering, progress streaming, and the job kinds.

The protocol:

- The coordinator numbers every collective job with `seq`, drawn from the
  catalog's growing counter (unique across coordinator restarts), and tells
  each participant `after_seq`: the seq of that rank's previous job (0 when it
  knows none, e.g. after a restart). See server/coordinator/drivers/collectives.py.
- Each rank runs its jobs on its one JobChain (rank/jobs/ordering.py), each
  right after its `after_seq` job. A caller that cancels the stream does not
  cancel the job (its peers may already be in its collectives): the
  coordinator sends CancelCollective to every participant once the job failed
  on one of them or one went silent or overran.
- `ShardServer.RunCollective(CollectiveJob)` streams CollectiveProgress
  (bytes_done/bytes_total, every 0.2 s, `started` once the job left the
  queue behind the rank's earlier jobs; its `timeout_s` counts from then)
  until a message with done=true; `error` empty means success,
  `failed_peers` names the ranks that failed or did not answer.
- A job kind is the name of a field of the CollectiveJob `kind` oneof;
  `JobKinds.register(kind, fn)` binds it to `fn(job, context)`, run on the
  collective thread with a JobContext (store, rank, deadline, progress). The
  rank registers its kinds where it is assembled (rank/service.py).
- Every job carries (epoch, ranks) and runs on that epoch's process group of
  its participants (rank/jobs/groups.py), formed over the coordinator's store.
  A job that fails ends its epoch here as on the coordinator: the epoch's
  groups are dropped, since they may hold operations abandoned with a dead or
  hung peer that a later job would match (tags repeat), and later jobs form
  new groups over the live ranks.
- The job kind runs on a thread of its own, watched by the chain's thread. A
  job cancelled while it runs (CancelCollective, after it failed elsewhere),
  one of an earlier epoch still running when a job that follows none arrives
  (its coordinator restarted or was replaced, and knows nothing of it), or one
  still running `ABANDON_GRACE_S` past its deadline, is abandoned: the
  chain goes on with the next job at once, and the abandoned thread ends by
  itself, bounded, since every wait in a job is bounded by the job's deadline
  (work.wait(timeout), and the group's own gloo timeout).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.common.tracing import carry_context, span
from shardserve.server.rank.error_status import rank_rpc
from shardserve.server.rank.errors import InvalidArgument
from shardserve.server.rank.jobs.context import JobContext
from shardserve.server.rank.jobs.groups import ProcessGroups
from shardserve.server.rank.jobs.ordering import JobChain
from shardserve.server.rank.jobs.reshard import ReshardError
from shardserve.server.rank.store import ShardStore

log = logging.getLogger(__name__)

_POLL_S = 0.2
ABANDON_GRACE_S = (
    5.0  # how long past its deadline a running job is waited for before it is abandoned
)


JobFn = Callable[[pb.CollectiveJob, JobContext], None]
_PROTO_KINDS = frozenset(f.name for f in pb.CollectiveJob.DESCRIPTOR.oneofs_by_name["kind"].fields)


class JobKinds:
    """The job kinds a rank runs: CollectiveJob `kind` oneof field name -> fn(job, context)."""

    def __init__(self) -> None:
        self._kinds: dict[str, JobFn] = {}

    def register(self, kind: str, fn: JobFn) -> None:
        """Run `fn(job, context)` for CollectiveJobs whose `kind` oneof field is `kind`."""
        if kind not in _PROTO_KINDS:
            raise ValueError(f"kind {kind!r} is not a field of CollectiveJob.kind in the proto")
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        self._kinds[kind] = fn

    def of(self, job: pb.CollectiveJob) -> JobFn:
        """The function of `job`'s kind; InvalidArgument when none is registered."""
        kind = job.WhichOneof("kind")
        if kind is None or kind not in self._kinds:
            raise InvalidArgument(
                f"kind {kind!r} is not a registered collective job kind "
                f"(known: {sorted(self._kinds)})"
            )
        return self._kinds[kind]


class JobAbandoned(RuntimeError):
    """A running job was cancelled or overran its deadline; its thread is left to end by itself."""


class CollectiveJobService:
    """The rank's RunCollective / CancelCollective: validation, ordering, progress, epochs."""

    def __init__(
        self, store: ShardStore, kinds: JobKinds, groups: ProcessGroups | None = None
    ) -> None:
        self.store = store
        self.kinds = kinds
        self.groups = groups if groups is not None else ProcessGroups(store.rank, store.device)
        self.chain = JobChain()
        self._running: dict[
            int, tuple[int, threading.Event]
        ] = {}  # seq -> (its epoch, set to abandon it: CancelCollective, or a coordinator that forgot it)
        self._lock = threading.Lock()

    def _check(self, job: pb.CollectiveJob) -> JobFn:
        if job.seq == 0:
            raise InvalidArgument("seq must be > 0")
        if job.after_seq >= job.seq:
            raise InvalidArgument(f"after_seq {job.after_seq} must be < seq {job.seq}")
        if self.store.rank not in job.ranks:
            raise InvalidArgument(
                f"ranks {list(job.ranks)} does not include this rank ({self.store.rank})"
            )
        if not 0 < job.timeout_s < math.inf:  # NaN fails this too
            raise InvalidArgument(f"timeout_s must be a finite number > 0, got {job.timeout_s}")
        if job.epoch == 0:
            raise InvalidArgument("epoch must be > 0")
        return self.kinds.of(job)

    @rank_rpc
    def RunCollective(
        self, job: pb.CollectiveJob, context: grpc.ServicerContext
    ) -> Iterator[pb.CollectiveProgress]:
        run_kind = self._check(job)
        ctx = JobContext(self.store, self.store.rank, job, deadline=0.0, groups=self.groups)
        kind = job.WhichOneof("kind") or "unknown"

        def run_traced() -> (
            None
        ):  # on the job's own thread, in this call's trace (when tracing is on)
            with span(
                f"collective {kind}",
                {
                    "shardserve.job.seq": job.seq,
                    "shardserve.job.epoch": job.epoch,
                    "shardserve.rank": self.store.rank,
                },
            ):
                run_kind(job, ctx)

        def execute() -> None:
            ctx.deadline = (
                time.monotonic() + job.timeout_s
            )  # timeout_s is the job's own run, not its queueing
            ctx.progress.started = True
            self._run_abandonable(job, run_traced, ctx.deadline + ABANDON_GRACE_S)

        # A caller that stops listening does not cancel the job: its peers may already be in its
        # collectives, and they would hang until their deadline. Only CancelCollective cancels.
        if job.after_seq == JobChain.NO_PREDECESSOR:
            self._abandon_forgotten(job)
        started = self.store.metrics.job_started()
        future = self.chain.submit(job.seq, job.after_seq, carry_context(execute), job.timeout_s)
        future.add_done_callback(
            lambda done: self.store.metrics.job_ended(
                kind, not done.cancelled() and done.exception() is None, started
            )
        )
        while True:
            try:
                future.result(timeout=_POLL_S)
                break
            except cf.TimeoutError:
                yield ctx.snapshot()
            except Exception:  # noqa: BLE001 - reported in the final message below
                break
        yield self._final(job, ctx, future)

    def _final(
        self, job: pb.CollectiveJob, ctx: JobContext, future: cf.Future
    ) -> pb.CollectiveProgress:
        final = ctx.snapshot()
        final.done = True
        err = future.exception()
        if err is None:
            return final
        final.error = str(err) or type(err).__name__
        if isinstance(err, ReshardError) and err.peers:
            final.failed_peers.extend(err.peers)
        self.groups.end_epoch(job.epoch)  # its groups may hold abandoned operations
        log.warning(
            "collective job %d failed on rank %d, ending epoch %d: %s",
            job.seq,
            self.store.rank,
            job.epoch,
            final.error,
        )
        return final

    def _run_abandonable(
        self, job: pb.CollectiveJob, fn: Callable[[], None], give_up_at: float
    ) -> None:
        """Run `fn` on a thread of its own; JobAbandoned once the job is cancelled or `give_up_at` passed."""
        done: cf.Future = cf.Future()
        wake = threading.Event()  # set when fn ends, or by CancelCollective
        done.add_done_callback(lambda _: wake.set())

        def run() -> None:
            try:
                fn()
                done.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - the job's failure goes to its caller
                done.set_exception(exc)

        with self._lock:
            self._running[job.seq] = (job.epoch, wake)
        threading.Thread(
            target=carry_context(run), name=f"collective-job-{job.seq}", daemon=True
        ).start()
        try:
            woken = wake.wait(max(0.0, give_up_at - time.monotonic()))
        finally:
            with self._lock:
                self._running.pop(job.seq, None)
        if not done.done():
            why = "cancelled" if woken else "still running past its deadline"
            log.error(
                "collective job %d %s on rank %d: abandoned (its thread ends on its own deadline)",
                job.seq,
                why,
                self.store.rank,
            )
            raise JobAbandoned(
                f"job {job.seq} was {why} and was abandoned on rank {self.store.rank}"
            )
        done.result()

    @rank_rpc
    def CancelCollective(
        self, request: pb.CancelCollectiveRequest, context: grpc.ServicerContext
    ) -> pb.CancelCollectiveResponse:
        if request.seq == 0:
            raise InvalidArgument("seq must be > 0")
        self.chain.cancel(request.seq)
        with self._lock:
            running = self._running.get(request.seq)
        if running is not None:
            running[1].set()
        return pb.CancelCollectiveResponse()

    def _abandon_forgotten(self, job: pb.CollectiveJob) -> None:
        """`job` follows none: its coordinator knows no earlier job of this rank (it restarted, or another one
        leads now). Jobs of earlier epochs still running here belong to no coordinator and their peers have
        given them up: they are abandoned, so that `job` does not wait out their deadlines behind them."""
        with self._lock:
            forgotten = [
                (seq, wake)
                for seq, (epoch, wake) in self._running.items()
                if epoch < job.epoch and seq < job.seq
            ]
        for seq, wake in forgotten:
            log.warning(
                "collective job %d of an earlier epoch is abandoned on rank %d: job %d of epoch %d "
                "follows none (its coordinator knows no earlier job)",
                seq,
                self.store.rank,
                job.seq,
                job.epoch,
            )
            wake.set()


def handlers(jobs: CollectiveJobService) -> dict[str, grpc.RpcMethodHandler]:
    """The ShardServer method handlers of the collective-job RPCs."""
    return {
        "RunCollective": grpc.unary_stream_rpc_method_handler(
            jobs.RunCollective,
            request_deserializer=pb.CollectiveJob.FromString,
            response_serializer=pb.CollectiveProgress.SerializeToString,
        ),
        "CancelCollective": grpc.unary_unary_rpc_method_handler(
            jobs.CancelCollective,
            request_deserializer=pb.CancelCollectiveRequest.FromString,
            response_serializer=pb.CancelCollectiveResponse.SerializeToString,
        ),
    }
