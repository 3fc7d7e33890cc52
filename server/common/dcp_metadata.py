"""Reading a DCP checkpoint's `.metadata` without running arbitrary pickle.

torch's FileSystemReader reads `.metadata` with plain `pickle.load`, so a
checkpoint directory someone else wrote could run any code in the
coordinator or a rank that opens it. The file only ever holds DCP's metadata
dataclasses, torch sizes, dtypes and layouts, and a path; this unpickler
finds those classes and refuses every other global with CheckpointMetadataError.
"""

from __future__ import annotations

import os
import pickle
from typing import IO, Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)

_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "TensorProperties",
            "ChunkStorageMetadata",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
}


class CheckpointMetadataError(ValueError):
    """A `.metadata` file that is not DCP metadata (unreadable, truncated, or naming anything else)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise CheckpointMetadataError(f"it names {module}.{name}, which DCP metadata never holds")


def load_metadata(stream: IO[bytes], where: str | os.PathLike) -> Metadata:
    """The DCP Metadata pickled in `stream` (the `.metadata` of checkpoint `where`), allow-listed classes only."""
    try:
        metadata = _MetadataUnpickler(stream).load()
    except CheckpointMetadataError as err:
        raise CheckpointMetadataError(f"{where}/.metadata is not DCP metadata: {err}") from None
    except (
        pickle.UnpicklingError,
        EOFError,
        AttributeError,
        TypeError,
        ValueError,
        IndexError,
    ) as err:
        raise CheckpointMetadataError(
            f"{where}/.metadata is not DCP metadata: {type(err).__name__}: {err}"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointMetadataError(
            f"{where}/.metadata holds a {type(metadata).__name__}, not DCP Metadata"
        )
    problem = _structure_problem(metadata)
    if problem:
        raise CheckpointMetadataError(f"{where}/.metadata is not DCP metadata: {problem}")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def _structure_problem(metadata: Metadata) -> str:
    """What is wrong with the shape of unpickled Metadata (the allow-list admits the right classes, not right
    contents): "" when every entry is a well-formed tensor or bytes entry."""
    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(entries, dict):
        return f"state_dict_metadata is a {type(entries).__name__}, not a dict"
    for key, entry in entries.items():
        if not isinstance(key, str) or not key or not key.isprintable():
            return f"key {key!r} is not a non-empty printable string"
        if isinstance(entry, BytesStorageMetadata):
            continue
        if not isinstance(entry, TensorStorageMetadata):
            return f"entry {key!r} is a {type(entry).__name__}"
        problem = _tensor_problem(entry)
        if problem:
            return f"entry {key!r}: {problem}"
    return ""


def _tensor_problem(entry: TensorStorageMetadata) -> str:
    if not isinstance(getattr(entry.properties, "dtype", None), torch.dtype):
        return "properties hold no dtype"
    if not _is_extent(entry.size):
        return "size is not a tuple of sizes in [0, 2**63)"
    if not isinstance(entry.chunks, list):
        return f"chunks is a {type(entry.chunks).__name__}, not a list"
    for i, chunk in enumerate(entry.chunks):
        if not (
            isinstance(chunk, ChunkStorageMetadata)
            and _is_extent(chunk.offsets)
            and _is_extent(chunk.sizes)
            and len(chunk.offsets) == len(chunk.sizes) == len(entry.size)
        ):
            return f"chunks[{i}] is not offsets and sizes of the tensor's {len(entry.size)} dims"
    return ""


def _is_extent(values: Any) -> bool:
    try:  # a torch.Size holding an int past int64 raises when read
        return isinstance(values, (tuple, list)) and all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63 for v in values
        )
    except (ValueError, OverflowError):
        return False


def checkpoint_tensors(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Global size and dtype of every tensor in the DCP checkpoint at `path` (from its metadata)."""
    directory = checkpoint_dir(path, must_exist=True)
    with open(os.path.join(directory, ".metadata"), "rb") as stream:
        metadata = load_metadata(stream, directory)
    return {key: (tuple(size), dtype) for key, (size, dtype) in tensor_entries(metadata).items()}


def checkpoint_dir(path: str | os.PathLike, must_exist: bool) -> str:
    """`path` as a directory name; FileNotFoundError when `must_exist` and it holds no DCP `.metadata`."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"path must be a non-empty path to a checkpoint directory, got {path!r}")
    directory = os.fspath(path)
    if must_exist and not os.path.isfile(os.path.join(directory, ".metadata")):
        raise FileNotFoundError(f"path {directory} is not a DCP checkpoint (no .metadata file)")
    return directory


def tensor_entries(metadata: Any) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Global size and dtype of every tensor entry of DCP metadata."""
    return {
        key: (value.size, value.properties.dtype)
        for key, value in metadata.state_dict_metadata.items()
        if isinstance(value, TensorStorageMetadata)
    }
