"""The reads of one tensor proxy: a box at the cached version, refreshed and retried whole when it is gone.

A read asks every shard it touches in parallel (client.paths.policy picks each rank's path), each part landing
in a preallocated output; when a rank no longer serves that version, the proxy refreshes its metadata and
retries the whole read (client.retry), so a result never mixes two versions. Each box is read from a live copy
(shardcore.health) as client.health's leases say: a rank that cannot be reached makes the retry use another
copy, a summary naming unreadable copies is asked again once its lease is out, and a box with no live copy
left raises ShardsLostError.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from shardserve.client import counters
from shardserve.client.errors import InvalidArgumentError
from shardserve.client.health import check_readable
from shardserve.client.info import RankStatus, TensorSummary
from shardserve.client.retry import read_with_refresh
from shardserve.client.session import Session
from shardserve.client.verify import verify_parts
from shardserve.core.casts import read_cast_problem
from shardserve.core.metadata import Box
from shardserve.core.regions import check_box, shards_for_box

Resolve = Callable[[tuple[int, ...]], Box]  # the box of a read against the tensor's shape


class TensorReader:
    """Reads boxes of one tensor proxy: `summary()` is its cached summary, `refresh()` reloads it."""

    def __init__(
        self,
        session: Session,
        summary: Callable[[], TensorSummary],
        refresh: Callable[[], TensorSummary],
    ) -> None:
        self._session = session
        self._summary = summary
        self._refresh = refresh
        self.last_transport: str | None = (
            None  # "shm", "bulk" or "grpc": the path of the latest part read
        )

    def read(
        self, resolve: Resolve, out: torch.Tensor | None, *, verify: bool = False
    ) -> torch.Tensor:
        """Read the box `resolve(shape)` at the cached version; if that version is gone, refresh and retry the
        whole read (the box is resolved again against the new shape). With `verify`, the bytes read are checked
        against the shards' checksums (client.verify)."""
        self._session.check_open()
        summary = self._summary()
        if (
            self._session.newest_seen(summary.name)
            > summary.version  # replaced, yet served in its grace
            or self._session.health.summary_expired(
                summary
            )  # its unreadable copies: a lease ran out
        ):
            self._refresh()
        return read_with_refresh(
            lambda: self._read_once(resolve, out, verify),
            self._refresh_for_retry,
            self._session.channel.timeout,
        )

    def plan(self, box: Box, out: torch.Tensor) -> tuple[TensorSummary, list[tuple[int, Box]]]:
        """The summary and the (shard index, global part) of each shard that a read of `box` into `out` would
        take, a live copy chosen as reads choose it; raises as a read does for a bad box or `out`."""
        self._session.check_open()
        summary = self._summary()
        check_request(summary, box, out)
        return summary, self._parts(summary, box)

    def read_parts(
        self,
        summary: TensorSummary,
        parts: Sequence[tuple[int, Box]],
        box: Box,
        out: torch.Tensor,
        *,
        checksums: dict[int, int] | None = None,
    ) -> None:
        """Fetch each (shard index, global part) of `box` into its region of `out`, by the paths client.paths
        picks per rank; with `checksums`, the paths that hash as they copy keep there the checksum of each whole
        shard that landed (client.verify's `landed`)."""

        def rank_of(index: int) -> RankStatus:
            return self._session.rank_status(summary.metadata.shards_metadata[index].rank)

        path = self._session.paths.read(
            summary,
            parts,
            box,
            out,
            rank_of=rank_of,
            copies=lambda index: self._session.health.other_copies(summary, index),
            checksums=checksums,
        )
        if path is not None:
            self.last_transport = str(path)
            counters.count_read(
                str(path), box.numel() * summary.metadata.tensor_properties.itemsize
            )

    def _parts(self, summary: TensorSummary, box: Box) -> list[tuple[int, Box]]:
        """The part of `box` each chosen copy serves (ShardsLostError for a box with no live copy)."""
        health = self._session.health
        unavailable = health.unavailable_shards(summary)
        check_readable(summary, box, unavailable)
        return shards_for_box(
            summary.metadata,
            box,
            unavailable=unavailable,
            suspect=health.suspect_shards(summary),
        )

    def _refresh_for_retry(self) -> int:
        self._session.refresh_ranks()
        return self._refresh().version

    def _read_once(self, resolve: Resolve, out: torch.Tensor | None, verify: bool) -> torch.Tensor:
        summary = self._summary()
        box = resolve(summary.metadata.size)
        check_request(summary, box, out)
        parts = self._parts(summary, box)
        target = out if out is not None else torch.empty(box.sizes, dtype=summary.metadata.dtype)
        landed: dict[int, int] | None = {} if verify else None
        self.read_parts(summary, parts, box, target, checksums=landed)
        if target.device.type == "cuda":
            # the parts' copies (made on pool threads' streams) are done
            torch.cuda.synchronize(target.device)
        if landed is not None:
            verify_parts(
                summary,
                parts,
                box,
                target,
                landed=landed,
                read_part=lambda index, part, within, into: self.read_parts(
                    summary, [(index, part)], within, into
                ),
                other_copies=lambda index: self._session.health.other_copies(summary, index),
            )
        return target


def check_request(summary: TensorSummary, box: Box, out: torch.Tensor | None) -> None:
    """InvalidArgumentError unless `box` lies inside the tensor and `out` fits it."""
    try:
        check_box(summary.metadata.size, box)
    except ValueError as err:
        raise InvalidArgumentError(
            f"{err} (tensor {summary.name!r} has shape {summary.metadata.size})"
        ) from None
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != box.sizes:
        raise InvalidArgumentError(f"out has shape {tuple(out.shape)} but sizes are {box.sizes}")
    cast = read_cast_problem(summary.metadata.dtype, out.dtype)
    if cast:
        raise InvalidArgumentError(
            f"out has dtype {out.dtype} but tensor {summary.name!r} is {summary.metadata.dtype} ({cast})"
        )
    problem = _unwritable(out)
    if problem:
        raise InvalidArgumentError(f"out {problem}; pass a plain dense tensor to read into")


def _unwritable(out: torch.Tensor) -> str:
    """Why the read's bytes cannot be copied into `out` in place ("" when they can)."""
    if out.device.type == "meta":
        return "is on the meta device (it holds no data)"
    if out.layout != torch.strided:
        return f"has layout {out.layout}"
    if out.requires_grad:
        return "requires grad (autograd refuses in-place writes into it)"
    if out.is_conj() or out.is_neg():
        return "is a lazily conjugated or negated view"
    if out.is_inference() and not torch.is_inference_mode_enabled():
        return "was made in inference mode"
    if torch._debug_has_internal_overlap(out) == 1:
        return "has elements that share memory (a zero stride, as from expand)"
    return ""
