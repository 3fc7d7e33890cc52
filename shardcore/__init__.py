"""shardcore: pure layout logic for sharded tensors (no network, no threads).

Metadata value types with PyTorch's names, sharding specs, validation, region
math and routing, the reshard planner and its in-memory executor, and
conversions to and from torch, DCP, DTensor and the wire protocol.
"""

from shardserve.core.dtypes import (
    SUPPORTED_DTYPES,
    UnsupportedDTypeError,
    dtype_from_name,
    dtype_from_wire,
    dtype_name,
    dtype_to_wire,
    itemsize,
)
from shardserve.core.embedding import (
    OOV_POLICIES,
    POOLING_MODES,
    PartialBags,
    accumulation_dtype,
    bag_of_ids,
    bag_subset,
    combine_partials,
    dedup_ids,
    lookup_rows,
    partial_pool,
    pool_bags,
    restore_order,
    validate_ids,
)
from shardserve.core.executor import apply_plan, copy_box, pack_bucket, unpack_bucket
from shardserve.core.interop import (
    as_spec,
    boxes_from_dcp_storage_metadata,
    dtensor_layout,
    from_dcp_storage_metadata,
    metadata_from_dtensor,
    metadata_from_torch,
    metadata_to_torch,
    placements_from_torch,
    placements_to_torch,
    properties_from_torch,
    properties_to_torch,
    shard_metadata_from_torch,
    shard_metadata_to_torch,
    spec_from_torch,
    spec_to_torch,
    to_dcp_storage_metadata,
)
from shardserve.core.metadata import (
    Box,
    RemoteDevice,
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
    make_metadata,
)
from shardserve.core.placements import (
    Replicate,
    Shard,
    metadata_from_placements,
    parse_mesh,
    placement_string,
)
from shardserve.core.planner import (
    Bucket,
    RankPlan,
    ReshardPlan,
    Transfer,
    plan_reshard,
    plan_reshard_per_round,
    split_box,
)
from shardserve.core.regions import (
    assemble,
    check_box,
    cut_tensor,
    intersect,
    local_view,
    shards_for_box,
)
from shardserve.core.replicas import CandidateRank, replicate_layout
from shardserve.core.routing import RowIndex, RowRoute, route_rows, unique_ids
from shardserve.core.specs import (
    ChunkShardingSpec,
    EnumerableShardingSpec,
    chunk_bound,
    chunk_bounds,
)
from shardserve.core.validation import LayoutError, LayoutReport, validate_metadata
