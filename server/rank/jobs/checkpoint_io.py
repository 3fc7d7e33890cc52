"""The rank side of DCP checkpoints: every rank saves and loads its own shards with torch.distributed.checkpoint.

Each rank hands DCP a `_LocalShards`: a storage-less tensor subclass of the
tensor's global size that implements DCP's `_Checkpointable` protocol
(`__create_write_items__`, `__create_chunk_list__`, `__get_tensor_shard__`,
the protocol torch's LocalShardsWrapper implements). DCP's default planners
do the rest: save plans are deduplicated by chunk offset (replicas are
written once), the coordinator writes `.metadata`, and on load each rank
reads only the saved chunks that overlap its own shards, straight from the
files, resharding as it goes. The checkpoint is a plain DCP checkpoint:
`torch.distributed.checkpoint.load` reads it into a tensor, a DTensor or a
ShardedTensor of any layout on any world size.

Why our own small subclass and not torch's wrappers:
- `LocalShardsWrapper` infers the global size by concatenating the local
  shards along dim 1 (right only for TorchRec's column-wise use inside a
  DTensor), so used alone it writes a wrong tensor size for row-wise or
  grid layouts; wrapping it in a DTensor needs a DeviceMesh whose chunk rule
  our arbitrary boxes (uneven, several per rank) do not follow.
- `ShardedTensor` rejects overlapping shards, so it cannot hold replicas,
  needs its collective constructor or a torch ShardedTensorMetadata whose
  ranks index the process group, and is deprecated in favour of DTensor.

Errors: checks that depend on one rank's input (its shard tensors, its
placement devices) and on the checkpoint (missing key, other size) run inside
DCP's planning step, which gathers every rank's failure and raises on every
rank; they come out as `CheckpointError` on all ranks rather than leaving the
others waiting. All collectives run on `process_group` (gloo for CPU shards),
so the group's timeout (`init_process_group(timeout=...)` or
`new_group(timeout=...)`) bounds every wait.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
)
from torch.distributed.checkpoint.metadata import (
    TensorProperties as DcpTensorProperties,
)
from torch.distributed.checkpoint.planner import (
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from shardserve.core.metadata import Box, ShardedTensorMetadata
from shardserve.core.validation import validate_metadata
from shardserve.server.common.dcp_metadata import checkpoint_dir, tensor_entries
from shardserve.server.rank.jobs.checkpoint_reader import RegionReader

TensorLayouts = Mapping[str, ShardedTensorMetadata]
LocalShards = Mapping[int, torch.Tensor]


class CheckpointError(RuntimeError):
    """A DCP save or load that failed; raised on every rank, naming the ranks and the first cause.

    `failures` maps each failing rank (in the process group) to its exception;
    `reason` is the lowest failing rank's exception (KeyError for a tensor the
    checkpoint lacks, ValueError for a size or shard mismatch, OSError for files).
    """

    def __init__(self, message: str, failures: Mapping[int, BaseException]) -> None:
        super().__init__(message)
        self.failures = dict(failures)
        self.reason = self.failures[min(self.failures)] if self.failures else None


class _LocalShards(torch.Tensor):
    """One rank's shards of one global tensor, as DCP's `_Checkpointable` protocol sees them.

    Holds no storage of its own; `chunks[i]` is the global box of `tensors[i]`.
    Any tensor operation on it raises: DCP only calls the protocol methods.
    """

    _chunks: list[ChunkStorageMetadata]
    _tensors: list[torch.Tensor]
    _properties: DcpTensorProperties

    @staticmethod
    def __new__(
        cls,
        meta: ShardedTensorMetadata,
        boxes: list[Box],
        tensors: list[torch.Tensor],
        device: torch.device,
    ) -> _LocalShards:
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, torch.Size(meta.size), dtype=meta.dtype, device=device
        )
        wrapper._chunks = [
            ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes))
            for b in boxes
        ]
        wrapper._tensors = tensors
        wrapper._properties = DcpTensorProperties(dtype=meta.dtype)
        return wrapper

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        raise NotImplementedError(f"{func} is not supported on a rank's checkpoint shards")

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in self._chunks]
        return f"_LocalShards(size={tuple(self.shape)}, dtype={self.dtype}, chunks={boxes})"

    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk, properties=self._properties, size=self.size()
                ),
            )
            for chunk in self._chunks
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return list(self._chunks)

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        hint = index.index
        if (
            hint is not None
            and hint < len(self._chunks)
            and self._chunks[hint].offsets == index.offset
        ):
            return self._tensors[hint]
        for chunk, tensor in zip(self._chunks, self._tensors):
            if chunk.offsets == index.offset:
                return tensor
        raise ValueError(
            f"this rank holds no shard of {index.fqn!r} at offsets {tuple(index.offset or ())}"
        )


class _CheckedSavePlanner(DefaultSavePlanner):
    """DCP's save planner that first raises this rank's input problems, inside DCP's gathered step."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__()
        self._problems = problems

    def create_local_plan(self) -> Any:
        if self._problems:
            raise ValueError("; ".join(self._problems))
        return super().create_local_plan()


class _CheckedLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner that checks this rank's layouts against the checkpoint before planning reads."""

    def __init__(self, problems: list[str], layouts: TensorLayouts, path: str) -> None:
        super().__init__()
        self._problems = problems
        self._layouts = layouts
        self._path = path

    def create_local_plan(self) -> Any:
        if self._problems:
            raise ValueError("; ".join(self._problems))
        stored = tensor_entries(self.metadata)
        for key, meta in self._layouts.items():
            if key not in stored:
                held = ", ".join(sorted(stored)) or "nothing"
                raise KeyError(
                    f"checkpoint {self._path} holds no tensor {key!r} (it holds: {held})"
                )
            size, dtype = stored[key]
            if tuple(size) != meta.size:
                raise ValueError(
                    f"tensor {key!r} is {tuple(size)} in checkpoint {self._path} but the "
                    f"layout is for size {meta.size}"
                )
        return super().create_local_plan()


def save_shards(
    path: str | os.PathLike,
    key: str,
    meta: ShardedTensorMetadata,
    local_shards: LocalShards,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Write this rank's shards of tensor `key` as a DCP checkpoint at `path`; a collective of the group."""
    save_tensors(path, {key: (meta, local_shards)}, process_group)


def save_tensors(
    path: str | os.PathLike,
    tensors: Mapping[str, tuple[ShardedTensorMetadata, LocalShards]],
    process_group: dist.ProcessGroup | None = None,
    problems: Sequence[str] = (),
) -> None:
    """Write several sharded tensors (key -> (layout, this rank's shards)) as one DCP checkpoint.

    `local_shards` maps indices into `meta.shards_metadata` to this rank's
    tensors of those shards. Every rank of the group calls this with the same
    keys and layouts. Replicas are written once; the checkpoint's `.metadata`
    is written last, by the group's rank 0. `problems` are failures this rank
    met before the call (a shard it could not lease): they fail the save on
    every rank, inside DCP's gathered planning step, like the checks here.
    """
    directory = checkpoint_dir(path, must_exist=False)
    if not isinstance(tensors, Mapping):
        raise TypeError(
            f"tensors must be a dict of key -> (layout, local shards), got {type(tensors).__name__}"
        )
    for key, value in tensors.items():
        if not (isinstance(value, tuple) and len(value) == 2):
            raise TypeError(f"tensors[{key!r}] must be a (layout, local shards) pair")
    _check_layouts({key: meta for key, (meta, _) in tensors.items()}, require_coverage=True)
    problems = list(problems)
    state = {
        key: _shards_for_save(key, meta, shards, problems)
        for key, (meta, shards) in tensors.items()
    }
    writer = dcp.FileSystemWriter(directory)
    _run_dcp(
        f"saving {sorted(tensors)} to {directory}",
        process_group,
        lambda group, no_dist: dcp.save(
            state,
            storage_writer=writer,
            planner=_CheckedSavePlanner(problems),
            process_group=group,
            no_dist=no_dist,
        ),
    )


def load_shards(
    path: str | os.PathLike,
    key: str,
    meta: ShardedTensorMetadata,
    rank: int,
    process_group: dist.ProcessGroup | None = None,
) -> dict[int, torch.Tensor]:
    """This rank's shards (index into `meta.shards_metadata` -> tensor) of `key`, read from the checkpoint."""
    return load_tensors(path, {key: meta}, rank, process_group)[key]


def load_tensors(
    path: str | os.PathLike,
    layouts: TensorLayouts,
    rank: int,
    process_group: dist.ProcessGroup | None = None,
    into: Mapping[str, Mapping[int, torch.Tensor]] | None = None,
    problems: Sequence[str] = (),
) -> dict[str, dict[int, torch.Tensor]]:
    """Read this rank's shards of several tensors (key -> destination layout) from a DCP checkpoint.

    The layouts may differ from the saved ones (DCP reshards on load); each
    rank reads only the chunks overlapping the shards placed on `rank`,
    allocated on their placement's device in the layout's dtype (DCP casts
    if the checkpoint holds another dtype). A collective of the group: every
    rank calls it with the same layouts. Nothing is returned unless every
    rank succeeded. `into` gives buffers for some shards (key -> shard index -> tensor of the shard's sizes and
    dtype, e.g. recycled ones): a load writes every byte of them; the others are allocated. `problems`, as for
    save_tensors, fail the load on every rank.
    """
    directory = checkpoint_dir(path, must_exist=False)
    _check_layouts(layouts, require_coverage=False)
    problems = list(problems)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        problems.append(f"rank must be a non-negative int, got {rank!r}")
        rank = -1  # holds no shards; the problem is raised on every rank inside DCP's planning step
    shards = {
        key: _allocate(key, meta, rank, problems, (into or {}).get(key, {}))
        for key, meta in layouts.items()
    }
    state = {
        key: _LocalShards(
            meta,
            [meta.shards_metadata[i].box for i in _non_empty(shards[key], meta)],
            [shards[key][i] for i in _non_empty(shards[key], meta)],
            _device_of(shards[key]),
        )
        for key, meta in layouts.items()
    }
    _require_checkpoint_on_every_rank(directory, sorted(layouts), process_group)
    planner = _CheckedLoadPlanner(problems, layouts, str(directory))
    _run_dcp(
        f"loading {sorted(layouts)} from {directory}",
        process_group,
        lambda group, no_dist: dcp.load(
            state,
            storage_reader=RegionReader(directory),
            planner=planner,
            process_group=group,
            no_dist=no_dist,
        ),
    )
    return shards


def _single_process(process_group: dist.ProcessGroup | None) -> bool:
    """True when torch.distributed is not initialized: DCP then runs in this process alone."""
    single = not (dist.is_available() and dist.is_initialized())
    if single and process_group is not None:
        raise ValueError("process_group was given but torch.distributed is not initialized")
    return single


def _require_checkpoint_on_every_rank(
    directory: str, keys: list[str], process_group: dist.ProcessGroup | None
) -> None:
    """Raise on every rank, naming the ranks, unless every rank sees the checkpoint's `.metadata`."""
    missing = not os.path.isfile(os.path.join(directory, ".metadata"))
    if _single_process(process_group):
        flags: list[bool | None] = [missing]
    else:
        flags = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(flags, missing, group=process_group)
    ranks = [rank for rank, flag in enumerate(flags) if flag]
    if ranks:
        reason = FileNotFoundError(f"path {directory} is not a DCP checkpoint (no .metadata file)")
        raise CheckpointError(
            f"loading {keys} from {directory} failed on ranks {ranks}: {_describe(reason)}",
            {rank: reason for rank in ranks},
        )


def _run_dcp(
    what: str,
    process_group: dist.ProcessGroup | None,
    call: Callable[[dist.ProcessGroup | None, bool], None],
) -> None:
    """Run a DCP call on `process_group` (single-process when torch.distributed is not initialized)."""
    no_dist = _single_process(process_group)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=".*assuming the intent is to.*single process.*"
            )
            call(process_group, no_dist)
    except CheckpointException as exc:
        failures = {rank: pair[0] for rank, pair in exc.failures.items()}
        first = failures[min(failures)]
        raise CheckpointError(
            f"{what} failed on ranks {sorted(failures)}: {_describe(first)}", failures
        ) from None
    except Exception as exc:  # single-process DCP raises the cause itself
        if not no_dist:
            raise
        raise CheckpointError(f"{what} failed: {_describe(exc)}", {0: exc}) from exc


def _describe(exc: BaseException) -> str:
    text = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    return f"{type(exc).__name__}: {text}"


def _check_layouts(layouts: Mapping[str, Any], require_coverage: bool) -> None:
    """Checks that every rank makes alike (same keys and layouts everywhere), so raising here cannot hang."""
    if not isinstance(layouts, Mapping) or not layouts:
        raise ValueError("give at least one tensor: a mapping of key -> layout")
    for key, meta in layouts.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"tensor keys must be non-empty strings, got {key!r}")
        if not isinstance(meta, ShardedTensorMetadata):
            raise TypeError(
                f"layout of {key!r} must be a ShardedTensorMetadata, got {type(meta).__name__}"
            )
        validate_metadata(meta, require_coverage=require_coverage)


def _shards_for_save(
    key: str, meta: ShardedTensorMetadata, local_shards: LocalShards, problems: list[str]
) -> _LocalShards:
    """This rank's shards of `key` for DCP, each distinct box once; problems are noted, not raised."""
    boxes: dict[Box, torch.Tensor] = {}
    if not isinstance(local_shards, Mapping):
        problems.append(
            f"local_shards of {key!r} must be a dict of shard index -> tensor, "
            f"got {type(local_shards).__name__}"
        )
        local_shards = {}
    for index, tensor in sorted(local_shards.items(), key=lambda item: repr(item[0])):
        where = f"local_shards[{index!r}] of {key!r}"
        if (
            isinstance(index, bool)
            or not isinstance(index, int)
            or not 0 <= index < len(meta.shards_metadata)
        ):
            problems.append(
                f"{where}: index is not a shard of the layout (0..{len(meta.shards_metadata) - 1})"
            )
            continue
        box = meta.shards_metadata[index].box
        if not isinstance(tensor, torch.Tensor):
            problems.append(f"{where} is a {type(tensor).__name__}, not a tensor")
        elif tuple(tensor.shape) != box.sizes:
            problems.append(
                f"{where} has shape {tuple(tensor.shape)} but the shard's size is {box.sizes}"
            )
        elif tensor.dtype != meta.dtype:
            problems.append(
                f"{where} has dtype {tensor.dtype} but the layout's dtype is {meta.dtype}"
            )
        elif not box.is_empty() or (
            index == 0 and meta.numel() == 0
        ):  # an empty tensor: one empty chunk, as
            boxes.setdefault(box, tensor.detach())  # dcp.save writes (else no entry at all)
    return _LocalShards(meta, list(boxes), list(boxes.values()), _device_of(boxes))


def _allocate(
    key: str,
    meta: ShardedTensorMetadata,
    rank: int,
    problems: list[str],
    given: Mapping[int, torch.Tensor],
) -> dict[int, torch.Tensor]:
    """Tensors for the shards of `meta` placed on `rank`: the given ones that fit, else new empty ones on their
    placement's device."""
    shards = {}
    for index in meta.shards_on(rank):
        shard = meta.shards_metadata[index]
        buffer = given.get(index)
        if (
            isinstance(buffer, torch.Tensor)
            and tuple(buffer.shape) == shard.shard_sizes
            and buffer.dtype == meta.dtype
            and buffer.device == shard.device
        ):
            shards[index] = buffer
            continue
        try:
            shards[index] = torch.empty(shard.shard_sizes, dtype=meta.dtype, device=shard.device)
        except (RuntimeError, AssertionError) as exc:
            problems.append(f"cannot allocate shard {index} of {key!r} on {shard.placement}: {exc}")
    return shards


def _non_empty(shards: dict[int, torch.Tensor], meta: ShardedTensorMetadata) -> list[int]:
    return [i for i in shards if not meta.shards_metadata[i].box.is_empty()]


def _device_of(tensors: Mapping[Any, torch.Tensor]) -> torch.device:
    return next(iter(tensors.values())).device if tensors else torch.device("cpu")
