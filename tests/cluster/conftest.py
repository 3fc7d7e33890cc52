"""Fixtures shared by the cluster tests."""

from __future__ import annotations

from typing import Any

import pytest

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
