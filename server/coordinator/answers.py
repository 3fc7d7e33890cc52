"""The coordinator's answers: TensorInfo and SnapshotInfo messages made from records plus live state.

A record holds what the catalog keeps; an answer adds what is true now and is never stored: the shards
whose copy cannot be read (lost, on dead ranks, or on ranks still restoring: reads are admitted only once
every shard is back), the health and replicas that gives, and the repair in flight.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.wire import metadata_into
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.coordinator.catalog.messages import snapshot_to_proto, tensor_into
from shardserve.server.coordinator.catalog.records import SnapshotRecord, TensorRecord
from shardserve.server.coordinator.drivers.repair import RepairInFlight
from shardserve.server.coordinator.ranks.health import UnreadableShards, health_of

KEPT_SNAPSHOT_ANSWERS = 8
"""FULL snapshot answers kept built: every reader of a weight sync's snapshot asks for the same one, and building
it costs ~10 us per tensor (a copy of the kept one, 0.2 us). An answer is kept for one record object and one set
of its ranks that cannot be read (their health is in it), and never while a tensor of it is being repaired. A
commit has the answer of the snapshot it committed built after it answers when its prefix has readers
(prepare_snapshot), so that the get that follows a put finds it as a repeated get does."""


class Answers:
    """Makes answers from records, asking the registry which ranks cannot be read and the repair driver what
    it repairs."""

    def __init__(
        self,
        rank_unreadable: Callable[[int], bool],
        repair: Callable[[str], RepairInFlight | None],
    ) -> None:
        self._rank_unreadable = rank_unreadable
        self._repair = repair
        # FULL snapshot answers by (the record's id, its ranks that cannot be read), with the record they answer
        self._kept_snapshots: OrderedDict[
            tuple[int, frozenset[int]], tuple[SnapshotRecord, pb.SnapshotInfo]
        ] = OrderedDict()
        # the builds under way, by the same keys: a second caller waits for the first one's answer
        self._building: dict[tuple[int, frozenset[int]], Future[pb.SnapshotInfo]] = {}
        self._preparing = ThreadPoolExecutor(1, thread_name_prefix="snapshot-answers")
        self._lock = threading.Lock()

    def tensor(self, record: TensorRecord, update_order: int = 0) -> pb.TensorInfo:
        """`record` as answered: its stored fields, its health now, and `update_order` (row updates)."""
        out = self.tensor_into(pb.TensorInfo(), record, self.unreadable_once())
        out.update_order = update_order
        return out

    def tensors(
        self, records: Iterable[TensorRecord], *, layouts_apart: bool = False
    ) -> pb.ListTensorsResponse:
        """A ListTensors answer of `records`, each as `tensor` answers it; each rank's readability asked once.
        With `layouts_apart`, each distinct layout is in the answer's `layouts` once and each tensor names it."""
        out = pb.ListTensorsResponse()
        unreadable = self.unreadable_once()
        layouts: dict[ShardedTensorMetadata, int] | None = {} if layouts_apart else None
        for record in records:
            layout = None
            if layouts is not None:
                layout = layouts.get(record.metadata)
                if layout is None:
                    layout = layouts[record.metadata] = len(out.layouts)
                    metadata_into(out.layouts.add(), record.metadata)
            self.tensor_into(out.tensors.add(), record, unreadable, layout=layout)
        return out

    def unreadable_once(self) -> UnreadableShards:
        """The shards that cannot be read, for one answer: each rank's readability asked of the registry once,
        each layout's shards on unreadable ranks found once."""
        return UnreadableShards(self._rank_unreadable)

    def tensor_into(
        self,
        out: pb.TensorInfo,
        record: TensorRecord,
        unreadable: UnreadableShards,
        *,
        layout: int | None = None,
    ) -> pb.TensorInfo:
        """`out` filled as `tensor` answers `record`, the shards that cannot be read told by `unreadable`; its
        layout as the index `layout` into the answer's layouts when given (else in full)."""
        tensor_into(out, record, layout=layout)
        unavailable = unreadable.of(record)
        out.unavailable_shards.extend(unavailable)
        health = health_of(record, unavailable)
        if health is not None:
            out.health, out.replicas = health.state, health.replicas
        repair = self._repair(record.name)
        if repair is not None:
            out.repair.CopyFrom(
                pb.RepairState(
                    version=repair.version,
                    bytes_done=repair.bytes_done,
                    bytes_total=repair.bytes_total,
                    started_unix=repair.started_unix,
                    ranks=repair.ranks,
                )
            )
        return out

    def snapshot(
        self, record: SnapshotRecord, view: pb.SnapshotView = pb.SNAPSHOT_VIEW_FULL
    ) -> pb.SnapshotInfo:
        """`record` as answered, each tensor with its health now; without entries in the BASIC view."""
        if view == pb.SNAPSHOT_VIEW_BASIC:
            basic = snapshot_to_proto(replace(record, entries=()))
            basic.nbytes = record.nbytes
            return basic
        return self._full_snapshot(record)

    def prepare_snapshot(self, record: SnapshotRecord) -> None:
        """Build and keep the FULL answer of a snapshot just committed, on a thread of its own, when its prefix
        has readers (the FULL answer of an earlier snapshot of it is kept): they ask for it right after the
        commit (the weight-sync loop's get), and find it kept, or wait for this build rather than make another.
        A prefix nobody reads costs nothing (a 10,000-tensor answer takes ~100 ms to build)."""
        with self._lock:
            read = any(kept.prefix == record.prefix for kept, _ in self._kept_snapshots.values())
        if read:
            with contextlib.suppress(RuntimeError):  # closed: the coordinator is stopping
                self._preparing.submit(self._kept_snapshot, record)

    def close(self) -> None:
        """Let the answer being prepared finish; prepare no more."""
        self._preparing.shutdown(wait=True, cancel_futures=True)

    def _full_snapshot(self, record: SnapshotRecord) -> pb.SnapshotInfo:
        """The FULL answer of `record`: a copy of the one kept for its ranks' readability now, else built (and
        kept, unless a tensor of it is being repaired)."""
        out = pb.SnapshotInfo()
        out.CopyFrom(
            self._kept_snapshot(record)
        )  # one C copy (0.1 ms for 512 tensors); a build ~5 ms
        return out

    def _kept_snapshot(self, record: SnapshotRecord) -> pb.SnapshotInfo:
        """The FULL answer of `record` kept for its ranks' readability now (never to be changed: callers copy
        it), built by this call or by the one building it already; built and not kept while a tensor of it is
        being repaired."""
        unreadable = self.unreadable_once()
        tensors = record.tensors()

        def build() -> pb.SnapshotInfo:
            return snapshot_to_proto(record, lambda out, t: self.tensor_into(out, t, unreadable))

        if any(self._repair(t.name) is not None for t in tensors):  # its progress moves: not kept
            return build()
        # by the record's id: the entry holds the record, so no other object takes that id while it is kept
        key = (id(record), frozenset(rank for rank in _ranks_of(tensors) if unreadable.rank(rank)))
        with self._lock:
            kept = self._kept_snapshots.get(key)
            if kept is not None:
                self._kept_snapshots.move_to_end(key)
                return kept[1]
            building = self._building.get(key)
            mine = building is None
            if mine:
                building = self._building[key] = Future()
        assert building is not None
        if not mine:
            return building.result()
        try:
            answer = build()
        except BaseException as err:
            with self._lock:
                self._building.pop(key, None)
            building.set_exception(err)
            raise
        with self._lock:
            self._building.pop(key, None)
            self._kept_snapshots[key] = (record, answer)
            while len(self._kept_snapshots) > KEPT_SNAPSHOT_ANSWERS:
                self._kept_snapshots.popitem(last=False)
        building.set_result(answer)
        return answer


def _ranks_of(tensors: Sequence[TensorRecord]) -> set[int]:
    """The ranks holding a shard of any of `tensors` (each distinct layout looked at once)."""
    layouts = {id(t.metadata): t.metadata for t in tensors}
    return {
        shard.rank
        for meta in layouts.values()
        for shard in meta.shards_metadata
        if shard.placement is not None
    }
