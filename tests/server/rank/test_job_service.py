"""server.rank.jobs.service in-process: a running job that is cancelled is abandoned, its epoch ends here, and
the next job runs at once while the abandoned thread is still blocked."""

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
