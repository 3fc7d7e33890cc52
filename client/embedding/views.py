"""What a lookup needs of a table at one version (TableView) and the cache of those views (TableViews).

A view holds the table's layout, a `RowIndex` for vectorized routing, and its
out-of-range policy ("error", "zero" or "default" with a default row, set by
create/put through `table_options`). Views are refreshed when a rank no longer
serves their version, so an answer never mixes versions.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import torch

from shardserve.client import catalog_requests as catalog
from shardserve.client.arguments import dense_tensor
from shardserve.client.embedding.row_cache import RowCache
from shardserve.client.errors import InvalidArgumentError, StaleVersionError
from shardserve.client.health import unreadable
from shardserve.client.info import TensorSummary
from shardserve.client.session import Session
from shardserve.core.routing import RowIndex
from shardserve.core.tensor_options import TensorOptions
from shardserve.core.wire import tensor_bytes
from shardserve.protos import shardserve_pb2 as pb

OOV_NAMES = {pb.OOV_ERROR: "error", pb.OOV_ZERO: "zero", pb.OOV_DEFAULT: "default"}
OOV_RECHECK_S = (
    1.0  # how old a table view may be when ids out of its range are answered from it alone
)


@dataclass(frozen=True, eq=False)
class TableView:
    """A 2-D table at one version: layout, routing index (to available copies), out-of-range policy and default
    row."""

    summary: TensorSummary
    oov: str
    default_row: torch.Tensor | None
    index: RowIndex = field(repr=False)
    unavailable: frozenset[int] = (
        frozenset()
    )  # shards with no readable copy, as the coordinator said
    suspect: frozenset[int] = frozenset()  # shards on ranks that failed this client's calls lately

    @classmethod
    def from_info(
        cls,
        info: pb.TensorInfo,
        unavailable: frozenset[int] | None = None,
        suspect: frozenset[int] = frozenset(),
    ) -> TableView:
        """The view of `info`, routing each box to a copy outside `unavailable` (default: the answer's) and
        `suspect` where it has one."""
        summary = TensorSummary.from_proto(info)
        unavailable = summary.unavailable if unavailable is None else unavailable
        meta = summary.metadata
        if meta.ndim != 2:
            raise InvalidArgumentError(
                f"tensor {info.name!r} has shape {meta.size}; lookups need a 2-D table"
            )
        oov = OOV_NAMES.get(info.options.oov, "error")
        default = None
        if oov == "default":
            default = torch.frombuffer(
                bytearray(info.options.default_row), dtype=meta.dtype
            ).clone()
        return cls(
            summary,
            oov,
            default,
            RowIndex(meta, unavailable=unavailable, suspect=suspect),
            unavailable,
            suspect,
        )

    @property
    def name(self) -> str:
        return self.summary.name

    @property
    def version(self) -> int:
        return self.summary.version

    @property
    def dim(self) -> int:
        return self.summary.metadata.size[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.summary.metadata.dtype

    @functools.cached_property
    def ranks(self) -> tuple[int, ...]:
        """The ranks lookups are routed to: those holding the chosen copy of each box (sorted)."""
        return tuple(sorted({box.rank for box in self.index.boxes}))

    @functools.cached_property
    def lost_shards(self) -> frozenset[int]:
        """The routed shards whose box has no readable copy (pick_copy chooses an unavailable copy only then)."""
        return frozenset(box.shard for box in self.index.boxes if box.shard in self.unavailable)

    def check_routed(self, shards: Sequence[int]) -> None:
        """ShardsLostError or RankUnavailableError (client.health.unreadable) when a lookup was routed to a
        shard whose box has no readable copy."""
        if not self.lost_shards:
            return
        lost = sorted({shard for shard in shards if shard in self.lost_shards})
        if lost:
            meta = self.summary.metadata
            raise unreadable(self.summary, [meta.shards_metadata[shard].box for shard in lost])

    @property
    def complete(self) -> bool:
        """Whether every row 0..rows-1 is held whole by the layout (then only the range needs checking)."""
        return self.index.covers_every_row

    def invalid(self, sorted_ids: np.ndarray) -> np.ndarray | None:
        """Mask of the ids no shard holds (out of range or in a hole), or None when there is none."""
        if not sorted_ids.size:
            return None
        if self.complete and sorted_ids[0] >= 0 and sorted_ids[-1] < self.summary.metadata.size[0]:
            return None
        bad = self.index.invalid_array(sorted_ids)
        return bad if bool(bad.any()) else None

    def fill_row(self) -> torch.Tensor:
        """What an out-of-range id looks up under this table's policy (zero or default)."""
        return (
            self.default_row
            if self.default_row is not None
            else torch.zeros(self.dim, dtype=self.dtype)
        )


class TableViews:
    """The cached view of each table one client looked up (and the row cache's view ages)."""

    def __init__(
        self, session: Session, cache: RowCache | None = None, cache_max_age: float = 1.0
    ) -> None:
        self._session = session
        self.cache = cache
        self.cache_max_age = cache_max_age
        self._views: dict[str, TableView] = {}
        self._fetched: dict[str, float] = {}
        self._lock = threading.Lock()

    def view(self, name: str, refresh: bool = False) -> TableView:
        """The cached view of `name` (fetched from the coordinator when missing or when asked).

        With a row cache, lookups answered from it alone never reach a rank that would say the version
        is stale, so the view is also refreshed when older than `cache_max_age` seconds.
        """
        with self._lock:
            view = self._views.get(name)
            age = time.monotonic() - self._fetched.get(name, 0.0)
            if self.cache is not None and age > self.cache_max_age:
                refresh = True
            if view is not None and (view.unavailable or view.suspect):
                # copies avoided are a lease (client.health): asked again once it is old
                refresh = refresh or age >= self._session.health.lease_s
        if view is None or refresh or view.version < self._session.newest_seen(name):
            view = self._fetch(name)
        return view

    def _fetch(self, name: str) -> TableView:
        """The view of the READY version of `name`, routed to available copies (the cached one while the version
        and the copies to avoid are unchanged)."""
        info = self._session.call("GetTensor", catalog.get_tensor_request(name))
        self._session.saw_version(info.name, info.version)
        summary = TensorSummary.from_proto(info)
        unavailable = self._session.health.unavailable_shards(summary)
        suspect = self._session.health.suspect_shards(summary)
        with self._lock:
            old = self._views.get(name)
        same = old is not None and (old.version, old.unavailable, old.suspect) == (
            info.version,
            unavailable,
            suspect,
        )
        view = old if same and old is not None else TableView.from_info(info, unavailable, suspect)
        with self._lock:
            old = self._views.get(name)
            if (
                old is None or old.version <= view.version
            ):  # the same version: the newer choice of copies
                self._views[name] = view
            view = self._views[name]
            self._fetched[name] = time.monotonic()
        if self.cache is not None:
            self.cache.invalidate_older(name, view.version)
        return view

    def forget(self, name: str) -> None:
        with self._lock:
            self._views.pop(name, None)

    def recheck_bad_ids(self, view: TableView) -> None:
        """Ids the cached view finds out of range, which no rank is asked about, may be in range of a newer
        version (the table was replaced, perhaps by another client): a view older than OOV_RECHECK_S is fetched
        again first, and a newer version retries the lookup (StaleVersionError) rather than answer the old
        layout's error or out-of-range rows."""
        with self._lock:
            fetched = self._fetched.get(view.name, 0.0)
        if time.monotonic() - fetched < OOV_RECHECK_S:
            return
        fresh = self.view(view.name, refresh=True)
        if fresh.version != view.version:
            raise StaleVersionError(
                f"table {view.name!r} is at version {fresh.version}, not {view.version}",
                grpc.StatusCode.FAILED_PRECONDITION,
            )


def bad_id_error(view: TableView, ids: torch.Tensor, bad: torch.Tensor) -> InvalidArgumentError:
    position = int(bad.nonzero()[0, 0])
    rows = view.summary.metadata.size[0]
    return InvalidArgumentError(
        f"ids[{position}]={int(ids[position])} is out of range for table {view.name!r} of {rows} rows "
        f"({int(bad.sum())} bad id(s) in all; the table's oov policy is 'error')",
        grpc.StatusCode.INVALID_ARGUMENT,
    )


def table_options(
    oov: str, default_row: Any, shape: Sequence[int], dtype: torch.dtype
) -> TensorOptions:
    """Table options for create/put: oov "error" (default), "zero" or "default" (needs default_row)."""
    policies = {name: number for number, name in OOV_NAMES.items()}
    if oov not in policies:
        raise InvalidArgumentError(f"oov must be one of {sorted(policies)}, got {oov!r}")
    if oov != "default":
        if default_row is not None:
            raise InvalidArgumentError(
                f"default_row is only used with oov='default', got oov={oov!r}"
            )
        return TensorOptions(oov=oov)
    if len(shape) != 2:
        raise InvalidArgumentError(f"oov='default' needs a 2-D table, got shape {tuple(shape)}")
    if not isinstance(default_row, torch.Tensor) or tuple(default_row.shape) != (shape[1],):
        got = (
            tuple(default_row.shape)
            if isinstance(default_row, torch.Tensor)
            else type(default_row).__name__
        )
        raise InvalidArgumentError(
            f"default_row must be a tensor of shape ({shape[1]},), got {got}"
        )
    dense_tensor(default_row, "default_row")
    if not torch.can_cast(default_row.dtype, dtype):
        raise TypeError(
            f"default_row has dtype {default_row.dtype}, which a {dtype} table cannot hold without "
            f"losing its kind (torch.can_cast)"
        )
    row = default_row.detach().cpu().to(dtype).contiguous()
    return TensorOptions(oov="default", default_row=bytes(tensor_bytes(row)))
