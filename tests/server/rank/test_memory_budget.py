"""server/rank/memory_budget.py: ranks sharing a host split a fraction of its memory by default."""

from __future__ import annotations

import pytest
import torch

from shardserve.server.common.memory_limits import effective_memory
from shardserve.server.rank.errors import MemoryLimit
from shardserve.server.rank.main import resolve_memory_limit
from shardserve.server.rank.memory_budget import (
    HOST_MEMORY_FRACTION,
    MemoryBudget,
    default_memory_limit,
    device_capacity,
    ranks_on_host,
    reserved_bytes,
)

GIB = 1 << 30


def test_cpu_ranks_split_the_fraction_of_what_is_left_after_the_reserve_evenly():
    assert reserved_bytes(24 * GIB) == GIB and reserved_bytes(2 * GIB) == GIB // 2
    assert default_memory_limit("cpu", 24 * GIB, 2) == int(23 * GIB * HOST_MEMORY_FRACTION) // 2
    assert 4 * default_memory_limit("cpu", 24 * GIB, 4) <= 23 * GIB * HOST_MEMORY_FRACTION
    # a 4 GiB container with 2 ranks: 1.2 GiB each, room left for the processes themselves
    assert default_memory_limit("cpu", 4 * GIB, 2) == int(3 * GIB * HOST_MEMORY_FRACTION) // 2


def test_cuda_ranks_are_unlimited_by_default():
    assert default_memory_limit("cuda:0", 24 * GIB, 2) == 0


def test_ranks_on_host_reads_local_world_size():
    assert ranks_on_host({}) == 1
    assert ranks_on_host({"LOCAL_WORLD_SIZE": "3"}) == 3
    for bad in ("0", "-1", "two", ""):
        with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
            ranks_on_host({"LOCAL_WORLD_SIZE": bad})


def test_a_given_limit_wins_and_zero_stays_unlimited(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resolve_memory_limit(1234, "cpu").nbytes == 1234
    assert resolve_memory_limit(1234, "cpu").source == "--memory-limit"
    assert resolve_memory_limit(0, "cpu").nbytes == 0
    default = resolve_memory_limit(None, "cpu")
    assert default.nbytes == default_memory_limit("cpu", effective_memory().nbytes, 2)
    assert effective_memory().source in default.source and "over 2 rank(s)" in default.source


def test_a_budget_reserves_and_releases_within_its_limit():
    budget = MemoryBudget(100, 1000, rank=3)
    budget.reserve(60)
    assert budget.used == 60 and budget.room(40) == 0 and budget.room(41) == -1
    with pytest.raises(
        MemoryLimit, match="rank 3 memory limit: 41 bytes requested, 40 of 100 free"
    ):
        budget.reserve(41)
    assert budget.used == 60  # a refused reservation holds nothing
    budget.release(60)
    budget.reserve(100)
    assert budget.used == 100


def test_without_a_limit_the_device_capacity_bounds_a_budget():
    budget = MemoryBudget(0, 64, rank=0, device="cuda:0")
    budget.reserve(64)
    with pytest.raises(MemoryLimit, match="more than the 0 bytes left of cuda:0's 64"):
        budget.reserve(1)
    budget.add(8)  # memory already taken (copied blocks) is accounted whatever the limit
    assert budget.used == 72 and budget.room(0) == -8
    assert MemoryBudget(0, 64).room(10) == 54
    with pytest.raises(ValueError, match="memory_limit must be >= 0"):
        MemoryBudget(-1, 64)


def test_the_capacity_of_the_cpu_is_its_physical_memory():
    assert device_capacity(torch.device("cpu")) > 0
