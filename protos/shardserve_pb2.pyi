from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    INT8: _ClassVar[DType]
    INT16: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT64: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    BOOL: _ClassVar[DType]
    COMPLEX64: _ClassVar[DType]
    COMPLEX128: _ClassVar[DType]

class OovPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OOV_ERROR: _ClassVar[OovPolicy]
    OOV_ZERO: _ClassVar[OovPolicy]
    OOV_DEFAULT: _ClassVar[OovPolicy]

class TensorState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TENSOR_STATE_UNSPECIFIED: _ClassVar[TensorState]
    PENDING: _ClassVar[TensorState]
    READY: _ClassVar[TensorState]

class CoordinatorRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[CoordinatorRole]
    ROLE_LEADER: _ClassVar[CoordinatorRole]
    ROLE_STANDBY: _ClassVar[CoordinatorRole]

class InitKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INIT_NONE: _ClassVar[InitKind]
    INIT_ZEROS: _ClassVar[InitKind]
    INIT_ONES: _ClassVar[InitKind]
    INIT_NORMAL: _ClassVar[InitKind]
    INIT_ARANGE: _ClassVar[InitKind]
    INIT_COPY: _ClassVar[InitKind]

class SnapshotView(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SNAPSHOT_VIEW_UNSPECIFIED: _ClassVar[SnapshotView]
    SNAPSHOT_VIEW_BASIC: _ClassVar[SnapshotView]
    SNAPSHOT_VIEW_FULL: _ClassVar[SnapshotView]

class ReshardPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESHARD_PHASE_UNSPECIFIED: _ClassVar[ReshardPhase]
    RESHARD_PREPARING: _ClassVar[ReshardPhase]
    RESHARD_MOVING: _ClassVar[ReshardPhase]
    RESHARD_COMMITTING: _ClassVar[ReshardPhase]
    RESHARD_DONE: _ClassVar[ReshardPhase]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT64: DType
FLOAT16: DType
BFLOAT16: DType
INT8: DType
INT16: DType
INT32: DType
INT64: DType
UINT8: DType
BOOL: DType
COMPLEX64: DType
COMPLEX128: DType
OOV_ERROR: OovPolicy
OOV_ZERO: OovPolicy
OOV_DEFAULT: OovPolicy
TENSOR_STATE_UNSPECIFIED: TensorState
PENDING: TensorState
READY: TensorState
ROLE_UNSPECIFIED: CoordinatorRole
ROLE_LEADER: CoordinatorRole
ROLE_STANDBY: CoordinatorRole
INIT_NONE: InitKind
INIT_ZEROS: InitKind
INIT_ONES: InitKind
INIT_NORMAL: InitKind
INIT_ARANGE: InitKind
INIT_COPY: InitKind
SNAPSHOT_VIEW_UNSPECIFIED: SnapshotView
SNAPSHOT_VIEW_BASIC: SnapshotView
SNAPSHOT_VIEW_FULL: SnapshotView
RESHARD_PHASE_UNSPECIFIED: ReshardPhase
RESHARD_PREPARING: ReshardPhase
RESHARD_MOVING: ReshardPhase
RESHARD_COMMITTING: ReshardPhase
RESHARD_DONE: ReshardPhase

class TensorProperties(_message.Message):
    __slots__ = ("dtype", "requires_grad", "layout", "memory_format", "pin_memory")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    REQUIRES_GRAD_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FORMAT_FIELD_NUMBER: _ClassVar[int]
    PIN_MEMORY_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    requires_grad: bool
    layout: str
    memory_format: str
    pin_memory: bool
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., requires_grad: _Optional[bool] = ..., layout: _Optional[str] = ..., memory_format: _Optional[str] = ..., pin_memory: _Optional[bool] = ...) -> None: ...

class ShardMetadata(_message.Message):
    __slots__ = ("shard_offsets", "shard_sizes", "placement")
    SHARD_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SHARD_SIZES_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    shard_offsets: _containers.RepeatedScalarFieldContainer[int]
    shard_sizes: _containers.RepeatedScalarFieldContainer[int]
    placement: str
    def __init__(self, shard_offsets: _Optional[_Iterable[int]] = ..., shard_sizes: _Optional[_Iterable[int]] = ..., placement: _Optional[str] = ...) -> None: ...

class ShardedTensorMetadata(_message.Message):
    __slots__ = ("shards_metadata", "size", "tensor_properties")
    SHARDS_METADATA_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    shards_metadata: _containers.RepeatedCompositeFieldContainer[ShardMetadata]
    size: _containers.RepeatedScalarFieldContainer[int]
    tensor_properties: TensorProperties
    def __init__(self, shards_metadata: _Optional[_Iterable[_Union[ShardMetadata, _Mapping]]] = ..., size: _Optional[_Iterable[int]] = ..., tensor_properties: _Optional[_Union[TensorProperties, _Mapping]] = ...) -> None: ...

class TensorOptions(_message.Message):
    __slots__ = ("oov", "default_row", "not_durable")
    OOV_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_ROW_FIELD_NUMBER: _ClassVar[int]
    NOT_DURABLE_FIELD_NUMBER: _ClassVar[int]
    oov: OovPolicy
    default_row: bytes
    not_durable: bool
    def __init__(self, oov: _Optional[_Union[OovPolicy, str]] = ..., default_row: _Optional[bytes] = ..., not_durable: _Optional[bool] = ...) -> None: ...

class RankInfo(_message.Message):
    __slots__ = ("rank", "address", "device", "hostname", "memory_limit_bytes", "memory_used_bytes", "alive", "last_heartbeat_unix", "world_size", "pid", "host_id", "shared_memory", "restarts", "metrics_address", "restore", "memory_limit_source")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_SOURCE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    address: str
    device: str
    hostname: str
    memory_limit_bytes: int
    memory_used_bytes: int
    alive: bool
    last_heartbeat_unix: float
    world_size: int
    pid: int
    host_id: str
    shared_memory: bool
    restarts: int
    metrics_address: str
    restore: RestoreProgress
    memory_limit_source: str
    def __init__(self, rank: _Optional[int] = ..., address: _Optional[str] = ..., device: _Optional[str] = ..., hostname: _Optional[str] = ..., memory_limit_bytes: _Optional[int] = ..., memory_used_bytes: _Optional[int] = ..., alive: _Optional[bool] = ..., last_heartbeat_unix: _Optional[float] = ..., world_size: _Optional[int] = ..., pid: _Optional[int] = ..., host_id: _Optional[str] = ..., shared_memory: _Optional[bool] = ..., restarts: _Optional[int] = ..., metrics_address: _Optional[str] = ..., restore: _Optional[_Union[RestoreProgress, _Mapping]] = ..., memory_limit_source: _Optional[str] = ...) -> None: ...

class RestoreProgress(_message.Message):
    __slots__ = ("rank", "pid", "done_bytes", "total_bytes", "done_tensors", "total_tensors", "loaded", "hostname")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DONE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DONE_TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TENSORS_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pid: int
    done_bytes: int
    total_bytes: int
    done_tensors: int
    total_tensors: int
    loaded: bool
    hostname: str
    def __init__(self, rank: _Optional[int] = ..., pid: _Optional[int] = ..., done_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., done_tensors: _Optional[int] = ..., total_tensors: _Optional[int] = ..., loaded: _Optional[bool] = ..., hostname: _Optional[str] = ...) -> None: ...

class ReportRestoreResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TensorInfo(_message.Message):
    __slots__ = ("name", "version", "metadata", "options", "state", "nbytes", "created_unix", "promoting", "put_token", "lost_shards", "unavailable_shards", "health", "replicas", "repair", "owner", "update_order", "shard_checksums", "writable", "layout")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    PROMOTING_FIELD_NUMBER: _ClassVar[int]
    PUT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOST_SHARDS_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_SHARDS_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    REPAIR_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ORDER_FIELD_NUMBER: _ClassVar[int]
    SHARD_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    WRITABLE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    metadata: ShardedTensorMetadata
    options: TensorOptions
    state: TensorState
    nbytes: int
    created_unix: float
    promoting: bool
    put_token: str
    lost_shards: _containers.RepeatedScalarFieldContainer[int]
    unavailable_shards: _containers.RepeatedScalarFieldContainer[int]
    health: str
    replicas: int
    repair: RepairState
    owner: str
    update_order: int
    shard_checksums: _containers.RepeatedScalarFieldContainer[int]
    writable: _containers.RepeatedCompositeFieldContainer[WritableShard]
    layout: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., metadata: _Optional[_Union[ShardedTensorMetadata, _Mapping]] = ..., options: _Optional[_Union[TensorOptions, _Mapping]] = ..., state: _Optional[_Union[TensorState, str]] = ..., nbytes: _Optional[int] = ..., created_unix: _Optional[float] = ..., promoting: _Optional[bool] = ..., put_token: _Optional[str] = ..., lost_shards: _Optional[_Iterable[int]] = ..., unavailable_shards: _Optional[_Iterable[int]] = ..., health: _Optional[str] = ..., replicas: _Optional[int] = ..., repair: _Optional[_Union[RepairState, _Mapping]] = ..., owner: _Optional[str] = ..., update_order: _Optional[int] = ..., shard_checksums: _Optional[_Iterable[int]] = ..., writable: _Optional[_Iterable[_Union[WritableShard, _Mapping]]] = ..., layout: _Optional[int] = ...) -> None: ...

class RepairState(_message.Message):
    __slots__ = ("version", "bytes_done", "bytes_total", "started_unix", "ranks")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    version: int
    bytes_done: int
    bytes_total: int
    started_unix: float
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., started_unix: _Optional[float] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class GetRoleRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RoleInfo(_message.Message):
    __slots__ = ("role", "address", "term", "leader_address", "leader_term", "lease_duration_s", "takeovers")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    LEADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEADER_TERM_FIELD_NUMBER: _ClassVar[int]
    LEASE_DURATION_S_FIELD_NUMBER: _ClassVar[int]
    TAKEOVERS_FIELD_NUMBER: _ClassVar[int]
    role: CoordinatorRole
    address: str
    term: int
    leader_address: str
    leader_term: int
    lease_duration_s: float
    takeovers: int
    def __init__(self, role: _Optional[_Union[CoordinatorRole, str]] = ..., address: _Optional[str] = ..., term: _Optional[int] = ..., leader_address: _Optional[str] = ..., leader_term: _Optional[int] = ..., lease_duration_s: _Optional[float] = ..., takeovers: _Optional[int] = ...) -> None: ...

class RegisterRankRequest(_message.Message):
    __slots__ = ("rank", "held")
    RANK_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    rank: RankInfo
    held: _containers.RepeatedCompositeFieldContainer[HeldVersion]
    def __init__(self, rank: _Optional[_Union[RankInfo, _Mapping]] = ..., held: _Optional[_Iterable[_Union[HeldVersion, _Mapping]]] = ...) -> None: ...

class HeldVersion(_message.Message):
    __slots__ = ("name", "version", "served")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    served: bool
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., served: _Optional[bool] = ...) -> None: ...

class RegisterRankResponse(_message.Message):
    __slots__ = ("heartbeat_interval_s", "store_host", "store_port")
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    store_host: str
    store_port: int
    def __init__(self, heartbeat_interval_s: _Optional[float] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("rank", "memory_used_bytes")
    RANK_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    memory_used_bytes: int
    def __init__(self, rank: _Optional[int] = ..., memory_used_bytes: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("heartbeat_interval_s",)
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    def __init__(self, heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class ListRanksRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRanksResponse(_message.Message):
    __slots__ = ("ranks", "collectives_error", "epoch", "metrics_address")
    RANKS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVES_ERROR_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedCompositeFieldContainer[RankInfo]
    collectives_error: str
    epoch: int
    metrics_address: str
    def __init__(self, ranks: _Optional[_Iterable[_Union[RankInfo, _Mapping]]] = ..., collectives_error: _Optional[str] = ..., epoch: _Optional[int] = ..., metrics_address: _Optional[str] = ...) -> None: ...

class CreateTensorRequest(_message.Message):
    __slots__ = ("name", "metadata", "init", "seed", "options", "overwrite", "source_version", "put_token", "writer_host_id", "reserve")
    NAME_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    INIT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PUT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    WRITER_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    name: str
    metadata: ShardedTensorMetadata
    init: InitKind
    seed: int
    options: TensorOptions
    overwrite: bool
    source_version: int
    put_token: str
    writer_host_id: str
    reserve: bool
    def __init__(self, name: _Optional[str] = ..., metadata: _Optional[_Union[ShardedTensorMetadata, _Mapping]] = ..., init: _Optional[_Union[InitKind, str]] = ..., seed: _Optional[int] = ..., options: _Optional[_Union[TensorOptions, _Mapping]] = ..., overwrite: _Optional[bool] = ..., source_version: _Optional[int] = ..., put_token: _Optional[str] = ..., writer_host_id: _Optional[str] = ..., reserve: _Optional[bool] = ...) -> None: ...

class CommitTensorRequest(_message.Message):
    __slots__ = ("name", "version", "written_in_place")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    written_in_place: bool
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., written_in_place: _Optional[bool] = ...) -> None: ...

class AbortTensorRequest(_message.Message):
    __slots__ = ("name", "version", "put_token")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PUT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    put_token: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., put_token: _Optional[str] = ...) -> None: ...

class AbortTensorResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class GetTensorRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListTensorsRequest(_message.Message):
    __slots__ = ("include_pending", "layouts_apart")
    INCLUDE_PENDING_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_APART_FIELD_NUMBER: _ClassVar[int]
    include_pending: bool
    layouts_apart: bool
    def __init__(self, include_pending: _Optional[bool] = ..., layouts_apart: _Optional[bool] = ...) -> None: ...

class ListTensorsResponse(_message.Message):
    __slots__ = ("tensors", "layouts")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    layouts: _containers.RepeatedCompositeFieldContainer[ShardedTensorMetadata]
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ..., layouts: _Optional[_Iterable[_Union[ShardedTensorMetadata, _Mapping]]] = ...) -> None: ...

class DeleteTensorRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteTensorResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SnapshotTensor(_message.Message):
    __slots__ = ("key", "metadata")
    KEY_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    key: str
    metadata: ShardedTensorMetadata
    def __init__(self, key: _Optional[str] = ..., metadata: _Optional[_Union[ShardedTensorMetadata, _Mapping]] = ...) -> None: ...

class CreateSnapshotRequest(_message.Message):
    __slots__ = ("prefix", "tensors", "keep", "skeleton", "not_durable", "writer_host_id", "delta_of")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    SKELETON_FIELD_NUMBER: _ClassVar[int]
    NOT_DURABLE_FIELD_NUMBER: _ClassVar[int]
    WRITER_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_OF_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    tensors: _containers.RepeatedCompositeFieldContainer[SnapshotTensor]
    keep: int
    skeleton: str
    not_durable: bool
    writer_host_id: str
    delta_of: int
    def __init__(self, prefix: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[SnapshotTensor, _Mapping]]] = ..., keep: _Optional[int] = ..., skeleton: _Optional[str] = ..., not_durable: _Optional[bool] = ..., writer_host_id: _Optional[str] = ..., delta_of: _Optional[int] = ...) -> None: ...

class SnapshotEntry(_message.Message):
    __slots__ = ("key", "tensor", "writable")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    WRITABLE_FIELD_NUMBER: _ClassVar[int]
    key: str
    tensor: TensorInfo
    writable: _containers.RepeatedCompositeFieldContainer[WritableShard]
    def __init__(self, key: _Optional[str] = ..., tensor: _Optional[_Union[TensorInfo, _Mapping]] = ..., writable: _Optional[_Iterable[_Union[WritableShard, _Mapping]]] = ...) -> None: ...

class SnapshotInfo(_message.Message):
    __slots__ = ("prefix", "number", "state", "created_unix", "nbytes", "keep", "entries", "skeleton", "delta_of", "shared_nbytes")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    SKELETON_FIELD_NUMBER: _ClassVar[int]
    DELTA_OF_FIELD_NUMBER: _ClassVar[int]
    SHARED_NBYTES_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    number: int
    state: TensorState
    created_unix: float
    nbytes: int
    keep: int
    entries: _containers.RepeatedCompositeFieldContainer[SnapshotEntry]
    skeleton: str
    delta_of: int
    shared_nbytes: int
    def __init__(self, prefix: _Optional[str] = ..., number: _Optional[int] = ..., state: _Optional[_Union[TensorState, str]] = ..., created_unix: _Optional[float] = ..., nbytes: _Optional[int] = ..., keep: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[SnapshotEntry, _Mapping]]] = ..., skeleton: _Optional[str] = ..., delta_of: _Optional[int] = ..., shared_nbytes: _Optional[int] = ...) -> None: ...

class CommitSnapshotRequest(_message.Message):
    __slots__ = ("prefix", "number", "view", "written_in_place", "skeleton", "reserve_next", "reserve_later")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    SKELETON_FIELD_NUMBER: _ClassVar[int]
    RESERVE_NEXT_FIELD_NUMBER: _ClassVar[int]
    RESERVE_LATER_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    number: int
    view: SnapshotView
    written_in_place: bool
    skeleton: str
    reserve_next: bool
    reserve_later: bool
    def __init__(self, prefix: _Optional[str] = ..., number: _Optional[int] = ..., view: _Optional[_Union[SnapshotView, str]] = ..., written_in_place: _Optional[bool] = ..., skeleton: _Optional[str] = ..., reserve_next: _Optional[bool] = ..., reserve_later: _Optional[bool] = ...) -> None: ...

class TakeReservedSnapshotRequest(_message.Message):
    __slots__ = ("prefix", "committed")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    committed: int
    def __init__(self, prefix: _Optional[str] = ..., committed: _Optional[int] = ...) -> None: ...

class CommitSnapshotResponse(_message.Message):
    __slots__ = ("committed", "next")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    committed: SnapshotInfo
    next: SnapshotInfo
    def __init__(self, committed: _Optional[_Union[SnapshotInfo, _Mapping]] = ..., next: _Optional[_Union[SnapshotInfo, _Mapping]] = ...) -> None: ...

class AbortSnapshotRequest(_message.Message):
    __slots__ = ("prefix", "number")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    number: int
    def __init__(self, prefix: _Optional[str] = ..., number: _Optional[int] = ...) -> None: ...

class AbortSnapshotResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetSnapshotRequest(_message.Message):
    __slots__ = ("prefix", "number")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    number: int
    def __init__(self, prefix: _Optional[str] = ..., number: _Optional[int] = ...) -> None: ...

class ListSnapshotsRequest(_message.Message):
    __slots__ = ("prefix",)
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    def __init__(self, prefix: _Optional[str] = ...) -> None: ...

class ListSnapshotsResponse(_message.Message):
    __slots__ = ("snapshots",)
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    snapshots: _containers.RepeatedCompositeFieldContainer[SnapshotInfo]
    def __init__(self, snapshots: _Optional[_Iterable[_Union[SnapshotInfo, _Mapping]]] = ...) -> None: ...

class ReshardRequest(_message.Message):
    __slots__ = ("name", "metadata", "bucket_bytes", "timeout_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    metadata: ShardedTensorMetadata
    bucket_bytes: int
    timeout_s: float
    def __init__(self, name: _Optional[str] = ..., metadata: _Optional[_Union[ShardedTensorMetadata, _Mapping]] = ..., bucket_bytes: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class ReshardProgress(_message.Message):
    __slots__ = ("phase", "bytes_done", "bytes_total", "version", "tensor", "max_new_shard_bytes", "max_staging_bytes", "mapped_bytes", "sent_bytes")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_SHARD_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_STAGING_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAPPED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    phase: ReshardPhase
    bytes_done: int
    bytes_total: int
    version: int
    tensor: TensorInfo
    max_new_shard_bytes: int
    max_staging_bytes: int
    mapped_bytes: int
    sent_bytes: int
    def __init__(self, phase: _Optional[_Union[ReshardPhase, str]] = ..., bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., version: _Optional[int] = ..., tensor: _Optional[_Union[TensorInfo, _Mapping]] = ..., max_new_shard_bytes: _Optional[int] = ..., max_staging_bytes: _Optional[int] = ..., mapped_bytes: _Optional[int] = ..., sent_bytes: _Optional[int] = ...) -> None: ...

class AllocateShardsRequest(_message.Message):
    __slots__ = ("name", "version", "metadata", "init", "seed", "options", "source_version", "reserve_only", "source_name")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    INIT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESERVE_ONLY_FIELD_NUMBER: _ClassVar[int]
    SOURCE_NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    metadata: ShardedTensorMetadata
    init: InitKind
    seed: int
    options: TensorOptions
    source_version: int
    reserve_only: bool
    source_name: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., metadata: _Optional[_Union[ShardedTensorMetadata, _Mapping]] = ..., init: _Optional[_Union[InitKind, str]] = ..., seed: _Optional[int] = ..., options: _Optional[_Union[TensorOptions, _Mapping]] = ..., source_version: _Optional[int] = ..., reserve_only: _Optional[bool] = ..., source_name: _Optional[str] = ...) -> None: ...

class AllocateShardsResponse(_message.Message):
    __slots__ = ("allocated_bytes",)
    ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    allocated_bytes: int
    def __init__(self, allocated_bytes: _Optional[int] = ...) -> None: ...

class PromoteVersionRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class ShardChecksum(_message.Message):
    __slots__ = ("name", "version", "shard_index", "checksum")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    shard_index: int
    checksum: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., shard_index: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class PromoteVersionResponse(_message.Message):
    __slots__ = ("checksums",)
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    checksums: _containers.RepeatedCompositeFieldContainer[ShardChecksum]
    def __init__(self, checksums: _Optional[_Iterable[_Union[ShardChecksum, _Mapping]]] = ...) -> None: ...

class DropVersionRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class DropVersionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AllocateManyRequest(_message.Message):
    __slots__ = ("tensors", "writer_host_id", "drop_first")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    WRITER_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DROP_FIRST_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[AllocateShardsRequest]
    writer_host_id: str
    drop_first: _containers.RepeatedCompositeFieldContainer[DropVersionRequest]
    def __init__(self, tensors: _Optional[_Iterable[_Union[AllocateShardsRequest, _Mapping]]] = ..., writer_host_id: _Optional[str] = ..., drop_first: _Optional[_Iterable[_Union[DropVersionRequest, _Mapping]]] = ...) -> None: ...

class AllocateManyResponse(_message.Message):
    __slots__ = ("allocated_bytes", "writable")
    ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITABLE_FIELD_NUMBER: _ClassVar[int]
    allocated_bytes: int
    writable: _containers.RepeatedCompositeFieldContainer[WritableShard]
    def __init__(self, allocated_bytes: _Optional[int] = ..., writable: _Optional[_Iterable[_Union[WritableShard, _Mapping]]] = ...) -> None: ...

class PromoteManyRequest(_message.Message):
    __slots__ = ("versions", "finish_in_place")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FINISH_IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[PromoteVersionRequest]
    finish_in_place: bool
    def __init__(self, versions: _Optional[_Iterable[_Union[PromoteVersionRequest, _Mapping]]] = ..., finish_in_place: _Optional[bool] = ...) -> None: ...

class PromoteManyResponse(_message.Message):
    __slots__ = ("checksums", "shared")
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    checksums: _containers.RepeatedCompositeFieldContainer[ShardChecksum]
    shared: _containers.RepeatedCompositeFieldContainer[SharedShardBytes]
    def __init__(self, checksums: _Optional[_Iterable[_Union[ShardChecksum, _Mapping]]] = ..., shared: _Optional[_Iterable[_Union[SharedShardBytes, _Mapping]]] = ...) -> None: ...

class SharedShardBytes(_message.Message):
    __slots__ = ("name", "version", "shard_index", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    shard_index: int
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., shard_index: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class DropManyRequest(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[DropVersionRequest]
    def __init__(self, versions: _Optional[_Iterable[_Union[DropVersionRequest, _Mapping]]] = ...) -> None: ...

class DropManyResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WriteShardRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: WriteShardHeader
    chunk: TensorChunk
    def __init__(self, header: _Optional[_Union[WriteShardHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class WriteShardHeader(_message.Message):
    __slots__ = ("name", "version", "shard_index", "dtype", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    shard_index: int
    dtype: DType
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., shard_index: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class WriteShardResponse(_message.Message):
    __slots__ = ("bytes_written",)
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    bytes_written: int
    def __init__(self, bytes_written: _Optional[int] = ...) -> None: ...

class WriteShardsRequest(_message.Message):
    __slots__ = ("shards", "data", "shared", "written_in_place")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[WriteShardHeader]
    data: bytes
    shared: SharedMemorySource
    written_in_place: bool
    def __init__(self, shards: _Optional[_Iterable[_Union[WriteShardHeader, _Mapping]]] = ..., data: _Optional[bytes] = ..., shared: _Optional[_Union[SharedMemorySource, _Mapping]] = ..., written_in_place: _Optional[bool] = ...) -> None: ...

class SharedMemorySource(_message.Message):
    __slots__ = ("pid", "fd", "inode", "device_id", "nbytes", "host_id", "name_secret")
    PID_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    INODE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_SECRET_FIELD_NUMBER: _ClassVar[int]
    pid: int
    fd: int
    inode: int
    device_id: int
    nbytes: int
    host_id: str
    name_secret: str
    def __init__(self, pid: _Optional[int] = ..., fd: _Optional[int] = ..., inode: _Optional[int] = ..., device_id: _Optional[int] = ..., nbytes: _Optional[int] = ..., host_id: _Optional[str] = ..., name_secret: _Optional[str] = ...) -> None: ...

class WriteShardsResponse(_message.Message):
    __slots__ = ("bytes_written",)
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    bytes_written: int
    def __init__(self, bytes_written: _Optional[int] = ...) -> None: ...

class OpenShardsForWriteRequest(_message.Message):
    __slots__ = ("shards", "host_id", "cuda_ipc", "fresh")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    FRESH_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[WriteShardHeader]
    host_id: str
    cuda_ipc: bool
    fresh: bool
    def __init__(self, shards: _Optional[_Iterable[_Union[WriteShardHeader, _Mapping]]] = ..., host_id: _Optional[str] = ..., cuda_ipc: _Optional[bool] = ..., fresh: _Optional[bool] = ...) -> None: ...

class WritableSegment(_message.Message):
    __slots__ = ("pid", "fd", "inode", "device_id", "data_offset", "nbytes", "sealed", "cuda")
    PID_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    INODE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    pid: int
    fd: int
    inode: int
    device_id: int
    data_offset: int
    nbytes: int
    sealed: bool
    cuda: CudaIpcHandle
    def __init__(self, pid: _Optional[int] = ..., fd: _Optional[int] = ..., inode: _Optional[int] = ..., device_id: _Optional[int] = ..., data_offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., sealed: _Optional[bool] = ..., cuda: _Optional[_Union[CudaIpcHandle, _Mapping]] = ...) -> None: ...

class OpenShardsForWriteResponse(_message.Message):
    __slots__ = ("segments",)
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    segments: _containers.RepeatedCompositeFieldContainer[WritableSegment]
    def __init__(self, segments: _Optional[_Iterable[_Union[WritableSegment, _Mapping]]] = ...) -> None: ...

class WritableShard(_message.Message):
    __slots__ = ("name", "version", "shard_index", "segment")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    shard_index: int
    segment: WritableSegment
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., shard_index: _Optional[int] = ..., segment: _Optional[_Union[WritableSegment, _Mapping]] = ...) -> None: ...

class ReadRegionRequest(_message.Message):
    __slots__ = ("name", "version", "shard_index", "offsets", "sizes", "chunk_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    shard_index: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    chunk_bytes: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., shard_index: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., sizes: _Optional[_Iterable[int]] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class ReadRegionsRequest(_message.Message):
    __slots__ = ("regions",)
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.RepeatedCompositeFieldContainer[ReadRegionRequest]
    def __init__(self, regions: _Optional[_Iterable[_Union[ReadRegionRequest, _Mapping]]] = ...) -> None: ...

class ReadRegionsReply(_message.Message):
    __slots__ = ("data", "offsets")
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, data: _Optional[bytes] = ..., offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("rank", "memory_used_bytes", "memory_limit_bytes", "held", "memory_limit_source")
    RANK_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_SOURCE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    memory_used_bytes: int
    memory_limit_bytes: int
    held: _containers.RepeatedCompositeFieldContainer[HeldVersion]
    memory_limit_source: str
    def __init__(self, rank: _Optional[int] = ..., memory_used_bytes: _Optional[int] = ..., memory_limit_bytes: _Optional[int] = ..., held: _Optional[_Iterable[_Union[HeldVersion, _Mapping]]] = ..., memory_limit_source: _Optional[str] = ...) -> None: ...

class LookupItem(_message.Message):
    __slots__ = ("name", "version", "shard_index", "ids", "pooled", "offsets", "per_sample_weights")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    PER_SAMPLE_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    shard_index: int
    ids: bytes
    pooled: bool
    offsets: bytes
    per_sample_weights: bytes
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., shard_index: _Optional[int] = ..., ids: _Optional[bytes] = ..., pooled: _Optional[bool] = ..., offsets: _Optional[bytes] = ..., per_sample_weights: _Optional[bytes] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("items", "chunk_bytes")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[LookupItem]
    chunk_bytes: int
    def __init__(self, items: _Optional[_Iterable[_Union[LookupItem, _Mapping]]] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class LookupChunk(_message.Message):
    __slots__ = ("item", "version", "dtype", "nbytes", "counts", "offset", "data")
    ITEM_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    item: int
    version: int
    dtype: DType
    nbytes: int
    counts: bytes
    offset: int
    data: bytes
    def __init__(self, item: _Optional[int] = ..., version: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., nbytes: _Optional[int] = ..., counts: _Optional[bytes] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[LookupChunk]
    def __init__(self, items: _Optional[_Iterable[_Union[LookupChunk, _Mapping]]] = ...) -> None: ...

class WriteRowsRequest(_message.Message):
    __slots__ = ("name", "version", "shard_index", "ids", "values")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    shard_index: int
    ids: bytes
    values: bytes
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., shard_index: _Optional[int] = ..., ids: _Optional[bytes] = ..., values: _Optional[bytes] = ...) -> None: ...

class WriteRowsResponse(_message.Message):
    __slots__ = ("rows_written",)
    ROWS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    rows_written: int
    def __init__(self, rows_written: _Optional[int] = ...) -> None: ...

class WriteBytesRequest(_message.Message):
    __slots__ = ("name", "version", "shard_index", "starts", "lengths", "data", "shared")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    STARTS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    shard_index: int
    starts: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    shared: SharedMemorySource
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., shard_index: _Optional[int] = ..., starts: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., shared: _Optional[_Union[SharedMemorySource, _Mapping]] = ...) -> None: ...

class WriteBytesResponse(_message.Message):
    __slots__ = ("bytes_written",)
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    bytes_written: int
    def __init__(self, bytes_written: _Optional[int] = ...) -> None: ...

class CollectiveJob(_message.Message):
    __slots__ = ("seq", "after_seq", "ranks", "timeout_s", "epoch", "reshard", "checkpoint_load", "checkpoint_save")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESHARD_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_LOAD_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SAVE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    after_seq: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    timeout_s: float
    epoch: int
    reshard: ReshardJob
    checkpoint_load: CheckpointJob
    checkpoint_save: CheckpointJob
    def __init__(self, seq: _Optional[int] = ..., after_seq: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ..., timeout_s: _Optional[float] = ..., epoch: _Optional[int] = ..., reshard: _Optional[_Union[ReshardJob, _Mapping]] = ..., checkpoint_load: _Optional[_Union[CheckpointJob, _Mapping]] = ..., checkpoint_save: _Optional[_Union[CheckpointJob, _Mapping]] = ...) -> None: ...

class ReshardJob(_message.Message):
    __slots__ = ("name", "src_version", "src", "dst_version", "dst", "bucket_bytes", "src_unavailable")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SRC_VERSION_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_VERSION_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SRC_UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    src_version: int
    src: ShardedTensorMetadata
    dst_version: int
    dst: ShardedTensorMetadata
    bucket_bytes: int
    src_unavailable: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., src_version: _Optional[int] = ..., src: _Optional[_Union[ShardedTensorMetadata, _Mapping]] = ..., dst_version: _Optional[int] = ..., dst: _Optional[_Union[ShardedTensorMetadata, _Mapping]] = ..., bucket_bytes: _Optional[int] = ..., src_unavailable: _Optional[_Iterable[int]] = ...) -> None: ...

class CollectiveProgress(_message.Message):
    __slots__ = ("bytes_done", "bytes_total", "done", "error", "failed_peers", "new_shard_bytes", "peak_staging_bytes", "started", "mapped_bytes", "sent_bytes")
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FAILED_PEERS_FIELD_NUMBER: _ClassVar[int]
    NEW_SHARD_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_STAGING_BYTES_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    MAPPED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes_done: int
    bytes_total: int
    done: bool
    error: str
    failed_peers: _containers.RepeatedScalarFieldContainer[int]
    new_shard_bytes: int
    peak_staging_bytes: int
    started: bool
    mapped_bytes: int
    sent_bytes: int
    def __init__(self, bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., done: _Optional[bool] = ..., error: _Optional[str] = ..., failed_peers: _Optional[_Iterable[int]] = ..., new_shard_bytes: _Optional[int] = ..., peak_staging_bytes: _Optional[int] = ..., started: _Optional[bool] = ..., mapped_bytes: _Optional[int] = ..., sent_bytes: _Optional[int] = ...) -> None: ...

class CancelCollectiveRequest(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class CancelCollectiveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointTensor(_message.Message):
    __slots__ = ("name", "version", "metadata")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    metadata: ShardedTensorMetadata
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., metadata: _Optional[_Union[ShardedTensorMetadata, _Mapping]] = ...) -> None: ...

class CheckpointJob(_message.Message):
    __slots__ = ("path", "tensors")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    path: str
    tensors: _containers.RepeatedCompositeFieldContainer[CheckpointTensor]
    def __init__(self, path: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[CheckpointTensor, _Mapping]]] = ...) -> None: ...

class InspectCheckpointRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class CheckpointEntry(_message.Message):
    __slots__ = ("name", "size", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    def __init__(self, name: _Optional[str] = ..., size: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class InspectCheckpointResponse(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[CheckpointEntry]
    def __init__(self, tensors: _Optional[_Iterable[_Union[CheckpointEntry, _Mapping]]] = ...) -> None: ...

class LoadCheckpointRequest(_message.Message):
    __slots__ = ("path", "tensors", "overwrite", "timeout_s")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    path: str
    tensors: _containers.RepeatedCompositeFieldContainer[CheckpointTensor]
    overwrite: bool
    timeout_s: float
    def __init__(self, path: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[CheckpointTensor, _Mapping]]] = ..., overwrite: _Optional[bool] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("path", "names", "timeout_s")
    PATH_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    path: str
    names: _containers.RepeatedScalarFieldContainer[str]
    timeout_s: float
    def __init__(self, path: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class CheckpointProgress(_message.Message):
    __slots__ = ("bytes_done", "bytes_total", "done", "tensors")
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    bytes_done: int
    bytes_total: int
    done: bool
    tensors: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    def __init__(self, bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., done: _Optional[bool] = ..., tensors: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ...) -> None: ...

class OpenShardRequest(_message.Message):
    __slots__ = ("name", "version", "shard_index", "lease_s", "cached_inode", "cuda_ipc", "header_slots")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    CACHED_INODE_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    HEADER_SLOTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    shard_index: int
    lease_s: float
    cached_inode: int
    cuda_ipc: bool
    header_slots: bool
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., shard_index: _Optional[int] = ..., lease_s: _Optional[float] = ..., cached_inode: _Optional[int] = ..., cuda_ipc: _Optional[bool] = ..., header_slots: _Optional[bool] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "tensor_offset")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    TENSOR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    tensor_offset: int
    def __init__(self, device: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., tensor_offset: _Optional[int] = ...) -> None: ...

class OpenShardResponse(_message.Message):
    __slots__ = ("pid", "fd", "inode", "device_id", "nbytes", "dtype", "shard_sizes", "lease_id", "lease_expires_s", "version", "cuda", "data_offset", "max_request_bytes", "extents", "header_offset")
    PID_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    INODE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHARD_SIZES_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_S_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    DATA_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXTENTS_FIELD_NUMBER: _ClassVar[int]
    HEADER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    pid: int
    fd: int
    inode: int
    device_id: int
    nbytes: int
    dtype: DType
    shard_sizes: _containers.RepeatedScalarFieldContainer[int]
    lease_id: int
    lease_expires_s: float
    version: int
    cuda: CudaIpcHandle
    data_offset: int
    max_request_bytes: int
    extents: _containers.RepeatedCompositeFieldContainer[ShardExtent]
    header_offset: int
    def __init__(self, pid: _Optional[int] = ..., fd: _Optional[int] = ..., inode: _Optional[int] = ..., device_id: _Optional[int] = ..., nbytes: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., shard_sizes: _Optional[_Iterable[int]] = ..., lease_id: _Optional[int] = ..., lease_expires_s: _Optional[float] = ..., version: _Optional[int] = ..., cuda: _Optional[_Union[CudaIpcHandle, _Mapping]] = ..., data_offset: _Optional[int] = ..., max_request_bytes: _Optional[int] = ..., extents: _Optional[_Iterable[_Union[ShardExtent, _Mapping]]] = ..., header_offset: _Optional[int] = ...) -> None: ...

class ShardExtent(_message.Message):
    __slots__ = ("fd", "inode", "device_id", "offset", "nbytes")
    FD_FIELD_NUMBER: _ClassVar[int]
    INODE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    fd: int
    inode: int
    device_id: int
    offset: int
    nbytes: int
    def __init__(self, fd: _Optional[int] = ..., inode: _Optional[int] = ..., device_id: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class BulkSessionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BulkSession(_message.Message):
    __slots__ = ("port", "ticket", "expires_s", "tls")
    PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_S_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    port: int
    ticket: bytes
    expires_s: float
    tls: bool
    def __init__(self, port: _Optional[int] = ..., ticket: _Optional[bytes] = ..., expires_s: _Optional[float] = ..., tls: _Optional[bool] = ...) -> None: ...

class OpenShardsRequest(_message.Message):
    __slots__ = ("shards",)
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[OpenShardRequest]
    def __init__(self, shards: _Optional[_Iterable[_Union[OpenShardRequest, _Mapping]]] = ...) -> None: ...

class OpenShardsResponse(_message.Message):
    __slots__ = ("shards",)
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[OpenShardResponse]
    def __init__(self, shards: _Optional[_Iterable[_Union[OpenShardResponse, _Mapping]]] = ...) -> None: ...

class ReleaseShardRequest(_message.Message):
    __slots__ = ("lease_ids",)
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseShardResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...
