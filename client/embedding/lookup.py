"""Embedding lookups of one client: rows of several tables, or pooled bags, one round trip per rank.

- rows: distinct ids are looked up once (from the optional row cache first),
  routed to one replica of each row band (every column shard of it), asked of
  all ranks in parallel with one Lookup call per rank carrying every table's
  items (client.embedding.exchange), and put back in the caller's order.
  A table whose every shard is mapped from this host is gathered straight
  from the mappings instead (client.embedding.mapped_rows).
- bags: each shard pools the ids it owns into per-bag partial sums and counts
  on the server (only pooled rows travel); the client adds them up
  (shardcore.embedding.combine_partials). A bag whose ids all live on one
  shard is bit for bit `F.embedding_bag`; a bag spread over shards is summed
  in another order (within a few ulps). `pooling="client"` fetches the rows
  and pools them locally instead, bit for bit in every case; the client does
  that by itself when a request holds out-of-range ids answered with
  zero/default rows, and (with pooling="auto") when a row cache is on or
  every rank of the table is read through shared memory (same host: the rows
  cost no transfer). With pooling="auto" a table whose every shard is mapped
  is pooled on the mappings themselves, no row copied out
  (client.embedding.mapped_rows): bit for bit where its shards hold whole
  rows, else summed shard by shard as the ranks do.

Ids on a GPU (lookup_on, lookup_bag_on: what RemoteEmbedding and RemoteEmbeddingBag call) go the route
client.embedding.routes chooses from where the shards are and what their paths map: on the GPU against the
CUDA shards mapped on this host (client.embedding.cuda_rows), gathered on the CPU from mapped rows into pinned
memory with only the result copied up, or as a CPU lookup whose result is copied up.

The server side of these calls is server/rank/reads/lookup.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from shardserve.client import counters
from shardserve.client.embedding.cuda_rows import CudaRows
from shardserve.client.embedding.exchange import CPU_TURN, send_calls
from shardserve.client.embedding.ids import (
    POOLINGS,
    BagRequest,
    as_device_ids,
    as_ids,
    bag_request,
    check_dtype,
)
from shardserve.client.embedding.mapped_rows import MappedRows
from shardserve.client.embedding.plan import ItemPlan, RowPlan, bag_items, split_columns
from shardserve.client.embedding.routes import Route, choose_route
from shardserve.client.embedding.row_cache import RowCache
from shardserve.client.embedding.views import TableView, TableViews, bad_id_error
from shardserve.client.errors import InvalidArgumentError, ShardServeError
from shardserve.client.retry import read_with_refresh
from shardserve.client.session import Session
from shardserve.core.embedding import combine_partials, pool_bags

T = TypeVar("T")


class Lookups:
    """The lookups of one client over its table views; `last_paths` says how each rank answered last."""

    def __init__(
        self, session: Session, cache: RowCache | None = None, cache_max_age: float = 1.0
    ) -> None:
        self._session = session
        self.views = TableViews(session, cache, cache_max_age)
        self.cache = cache
        self.last_paths: dict[
            int, str
        ] = {}  # rank -> "shm", "bulk", "grpc" or "shm+bulk"...: its latest answer's path
        self._mapped: dict[
            str, tuple[TableView, MappedRows | None]
        ] = {}  # name -> the fast path of its view
        self._cuda: dict[
            str, tuple[TableView, CudaRows | None]
        ] = {}  # name -> its view's GPU route

    def _with_retry(self, names: Sequence[str], run: Callable[[dict[str, TableView]], T]) -> T:
        """run(views) at the cached versions; on a stale version refresh every table and retry."""

        def refresh() -> tuple[int, ...]:
            self._session.refresh_ranks()
            return tuple(self.views.view(name, refresh=True).version for name in names)

        return read_with_refresh(
            lambda: run({name: self.views.view(name) for name in names}),
            refresh,
            self._session.channel.timeout,
        )

    # ------------------------------------------------------------ rows

    def lookup(
        self, requests: Mapping[str, Any], dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """Rows [len(ids), dim] of several tables, one Lookup call per rank."""
        self._session.check_open()
        ids = {name: as_ids(value, f"ids[{name!r}]") for name, value in requests.items()}
        check_dtype(dtype)
        counters.count("lookups")
        counters.count("lookup_ids", sum(int(table_ids.numel()) for table_ids in ids.values()))
        return self._with_retry(list(ids), lambda views: self._lookup_once(views, ids, dtype))

    def _lookup_once(
        self,
        views: dict[str, TableView],
        ids: dict[str, torch.Tensor],
        dtype: torch.dtype | None,
        also: Sequence[ItemPlan] = (),
        *,
        pinned: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Each table from its mapped shards when it can (client.embedding.mapped_rows; into pinned memory when
        asked), the rest by routed Lookup calls; `also` (pooled items of other tables) rides in the same calls
        and gets its answers."""
        results, rest = {}, {}
        for name, table_ids in ids.items():
            mapped = self._mapped_rows(
                views[name]
            )  # may map shards (an OpenShard call): outside the turn
            with CPU_TURN:
                rows = mapped.rows(table_ids, pinned=pinned) if mapped is not None else None
            if rows is None:
                rest[name] = table_ids
                continue
            results[name] = rows if dtype is None else rows.to(dtype)
            self.last_paths.update((rank, "shm") for rank in views[name].ranks)
        if rest or also:
            results.update(self._lookup_routed(views, rest, dtype, also))
        return {name: results[name] for name in ids}

    def _mapped_rows(self, view: TableView) -> MappedRows | None:
        """The mapped fast path of `view` (built once per version; retried while ranks are not all mapped)."""
        if self.cache is not None:
            return None  # the row cache counts hits and misses per row: the general path keeps it exact
        if view.lost_shards:
            return None  # the general path serves the ids of live boxes and names the lost ones
        known = self._mapped.get(view.name)
        if (
            known is not None
            and known[0] is view
            and (known[1] is not None or not self._all_mapped(view))
        ):
            return known[1]
        built = MappedRows.build(view, self._session) if self._all_mapped(view) else None
        self._mapped[view.name] = (view, built)
        return built

    def _cuda_rows(self, view: TableView) -> CudaRows | None:
        """The GPU route of `view` (built once per version), None where its shards allow none."""
        if self.cache is not None or view.lost_shards:
            return None  # as _mapped_rows: the general path keeps the row cache exact and names lost shards
        known = self._cuda.get(view.name)
        if known is not None and known[0] is view:
            return known[1]
        built = CudaRows.build(view, self._session)
        self._cuda[view.name] = (view, built)
        return built

    def is_mapped(self, name: str) -> bool:
        """Whether the rows of the latest view of `name` are gathered from mapped shards
        (client.embedding.mapped_rows; column-split tables pool their bags there but route their rows)."""
        known = self._mapped.get(name)
        return known is not None and known[1] is not None and known[1].serves_rows

    def _lookup_routed(
        self,
        views: dict[str, TableView],
        ids: dict[str, torch.Tensor],
        dtype: torch.dtype | None,
        also: Sequence[ItemPlan] = (),
    ) -> dict[str, torch.Tensor]:
        items: list[ItemPlan] = list(also)
        with CPU_TURN:
            plans = {name: RowPlan.of(views[name], table_ids) for name, table_ids in ids.items()}
        for plan in plans.values():
            if plan.bad is not None:
                self.views.recheck_bad_ids(plan.view)  # may ask the coordinator: outside the turn
        with CPU_TURN:
            for name, plan in plans.items():
                if plan.bad is not None and plan.view.oov == "error":
                    raise bad_id_error(plan.view, ids[name], plan.bad_per_id())
                plan.wanted = self._from_cache(plan)
                planned = plan.items()
                plan.view.check_routed([item.message.shard_index for item in planned])
                items.extend(planned)
            exchange = send_calls(self._session, items, self.last_paths)
        exchange.wait()
        with CPU_TURN:
            exchange.finish()
            return {
                name: self._rows_of(plan, [item for item in items if item.view is plan.view], dtype)
                for name, plan in plans.items()
            }

    def _rows_of(
        self, plan: RowPlan, items: list[ItemPlan], dtype: torch.dtype | None
    ) -> torch.Tensor:
        """The rows asked of one table, in the caller's order, from its answered items (and into the cache)."""
        rows = plan.distinct_rows(items)
        if self.cache is not None and plan.wanted is not None and plan.wanted.size:
            self.cache.put_many(
                plan.view.name,
                plan.view.version,
                plan.unique[plan.wanted].tolist(),
                rows[torch.from_numpy(plan.wanted)],
            )
        rows = plan.in_callers_order(rows)
        return rows if dtype is None else rows.to(dtype)

    def _from_cache(self, plan: RowPlan) -> np.ndarray | None:
        """Fill the plan's rows from the row cache; return the positions (in plan.unique) still to fetch, or
        None for all of them."""
        todo = None if plan.bad is None else np.flatnonzero(~plan.bad)
        if self.cache is None:
            return todo
        if todo is None:
            todo = np.arange(plan.unique.size)
        if not todo.size:
            return todo
        keys = plan.unique[todo].tolist()
        found = self.cache.get_many(plan.view.name, plan.view.version, keys)
        if not found:
            return todo
        hit = np.fromiter((k in found for k in keys), dtype=bool, count=len(keys))
        plan.rows()[torch.from_numpy(todo[hit])] = torch.stack(
            [found[k] for k in keys if k in found]
        )
        return todo[~hit]

    # ------------------------------------------------------------ bags

    def lookup_bag(
        self,
        name: str,
        ids: Any,
        offsets: Any,
        mode: str = "mean",
        per_sample_weights: torch.Tensor | None = None,
        *,
        dtype: torch.dtype | None = None,
        pooling: str = "auto",
    ) -> torch.Tensor:
        """Pooled bags [len(offsets), dim] with nn.EmbeddingBag semantics (include_last_offset=False)."""
        request = bag_request(as_ids(ids), as_ids(offsets, "offsets"), mode, per_sample_weights)
        return self.lookup_bags({name: request}, dtype, pooling)[name]

    def lookup_bags(
        self,
        requests: Mapping[str, BagRequest],
        dtype: torch.dtype | None = None,
        pooling: str = "auto",
    ) -> dict[str, torch.Tensor]:
        """Pooled bags of several tables, {name: bag_request(...)} -> {name: [bags, dim]}, one Lookup call per
        rank for all of them (what lookup_bag does for one table)."""
        self._session.check_open()
        if pooling not in POOLINGS:
            raise InvalidArgumentError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        check_dtype(dtype)
        counters.count("lookups")
        counters.count("lookup_ids", sum(int(r.ids.numel()) for r in requests.values()))
        pooled = self._with_retry(
            list(requests), lambda views: self._bags_once(views, requests, pooling)
        )
        return pooled if dtype is None else {name: p.to(dtype) for name, p in pooled.items()}

    def _bags_once(
        self, views: dict[str, TableView], requests: Mapping[str, BagRequest], pooling: str
    ) -> dict[str, torch.Tensor]:
        """Bags pooled on mapped shards where they can be (pooling="auto"), else pooled here from looked-up rows
        where _pools_here says so, by the ranks otherwise; the row lookups and the pooled items of every table
        share one round of calls."""
        pooled = self._mapped_bags(views, requests) if pooling == "auto" else {}
        here = {
            name: r
            for name, r in requests.items()
            if name not in pooled and self._pools_here(views[name], r, pooling)
        }
        on_ranks = {
            name: bag_items(views[name], r)
            for name, r in requests.items()
            if name not in here and name not in pooled
        }
        for name, items in on_ranks.items():
            views[name].check_routed([item.message.shard_index for item in items])
        rows = self._lookup_once(
            {name: views[name] for name in here},
            {name: r.ids for name, r in here.items()},
            None,
            [item for items in on_ranks.values() for item in items],
        )
        with CPU_TURN:
            for name, r in here.items():
                pooled[name] = pool_bags(rows[name], r.offsets, r.mode, r.weights)
            for name, items in on_ranks.items():
                pooled[name] = self._combined(views[name], requests[name], items)
        return {name: pooled[name] for name in requests}

    def _mapped_bags(
        self, views: dict[str, TableView], requests: Mapping[str, BagRequest]
    ) -> dict[str, torch.Tensor]:
        """The requests whose bags are pooled straight from the table's mapped shards
        (client.embedding.mapped_rows: one embedding_bag per shard, no row copied out)."""
        pooled = {}
        for name, r in requests.items():
            view = views[name]
            if r.weights is not None and r.weights.dtype != view.dtype:
                continue  # _pools_here names the mismatch
            mapped = self._mapped_rows(view)  # may map shards (an OpenShard call): outside the turn
            if mapped is None:
                continue
            with CPU_TURN:
                bags = mapped.bags(r.ids, r.offsets, mode=r.mode, weights=r.weights)
            if bags is not None:
                pooled[name] = bags
                self.last_paths.update((rank, "shm") for rank in view.ranks)
        return pooled

    def _pools_here(self, view: TableView, request: BagRequest, pooling: str) -> bool:
        """Whether `request`'s bags are pooled on this side (bit for bit F.embedding_bag): asked for, ids out of
        range answered with zero/default rows, a row cache on, or every rank read through shared memory."""
        weights = request.weights
        if weights is not None and weights.dtype != view.dtype:
            raise InvalidArgumentError(
                f"per_sample_weights has dtype {weights.dtype} but table {view.name!r} "
                f"is {view.dtype}; torch's embedding_bag needs the same dtype"
            )
        bad = view.index.invalid_mask(request.ids)
        if bool(bad.any()):
            self.views.recheck_bad_ids(view)
            if view.oov == "error":
                raise bad_id_error(view, request.ids, bad)
        return (
            pooling == "client"
            or bool(bad.any())
            or (pooling == "auto" and (self.cache is not None or self._all_mapped(view)))
        )

    def _combined(
        self, view: TableView, request: BagRequest, items: list[ItemPlan]
    ) -> torch.Tensor:
        """Bags pooled by the ranks into per-shard partial sums (the items' answers), added up here."""
        if not items:
            return torch.zeros((request.offsets.numel(), view.dim), dtype=view.dtype)
        sizes = torch.diff(
            request.offsets, append=request.offsets.new_tensor([request.ids.numel()])
        )
        try:
            return combine_partials(
                split_columns([item.answer for item in items]), request.mode, view.dtype, sizes
            )
        except ValueError as err:
            raise ShardServeError(
                f"ranks answered inconsistent partial bags for {view.name!r}: {err}"
            ) from None

    def _all_mapped(self, view: TableView) -> bool:
        """Whether every rank holding `view` is read through shared memory now (then pooling on this side costs
        no transfer and is bit for bit F.embedding_bag)."""
        return all(self._session.paths.maps(self._session.rank_status(rank)) for rank in view.ranks)

    # ------------------------------------------------------------ ids on a device

    def route(self, name: str, device: torch.device | str) -> Route:
        """The way a lookup of `name` whose ids are on `device` goes now (client.embedding.routes)."""
        return self._route(self.views.view(name), torch.device(device).type)

    def _route(self, view: TableView, device_type: str) -> Route:
        paths, shards = self._session.paths, view.summary.metadata.shards_metadata
        return choose_route(
            device_type,
            [
                (
                    shards[box.shard].device.type,
                    paths.mapped_devices(self._session.rank_status(box.rank)),
                )
                for box in view.index.boxes
            ],
        )

    def lookup_on(
        self, name: str, ids: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Rows [len(ids), dim] of table `name` for 1-D integer `ids` on any device, on that device: a CPU
        lookup (lookup) for CPU ids, else by the route client.embedding.routes chooses."""
        if ids.device.type != "cuda":
            return self.lookup({name: ids}, dtype)[name]
        self._session.check_open()
        check_dtype(dtype)
        ids = as_device_ids(ids)
        counters.count("lookups")
        counters.count("lookup_ids", int(ids.numel()))
        return self._with_retry([name], lambda views: self._rows_on(views[name], ids, dtype))

    def _rows_on(
        self, view: TableView, ids: torch.Tensor, dtype: torch.dtype | None
    ) -> torch.Tensor:
        """lookup_on's work for CUDA ids at the view's version."""
        route = self._route(view, ids.device.type)
        if route is Route.CUDA_MAPPED:
            cuda = self._cuda_rows(view)  # may map shards (an OpenShard call): outside the turn
            rows = cuda.rows(ids) if cuda is not None else None
            if rows is not None:
                self.last_paths.update((rank, "shm") for rank in view.ranks)
                return rows if dtype is None else rows.to(dtype)
        rows = self._lookup_once(
            {view.name: view}, {view.name: ids.cpu()}, dtype, pinned=route is Route.HOST_MAPPED
        )[view.name]
        return rows.to(ids.device, non_blocking=True)

    def lookup_bag_on(
        self,
        name: str,
        ids: torch.Tensor,
        offsets: Any,
        mode: str = "mean",
        per_sample_weights: torch.Tensor | None = None,
        *,
        dtype: torch.dtype | None = None,
        pooling: str = "auto",
    ) -> torch.Tensor:
        """Pooled bags [len(offsets), dim] as lookup_bag gives them, for 1-D integer `ids` on any device, on that
        device: lookup_bag for CPU ids, else by the route client.embedding.routes chooses (with
        pooling="auto" the GPU route pools on the GPU; another pooling goes as lookup_bag does)."""
        if ids.device.type != "cuda":
            return self.lookup_bag(
                name, ids, offsets, mode, per_sample_weights, dtype=dtype, pooling=pooling
            )
        self._session.check_open()
        if pooling not in POOLINGS:
            raise InvalidArgumentError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        check_dtype(dtype)
        ids = as_device_ids(ids)
        if isinstance(offsets, torch.Tensor):
            offsets = as_device_ids(offsets, "offsets").to(ids.device)
        else:
            offsets = as_ids(offsets, "offsets").to(ids.device)
        request = bag_request(ids, offsets, mode, per_sample_weights)
        counters.count("lookups")
        counters.count("lookup_ids", int(ids.numel()))
        pooled = self._with_retry(
            [name], lambda views: self._bags_on(views[name], request, pooling)
        )
        return pooled if dtype is None else pooled.to(dtype)

    def _bags_on(self, view: TableView, request: BagRequest, pooling: str) -> torch.Tensor:
        """lookup_bag_on's work for CUDA ids at the view's version."""
        weights = request.weights
        if (
            pooling == "auto"
            and (weights is None or weights.dtype == view.dtype)
            and self._route(view, request.ids.device.type) is Route.CUDA_MAPPED
        ):
            cuda = self._cuda_rows(view)
            pooled = (
                cuda.bags(request.ids, request.offsets, mode=request.mode, weights=weights)
                if cuda is not None
                else None
            )
            if pooled is not None:
                self.last_paths.update((rank, "shm") for rank in view.ranks)
                return pooled
        on_host = BagRequest(
            request.ids.cpu(),
            request.offsets.cpu(),
            request.mode,
            None if weights is None else weights.cpu(),
        )
        pooled = self._bags_once({view.name: view}, {view.name: on_host}, pooling)[view.name]
        return pooled.to(request.ids.device, non_blocking=True)
