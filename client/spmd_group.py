"""The process group of an SPMD job as spmd.put_state_dict and get_state_dict use it: its rank and size, and
the collectives that carry each step's results and failures (a world of one without torch.distributed)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardserve.client.errors import InvalidArgumentError, ShardServeError


class SpmdError(ShardServeError):
    """A put or get failed on some rank of the job; every rank raises it with the same message."""


class JobGroup:
    """The job's process group (or a world of one without torch.distributed): rank, size, object collectives."""

    def __init__(self, group: Any) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        if group is not None and not self.distributed:
            raise InvalidArgumentError("group was given but torch.distributed is not initialized")
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.size = dist.get_world_size(group) if self.distributed else 1

    def all_gather(self, value: Any) -> list[Any]:
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def broadcast(self, value: Any) -> Any:
        """job rank 0's `value` on every rank."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=self._rank0(), group=self.group)
        return box[0]

    def all_done(self, step: Callable[[], Any], what: str) -> None:
        """Run `step` on every rank; every rank raises SpmdError if any rank failed."""
        self.all_succeed(attempt_step(step)[1], what)

    def all_succeed(self, error: str | None, what: str, *, also: bool = True) -> bool:
        """Every rank raises SpmdError if any rank's step failed (its `error`); else whether `also` holds on every
        rank. One reduction of two flags when all went well (the messages are gathered only after a failure)."""
        if not self.distributed:
            _raise_first([(0, error)], what)
            return also
        flags = torch.tensor([int(error is not None), int(not also)], device=self._device())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        if flags[0].item():
            _raise_first(list(enumerate(self.all_gather(error))), what)
        return not flags[1].item()

    def count_from_rank0(self, step: Callable[[], int], what: str) -> int:
        """`step` (a count >= 0) run on job rank 0 only, its result (or its failure) on every rank: one
        broadcast of two numbers when it succeeded."""
        if not self.distributed:
            return int(self.from_rank0(step, what))
        result, error = attempt_step(step) if self.rank == 0 else (0, None)
        answer = torch.tensor([int(error is None), result or 0], device=self._device())
        dist.broadcast(answer, src=self._rank0(), group=self.group)
        if not answer[0].item():
            _raise_first([(0, self.broadcast(error))], what)
        return int(answer[1].item())

    def from_rank0(self, step: Callable[[], Any], what: str) -> Any:
        """`step` run on job rank 0 only, its result (or its failure) on every rank."""
        result, error = self.broadcast(attempt_step(step) if self.rank == 0 else (None, None))
        _raise_first([(0, error)], what)
        return result

    def _rank0(self) -> int:
        """Job rank 0's global rank (broadcasts name their source by it)."""
        return dist.get_global_rank(self.group, 0) if self.group is not None else 0

    def _device(self) -> torch.device:
        """Where this group's tensor collectives run: the current GPU for NCCL, else the CPU."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def attempt_step(step: Callable[[], Any]) -> tuple[Any, str | None]:
    """(step's result, None), or (None, its failure as "Type: message"): every rank must reach the collective
    that follows, then all raise."""
    try:
        return step(), None
    except Exception as err:  # noqa: BLE001 - reported to every rank of the job, then raised there
        return None, f"{type(err).__name__}: {err}"


def _raise_first(errors: Sequence[tuple[int, str | None]], what: str) -> None:
    failed = [(rank, error) for rank, error in errors if error]
    if failed:
        rank, error = failed[0]
        more = f" (and on {len(failed) - 1} more ranks)" if len(failed) > 1 else ""
        raise SpmdError(f"{what} failed on job rank {rank}{more}: {error}")
