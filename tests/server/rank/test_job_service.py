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


def test_a_cancelled_running_job_is_abandoned_and_the_next_one_runs_at_once():
    release, stuck, ran = threading.Event(), threading.Event(), []

    def kind(job: pb.CollectiveJob, ctx) -> None:
        if job.reshard.name == "stuck":
            stuck.set()
            release.wait(30)  # a collective that never returns, as one stuck in gloo
        ran.append(job.seq)

    kinds = JobKinds()
    kinds.register("reshard", kind)
    service = CollectiveJobService(ShardStore(0, shared_memory=False), kinds)
    finals: list[pb.CollectiveProgress] = []
    first = threading.Thread(
        target=lambda: finals.extend(service.RunCollective(_job(1, 0, 3, "stuck"), None))
    )
    first.start()
    assert stuck.wait(10)  # the job runs on the job thread
    started = time.monotonic()
    service.CancelCollective(pb.CancelCollectiveRequest(seq=1), None)
    first.join(10)
    assert not first.is_alive()
    assert finals[-1].done and finals[-1].started and "abandoned" in finals[-1].error
    second = list(service.RunCollective(_job(2, 1, 4, "next"), None))[-1]
    assert second.done and not second.error and ran == [2]
    assert time.monotonic() - started < 2  # not held by the stuck job, which still waits
    with pytest.raises(EpochEnded, match="epoch 3 has ended"):
        service.groups.for_job(3, [0], 1.0)
    release.set()


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
    release, stuck, ran = threading.Event(), threading.Event(), []

    def kind(job: pb.CollectiveJob, ctx) -> None:
        if job.reshard.name == "stuck":
            stuck.set()
            release.wait(30)
        ran.append(job.seq)

    kinds = JobKinds()
    kinds.register("reshard", kind)
    service = CollectiveJobService(ShardStore(0, shared_memory=False), kinds)
    finals: list[pb.CollectiveProgress] = []
    first = threading.Thread(
        target=lambda: finals.extend(service.RunCollective(_job(5, 0, 3, "stuck"), None))
    )
    first.start()
    assert stuck.wait(10)
    second = list(service.RunCollective(_job(9, 0, 4, "after-restart"), None))[-1]
    first.join(10)
    assert second.done and not second.error and ran == [9]
    assert finals[-1].done and "abandoned" in finals[-1].error
    release.set()


def test_a_job_that_follows_none_leaves_a_running_job_of_its_own_epoch_alone():
    """Two independent jobs of one epoch (each the first of its ranks here): the second waits for the first."""
    release, stuck, ran = threading.Event(), threading.Event(), []

    def kind(job: pb.CollectiveJob, ctx) -> None:
        if job.reshard.name == "slow":
            stuck.set()
            release.wait(30)
        ran.append(job.seq)

    kinds = JobKinds()
    kinds.register("reshard", kind)
    service = CollectiveJobService(ShardStore(0, shared_memory=False), kinds)
    finals: list[pb.CollectiveProgress] = []
    first = threading.Thread(
        target=lambda: finals.extend(service.RunCollective(_job(5, 0, 3, "slow"), None))
    )
    first.start()
    assert stuck.wait(10)
    second: list[pb.CollectiveProgress] = []
    follower = threading.Thread(
        target=lambda: second.extend(service.RunCollective(_job(6, 0, 3, "next"), None))
    )
    follower.start()
    assert second == [] or not second[-1].done
    release.set()
    first.join(10)
    follower.join(10)
    assert ran == [5, 6] and not finals[-1].error and not second[-1].error
