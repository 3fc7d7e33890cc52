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
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"}),
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
        if name in _ALLOWED.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                   torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointMetadataError(f"it names {module}.{name}, which DCP metadata never holds")


def load_metadata(stream: IO[bytes], where: str | os.PathLike) -> Metadata:
    """The DCP Metadata pickled in `stream` (the `.metadata` of checkpoint `where`), allow-listed classes only."""
    try:
        metadata = _MetadataUnpickler(stream).load()
    except CheckpointMetadataError as err:
        raise CheckpointMetadataError(f"{where}/.metadata is not DCP metadata: {err}") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError) as err:
        raise CheckpointMetadataError(f"{where}/.metadata is not DCP metadata: {type(err).__name__}: {err}") \
            from None
    if not isinstance(metadata, Metadata):
        raise CheckpointMetadataError(f"{where}/.metadata holds a {type(metadata).__name__}, not DCP Metadata")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata
