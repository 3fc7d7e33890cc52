"""The wire half of collective jobs: a job's RunCollective stream to one participant, its answers as domain
values, and CancelCollective. The collective runner (drivers/collectives.py) numbers and watches jobs with
these and never sees a protobuf message; the rank side is server/rank/jobs/service.py.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from shardserve.core.wire import metadata_to_proto
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.server.coordinator.ranks.jobs import CollectiveJob, JobReport, ReshardJob


@dataclass(frozen=True)
class JobNumbers:
    """What makes a job one run: its `seq`, its epoch, its participants, and this rank's previous job."""

    seq: int
    epoch: int
    ranks: Sequence[int]
    after_seq: int


@dataclass(frozen=True)
class RankProgress:
    """One answer of a rank running its part of a job: bytes so far, `started` once it left the rank's queue,
    `done` on the last one (`error` empty: it succeeded, and `report` holds its final figures)."""

    bytes_done: int = 0
    bytes_total: int = 0
    started: bool = False
    done: bool = False
    error: str = ""
    failed_peers: tuple[int, ...] = ()
    report: JobReport = field(default_factory=JobReport)


@dataclass(frozen=True)
class CallFailed:
    """A rank's RunCollective call ended in an RPC error (CANCELLED included: its channel was closed)."""

    code: grpc.StatusCode
    details: str


Answer = RankProgress | CallFailed


class Cancellable(Protocol):
    def cancel(self) -> bool: ...


def job_kind(job: CollectiveJob) -> str:
    """The job's kind as the ranks and the job metrics name it: "reshard", "checkpoint_load" or ..._save."""
    return "reshard" if isinstance(job, ReshardJob) else job.kind.value


class JobRequest:
    """A job encoded once for all its participants (its layouts can hold many shards); each participant's call
    adds the numbers of its run to a copy."""

    def __init__(self, job: CollectiveJob) -> None:
        self._message = _job_message(job)

    def run_on(
        self,
        stub: pb_grpc.ShardServerStub,
        rank: int,
        numbers: JobNumbers,
        answers: queue.Queue[tuple[int, Answer]],
    ) -> Cancellable:
        """Send the job to `rank` and forward its answers, as (rank, Answer), into `answers` from a thread of
        their own until the stream ends; the call is bounded by the caller, who cancels it."""
        request = pb.CollectiveJob()
        request.CopyFrom(self._message)
        request.seq, request.epoch, request.after_seq = (
            numbers.seq,
            numbers.epoch,
            numbers.after_seq,
        )
        request.ranks.extend(numbers.ranks)
        call = stub.RunCollective(request)
        threading.Thread(
            target=_pump,
            args=(rank, call, answers),
            daemon=True,
            name=f"collective-{numbers.seq}-rank-{rank}",
        ).start()
        return call


def cancel_on(stub: pb_grpc.ShardServerStub, seq: int, *, timeout: float) -> None:
    """CancelCollective of job `seq` (grpc.RpcError when the rank does not answer)."""
    stub.CancelCollective(pb.CancelCollectiveRequest(seq=seq), timeout=timeout)


def _job_message(job: CollectiveJob) -> pb.CollectiveJob:
    """The CollectiveJob message of a job, without the numbers of a participant's run."""
    message = pb.CollectiveJob(timeout_s=job.timeout_s)
    if isinstance(job, ReshardJob):
        old, new = job.old, job.new
        message.reshard.CopyFrom(
            pb.ReshardJob(
                name=new.name,
                src_version=old.version,
                src=metadata_to_proto(old.metadata),
                dst_version=new.version,
                dst=metadata_to_proto(new.metadata),
                bucket_bytes=job.bucket_bytes,
                src_unavailable=sorted(job.src_unavailable),
            )
        )
        return message
    tensors = [
        pb.CheckpointTensor(name=r.name, version=r.version, metadata=metadata_to_proto(r.metadata))
        for r in job.tensors
    ]
    getattr(message, job.kind.value).CopyFrom(pb.CheckpointJob(path=job.path, tensors=tensors))
    return message


def _pump(rank: int, call: grpc.Call, answers: queue.Queue[tuple[int, Answer]]) -> None:
    """Forward one rank's progress stream (or its RPC failure) into `answers`. A CANCELLED stream is forwarded
    too: the runner cancels only once it stopped reading, so this one was cut elsewhere (the rank re-registered
    and its channel was closed) and the job will not hear from that rank again."""
    try:
        for message in call:
            answers.put((rank, _progress(message)))
    except grpc.RpcError as err:
        answers.put((rank, CallFailed(err.code(), err.details() or "")))


def _progress(message: pb.CollectiveProgress) -> RankProgress:
    return RankProgress(
        bytes_done=message.bytes_done,
        bytes_total=message.bytes_total,
        started=message.started,
        done=message.done,
        error=message.error,
        failed_peers=tuple(message.failed_peers),
        report=JobReport(
            new_shard_bytes=message.new_shard_bytes,
            peak_staging_bytes=message.peak_staging_bytes,
            mapped_bytes=message.mapped_bytes,
            sent_bytes=message.sent_bytes,
        ),
    )
