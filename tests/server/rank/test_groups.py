"""server.rank.jobs.groups: groups per (epoch, participants) over a TCPStore, formed by threads of this process
standing in for ranks (gloo on 127.0.0.1)."""

from __future__ import annotations

import concurrent.futures as cf
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from shardserve.server.rank.errors import EpochEnded, RankUnavailable
from shardserve.server.rank.jobs.groups import P2P, PeerGroup, ProcessGroups, Verb

pytestmark = pytest.mark.timeout(120)
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def store_port():
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    yield store.port
    del store


def _ranks(port: int, count: int) -> list[ProcessGroups]:
    out = [ProcessGroups(rank, "cpu", store_timeout_s=TIMEOUT_S) for rank in range(count)]
    for groups in out:
        groups.set_store("127.0.0.1", port)
    return out


def _on_each(groups: list[ProcessGroups], fn) -> list:
    """fn(rank's groups) on one thread per rank, at once (forming a group waits for every member)."""
    with cf.ThreadPoolExecutor(len(groups)) as pool:
        return [f.result(timeout=TIMEOUT_S * 2) for f in [pool.submit(fn, g) for g in groups]]


def _exchange(group: PeerGroup, rank: int, tag: int) -> torch.Tensor:
    """Rank 0 sends [1, 2, 3] * tag to the last member, which receives it."""
    tensor = (
        torch.arange(1, 4, dtype=torch.float32) * tag if rank == group.ranks[0] else torch.zeros(3)
    )
    peer = group.ranks[-1] if rank == group.ranks[0] else group.ranks[0]
    verb = Verb.SEND if rank == group.ranks[0] else Verb.RECEIVE
    (work,) = group.post([P2P(verb, tensor, peer)], tag)
    assert work.wait(timedelta(seconds=TIMEOUT_S))
    return tensor


def test_a_group_forms_over_the_store_moves_data_and_is_reused_in_its_epoch(store_port):
    ranks = _ranks(store_port, 2)
    first = _on_each(ranks, lambda g: g.for_job(1, [1, 0], TIMEOUT_S))
    assert [g.index(g_rank) for g, g_rank in zip(first, (0, 1))] == [0, 1]
    received = _on_each(ranks, lambda g: _exchange(g.for_job(1, [0, 1], TIMEOUT_S), g.rank, 7))
    assert torch.equal(received[1], torch.tensor([7.0, 14.0, 21.0]))
    assert [g.for_job(1, (0, 1), TIMEOUT_S) for g in ranks] == first  # cached, nothing formed again
    _on_each(ranks, lambda g: g.for_job(1, [0, 1], TIMEOUT_S).barrier(TIMEOUT_S))


def test_a_failed_epoch_is_refused_and_the_next_one_forms_new_groups(store_port):
    ranks = _ranks(store_port, 2)
    _on_each(ranks, lambda g: g.for_job(4, [0, 1], TIMEOUT_S))
    for groups in ranks:
        groups.end_epoch(4)
        assert groups.cached() == []
        with pytest.raises(EpochEnded, match="epoch 4 has ended on rank"):
            groups.for_job(4, [0, 1], TIMEOUT_S)
    received = _on_each(ranks, lambda g: _exchange(g.for_job(5, [0, 1], TIMEOUT_S), g.rank, 3))
    assert torch.equal(received[1], torch.tensor([3.0, 6.0, 9.0]))
    _on_each(
        ranks, lambda g: g.for_job(6, [0, 1], TIMEOUT_S)
    )  # a newer epoch drops the older groups
    assert [g.cached() for g in ranks] == [[(6, (0, 1))]] * 2


def test_ranks_outside_a_job_never_join_its_group(store_port):
    """Ranks 0 and 2 form their group while rank 1 (not a participant) does nothing at all."""
    ranks = _ranks(store_port, 3)
    members = [ranks[0], ranks[2]]
    received = _on_each(members, lambda g: _exchange(g.for_job(8, [2, 0], TIMEOUT_S), g.rank, 5))
    assert torch.equal(received[1], torch.tensor([5.0, 10.0, 15.0]))
    assert ranks[1].cached() == []
    single = ranks[1].for_job(8, [1], TIMEOUT_S)  # a group of one forms alone
    assert single.ranks == (1,) and single.index(1) == 0


def test_a_member_that_never_comes_fails_the_formation_within_the_timeout(store_port):
    (alone,) = _ranks(store_port, 1)
    with pytest.raises(
        Exception
    ) as err:  # DistStoreError / RuntimeError, depending on where gloo waits
        alone.for_job(9, [0, 1], 2.0)
    assert not isinstance(err.value, AssertionError)
    assert alone.cached() == []


def test_without_a_store_address_a_job_is_refused():
    with pytest.raises(RankUnavailable, match="knows no rendezvous store yet"):
        ProcessGroups(0).for_job(1, [0, 1], 5.0)


def test_default_world_is_the_jobs_participants_for_the_block(store_port):
    """c10d has one default world per process, so in-process only a world of one can be checked."""
    (rank0,) = _ranks(store_port, 1)
    with rank0.default_world(10, [0], seq=4, timeout_s=TIMEOUT_S):
        assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
    assert not dist.is_initialized()
