"""Collective jobs as the drivers order them: a reshard of one tensor, a DCP checkpoint load or save, and what
each rank reports once its part is done.

The reshard and checkpoint drivers build these; the collective runner (drivers/collectives.py) numbers them and
runs them through collective_calls.py, which encodes them as CollectiveJob messages for the ranks and decodes
the ranks' answers, so the drivers never see a protobuf message.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shardserve.server.coordinator.catalog.records import TensorRecord


@dataclass(frozen=True)
class ReshardJob:
    """Move `old`'s bytes into `new`'s reserved layout in rounds of at most `bucket_bytes`, reading no copy of
    the source shards at indices `src_unavailable` (on dead ranks, or lost)."""

    old: TensorRecord
    new: TensorRecord
    bucket_bytes: int
    timeout_s: float
    src_unavailable: tuple[int, ...] = ()


class CheckpointKind(enum.Enum):
    """A checkpoint job's direction: read shards into reserved versions, or write served versions."""

    LOAD = "checkpoint_load"
    SAVE = "checkpoint_save"


@dataclass(frozen=True)
class CheckpointJob:
    """Load or save `tensors` (load: the reserved PENDING versions; save: the served ones) as one DCP
    checkpoint in the directory `path`."""

    kind: CheckpointKind
    path: str
    tensors: tuple[TensorRecord, ...]
    timeout_s: float


CollectiveJob = ReshardJob | CheckpointJob


@dataclass(frozen=True)
class JobReport:
    """One rank's final report of a job it ran: a reshard's largest new shard and staging peak, and its bytes
    copied out of same-host ranks' memory or sent over gloo / NCCL."""

    new_shard_bytes: int = 0
    peak_staging_bytes: int = 0
    mapped_bytes: int = 0
    sent_bytes: int = 0
