"""Checks of request fields shared by both servicers; each error names its field."""

from __future__ import annotations

import torch

from shardserve.core.dtypes import dtype_from_wire, dtype_name
from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.validation import validate_metadata
from shardserve.core.wire import decoded_once, metadata_from_proto
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.common.errors import InvalidArgument

# The rule for tensor and snapshot names (docs/operations.md#names): 1 to MAX_NAME_BYTES bytes of UTF-8, all
# printable. Names are data: they reach the filesystem only through server.common.names.file_name.
MAX_NAME_BYTES = 1024
NAME_RULE = f"names hold 1 to {MAX_NAME_BYTES} bytes of UTF-8, printable characters only"


# the enums' numbers, made once: EnumTypeWrapper.values() builds a list at every call (every allocation checks)
_OOV_POLICIES = frozenset(pb.OovPolicy.values())
_INIT_KINDS = frozenset(pb.InitKind.values())


def check_name(name: str, field: str = "name") -> str:
    """A tensor (or snapshot prefix) name that keeps the name rule; INVALID_ARGUMENT naming the rule else."""
    if not name:
        raise InvalidArgument(f"{field} is empty ({NAME_RULE})", metadata={"field": field})
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > MAX_NAME_BYTES:
        raise InvalidArgument(
            f"{field} is {size} bytes of UTF-8; the limit is {MAX_NAME_BYTES} ({NAME_RULE})",
            metadata={"field": field},
        )
    if not name.isprintable():
        raise InvalidArgument(
            f"{field} {name[:80]!r} contains non-printable characters ({NAME_RULE})",
            metadata={"field": field},
        )
    return name


MAX_DIMS = 64  # far beyond any real layout; validation work grows with dims x shards
MAX_SHARDS = 1 << 16
MAX_PUT_TOKEN_LENGTH = 128
MAX_VERSION = 1 << 63


def check_put_token(token: str, field: str = "put_token") -> str:
    """A client's put token: empty (none) or up to 128 printable ASCII characters."""
    if len(token) > MAX_PUT_TOKEN_LENGTH:
        raise InvalidArgument(
            f"{field} is {len(token)} characters long; the limit is {MAX_PUT_TOKEN_LENGTH}",
            metadata={"field": field},
        )
    if not (token.isascii() and token.isprintable()):
        raise InvalidArgument(
            f"{field} {token!r} must be printable ASCII", metadata={"field": field}
        )
    return token


def check_version(version: int, field: str = "version", allow_zero: bool = False) -> int:
    """A version number: > 0 (or 0 when the RPC gives 0 a meaning), and below 2**63 (the catalog's integers)."""
    if version == 0 and not allow_zero:
        raise InvalidArgument(f"{field} must be > 0", metadata={"field": field})
    if version >= MAX_VERSION:
        raise InvalidArgument(
            f"{field} {version} is out of range (versions are below 2**63)",
            metadata={"field": field},
        )
    return version


def parse_metadata(msg: pb.ShardedTensorMetadata, field: str = "metadata") -> ShardedTensorMetadata:
    """Wire metadata as a validated shardcore layout; InvalidArgument names the bad part."""
    if (
        len(msg.size) > MAX_DIMS
    ):  # checked before any work: validation costs grow with dims x shards
        raise InvalidArgument(f"{field}.size has {len(msg.size)} dims; the limit is {MAX_DIMS}")
    if len(msg.shards_metadata) > MAX_SHARDS:
        raise InvalidArgument(
            f"{field}.shards_metadata has {len(msg.shards_metadata)} shards; the limit is "
            f"{MAX_SHARDS}"
        )
    try:
        return decoded_once(_valid_layout, msg)
    except (ValueError, TypeError) as err:
        raise InvalidArgument(f"{field}: {err}", metadata={"field": field}) from None


def _valid_layout(msg: pb.ShardedTensorMetadata) -> ShardedTensorMetadata:
    meta = metadata_from_proto(msg)
    if meta.nbytes >= 1 << 63:
        raise ValueError(f"size {list(meta.size)} of {meta.dtype} is 2**63 bytes or more")
    if not meta.shards_metadata:
        raise ValueError("shards_metadata is empty")
    for i, shard in enumerate(meta.shards_metadata):
        if shard.placement is None:
            raise ValueError(f"shards_metadata[{i}].placement is empty")
    validate_metadata(meta)
    return meta


def check_options(options: pb.TensorOptions, meta: ShardedTensorMetadata) -> None:
    """A table's options: a known OovPolicy, and a default_row of one row's bytes exactly when OOV_DEFAULT."""
    if options.oov not in _OOV_POLICIES:
        raise InvalidArgument(f"options.oov {options.oov} is not a known OovPolicy")
    if options.oov == pb.OOV_DEFAULT:
        if meta.ndim != 2:
            raise InvalidArgument("options.oov OOV_DEFAULT needs a 2-D table")
        row_bytes = meta.size[1] * meta.tensor_properties.itemsize
        if len(options.default_row) != row_bytes:
            raise InvalidArgument(
                f"options.default_row has {len(options.default_row)} bytes; one row of "
                f"this table is {row_bytes} bytes"
            )
    elif options.default_row:
        raise InvalidArgument("options.default_row is set but options.oov is not OOV_DEFAULT")


def parse_dtype(number: int, field: str) -> torch.dtype:
    """Torch dtype of a wire DType value."""
    try:
        return dtype_from_wire(number)
    except ValueError as err:
        raise InvalidArgument(f"{field}: {err}", metadata={"field": field}) from None


def check_init(init: int, dtype: torch.dtype) -> None:
    """Raise InvalidArgument naming `init` when it cannot fill a tensor of `dtype`."""
    if init not in _INIT_KINDS:
        raise InvalidArgument(f"init {init} is not a known InitKind")
    if init == pb.INIT_NORMAL and not (dtype.is_floating_point or dtype.is_complex):
        raise InvalidArgument(
            f"init INIT_NORMAL needs a floating or complex dtype, not {dtype_name(dtype)}"
        )
