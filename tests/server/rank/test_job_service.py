"""server.rank.jobs.service in-process: a running job that is cancelled is abandoned, its epoch ends here, and
the next job runs at once while the abandoned thread is still blocked; a job that follows none abandons a
running job of an earlier epoch (its coordinator forgot it) but waits for one of its own epoch."""

from __future__ import annotations

import threading
import time

import pytest
from server_helpers import Aborted, ServicerContext

from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.errors import Reason
from shardserve.server.rank.errors import EpochEnded
from shardserve.server.rank.jobs.service import CollectiveJobService, JobKinds
from shardserve.server.rank.store import ShardStore

pytestmark = pytest.mark.timeout(60)


def _job(seq: int, after: int, epoch: int, name: str) -> pb.CollectiveJob:
    return pb.CollectiveJob(
        seq=seq,
        after_seq=after,
        ranks=[0],
        timeout_s=30,
        epoch=epoch,
        reshard=pb.ReshardJob(name=name),
    )


class Blocking:
    """A job service whose reshard kind blocks a job named "stuck" until `release` (as a collective stuck in
    gloo), noting the seq of every job that ran to its end in `ran`."""

    def __init__(self) -> None:
        self.release, self.stuck, self.ran = threading.Event(), threading.Event(), []
        kinds = JobKinds()
        kinds.register("reshard", self._kind)
        self.service = CollectiveJobService(ShardStore(0, shared_memory=False), kinds)

    def _kind(self, job: pb.CollectiveJob, ctx) -> None:
        if job.reshard.name == "stuck":
            self.stuck.set()
            self.release.wait(30)
        self.ran.append(job.seq)

    def start(self, job: pb.CollectiveJob) -> tuple[threading.Thread, list[pb.CollectiveProgress]]:
        """Run `job` on a thread of its own: the thread and the progress messages it gets."""
        messages: list[pb.CollectiveProgress] = []
        thread = threading.Thread(
            target=lambda: messages.extend(self.service.RunCollective(job, None))
        )
        thread.start()
        return thread, messages


def test_a_cancelled_running_job_is_abandoned_and_the_next_one_runs_at_once():
    jobs = Blocking()
    first, finals = jobs.start(_job(1, 0, 3, "stuck"))
    assert jobs.stuck.wait(10)  # the job runs on the job thread
    started = time.monotonic()
    jobs.service.CancelCollective(pb.CancelCollectiveRequest(seq=1), None)
    first.join(10)
    assert not first.is_alive()
    assert finals[-1].done and finals[-1].started and "abandoned" in finals[-1].error
    second = list(jobs.service.RunCollective(_job(2, 1, 4, "next"), None))[-1]
    assert second.done and not second.error and jobs.ran == [2]
    assert time.monotonic() - started < 2  # not held by the stuck job, which still waits
    with pytest.raises(EpochEnded, match="epoch 3 has ended"):
        jobs.service.groups.for_job(3, [0], 1.0)
    jobs.release.set()


def test_a_job_without_an_epoch_is_refused():
    kinds = JobKinds()
    kinds.register("reshard", lambda job, ctx: None)
    service = CollectiveJobService(ShardStore(0, shared_memory=False), kinds)
    job = _job(1, 0, 0, "x")

    with pytest.raises(Aborted, match="INVALID_ARGUMENT: epoch must be > 0") as refused:
        list(service.RunCollective(job, ServicerContext()))
    assert refused.value.reason == Reason.INVALID_ARGUMENT


def test_a_job_that_follows_none_abandons_a_running_job_of_an_earlier_epoch():
    """A restarted coordinator's first job (after_seq 0, a later epoch) does not queue behind a job its
    predecessor started and nobody will cancel: that job is abandoned and the new one runs at once."""
    jobs = Blocking()
    first, finals = jobs.start(_job(5, 0, 3, "stuck"))
    assert jobs.stuck.wait(10)
    second = list(jobs.service.RunCollective(_job(9, 0, 4, "after-restart"), None))[-1]
    first.join(10)
    assert second.done and not second.error and jobs.ran == [9]
    assert finals[-1].done and "abandoned" in finals[-1].error
    jobs.release.set()


def test_a_job_that_follows_none_leaves_a_running_job_of_its_own_epoch_alone():
    """Two independent jobs of one epoch (each the first of its ranks here): the second waits for the first."""
    jobs = Blocking()
    first, finals = jobs.start(_job(5, 0, 3, "stuck"))
    assert jobs.stuck.wait(10)
    follower, second = jobs.start(_job(6, 0, 3, "next"))
    assert second == [] or not second[-1].done
    jobs.release.set()
    first.join(10)
    follower.join(10)
    assert jobs.ran == [5, 6] and not finals[-1].error and not second[-1].error
