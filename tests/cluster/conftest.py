"""Fixtures shared by the cluster tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from gloo_world import World

from shardserve.client import spmd as spmd_module
from shardserve.protos import shardserve_pb2 as pb


@pytest.fixture
def creates(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The prefixes of every CreateSnapshot the client's puts make (a steady put that fills the snapshot the
    commit before reserved makes none)."""
    made: list[str] = []
    real = spmd_module.create_snapshot

    def counted(session: Any, prefix: str, *args: Any, **kwargs: Any) -> pb.SnapshotInfo:
        made.append(prefix)
        return real(session, prefix, *args, **kwargs)

    monkeypatch.setattr(spmd_module, "create_snapshot", counted)
    return made


@pytest.fixture(scope="module")
def world2() -> Iterator[World]:
    """A 2-process gloo world (tests/gloo_world.py) lent to one module."""
    world = World(2)
    yield world
    world.close()
