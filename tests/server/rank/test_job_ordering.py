"""JobChain: jobs run in (seq, after_seq) chain order on one thread, whatever order they arrive in."""

from __future__ import annotations

import threading

import pytest

from shardserve.server.coordinator.drivers.collectives import JobSequencer, JobWatch
from shardserve.server.coordinator.ranks.collective_calls import RankProgress
from shardserve.server.rank.jobs.ordering import JobCancelled, JobChain
from shardserve.server.rank.jobs.service import JobKinds


@pytest.fixture
def chain():
    c = JobChain()
    yield c
    c.close()


def test_jobs_arriving_out_of_order_run_in_chain_order(chain):
    ran, release = [], threading.Event()
    third = chain.submit(30, 20, lambda: ran.append(30), timeout_s=10)
    second = chain.submit(20, 10, lambda: ran.append(20), timeout_s=10)
    first = chain.submit(10, 0, lambda: (release.wait(10), ran.append(10)), timeout_s=10)
    release.set()
    for future in (first, second, third):
        future.result(10)
    assert ran == [10, 20, 30]


def test_a_job_outside_the_chain_is_not_blocked_by_a_parked_one(chain):
    parked = chain.submit(50, 40, lambda: "late", timeout_s=10)  # 40 has not arrived
    assert chain.submit(60, 0, lambda: "free", timeout_s=10).result(10) == "free"
    assert not parked.done()
    chain.submit(40, 0, lambda: "pred", timeout_s=10).result(10)
    assert parked.result(10) == "late"


def test_cancel_of_a_never_arriving_predecessor_releases_its_successor(chain):
    successor = chain.submit(8, 7, lambda: "ran", timeout_s=10)
    chain.cancel(7)
    assert successor.result(10) == "ran"
    with pytest.raises(JobCancelled):
        chain.submit(7, 0, lambda: "too late", timeout_s=10).result(10)


def test_a_job_whose_predecessor_never_comes_times_out_and_releases_the_next(chain):
    stuck = chain.submit(3, 2, lambda: "never", timeout_s=0.3)
    after = chain.submit(4, 3, lambda: "next", timeout_s=10)
    with pytest.raises(JobCancelled, match="timed out waiting for job 2"):
        stuck.result(10)
    assert after.result(10) == "next"


def test_a_cancelled_queued_job_does_not_run(chain):
    gate, ran = threading.Event(), []
    busy = chain.submit(1, 0, lambda: gate.wait(10), timeout_s=10)
    queued = chain.submit(2, 1, lambda: ran.append(2), timeout_s=10)
    chain.cancel(2)
    gate.set()
    busy.result(10)
    with pytest.raises(JobCancelled):
        queued.result(10)
    assert ran == []


def test_sequencer_gives_each_rank_its_previous_job():
    numbers = iter(range(100, 200))
    seq = JobSequencer(lambda: next(numbers))
    assert seq.assign([0, 1]) == (100, {0: 0, 1: 0})
    assert seq.assign([1, 2]) == (101, {1: 100, 2: 0})
    assert seq.assign([0, 2]) == (102, {0: 100, 2: 101})
    seq.forget(2)  # a restarted rank 2 never saw job 102: its next job must not wait for it
    assert seq.assign([1, 2]) == (103, {1: 101, 2: 0})


def test_register_job_kind_checks_the_kind_is_in_the_proto():
    with pytest.raises(ValueError, match="not a field"):
        JobKinds().register("no_such_kind", lambda job, ctx: None)
    with pytest.raises(TypeError):
        JobKinds().register("reshard", "not callable")  # type: ignore[arg-type]


def test_a_queued_rank_is_waited_for_while_it_streams_and_a_started_one_for_its_run():
    """A job queued behind a rank's earlier jobs is not given up while the rank keeps streaming (however long
    the queue); once it started it has run_s; a silent rank is given up after SILENCE_S."""
    now = [1000.0]
    watch = JobWatch([0, 1], run_s=5.0, clock=lambda: now[0])
    silence = JobWatch.SILENCE_S
    for _ in range(10):  # 10 silences' worth of queueing, rank 0 streaming all along
        now[0] += silence - 1
        watch.heard(0, RankProgress())
        watch.heard(1, RankProgress())
        assert watch.seconds_left(set()) == pytest.approx(silence)
    watch.heard(0, RankProgress(started=True))
    assert watch.seconds_left(set()) == pytest.approx(
        5.0
    )  # rank 0 runs now: its run time bounds the wait
    now[0] += 4
    watch.heard(0, RankProgress(started=True, bytes_done=1))  # progress does not extend a run
    assert watch.seconds_left(set()) == pytest.approx(1.0)
    assert watch.seconds_left({0}) == pytest.approx(
        silence - 4
    )  # rank 1 is still queued, heard 4 s ago
    now[0] += silence
    assert watch.seconds_left({0}) == 0.0  # and then silent too long
    watch.failed()
    assert watch.seconds_left({0}) == 0.0
