"""Which cluster tensor serves each TorchRec table: names under a prefix, uploads, snapshot keys, checks.

A table config (EmbeddingBagConfig / EmbeddingConfig) is served by one 2-D
tensor of the cluster of shape (num_embeddings, embedding_dim) and the
config's data type: PREFIX/TABLE for tables declared or uploaded here, or the
state-dict entry `...embedding_bags.TABLE.weight` (`...embeddings.TABLE.weight`
for an EmbeddingCollection) of a snapshot that `spmd.put_state_dict` wrote.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, DataType

from shardserve.client.cluster import Cluster
from shardserve.client.errors import InvalidArgumentError
from shardserve.client.packed_tensor import PackedTensor

DTYPES = {DataType.FP32: torch.float32, DataType.FP16: torch.float16}


@dataclass(frozen=True)
class RemoteTable:
    """One table config and the name of the cluster tensor that serves it."""

    config: BaseEmbeddingConfig
    name: str

    @property
    def features(self) -> list[str]:
        """The features looked up in this table (a config without any is looked up by its own name)."""
        return list(self.config.feature_names) or [self.config.name]


def table_name(prefix: str, table: str) -> str:
    """The cluster tensor of `table` declared or uploaded under `prefix`: PREFIX/TABLE (TABLE without one)."""
    return f"{prefix}/{table}" if prefix else table


def bind_tables(
    cluster: Cluster, configs: Sequence[BaseEmbeddingConfig], names: Mapping[str, str]
) -> list[RemoteTable]:
    """The configs bound to their cluster tensors `names[config.name]`, each checked to exist with the config's
    shape and dtype (InvalidArgumentError naming the table otherwise)."""
    if not configs:
        raise InvalidArgumentError("tables must hold at least one table config")
    seen: set[str] = set()
    bound = []
    for config in configs:
        if not isinstance(config, BaseEmbeddingConfig):
            raise TypeError(f"tables must hold TorchRec table configs, got {type(config).__name__}")
        if config.name in seen:
            raise InvalidArgumentError(f"table {config.name!r} is declared twice")
        seen.add(config.name)
        if config.data_type not in DTYPES:
            raise InvalidArgumentError(
                f"table {config.name!r} has data type {config.data_type.name}; "
                f"served tables are {sorted(t.name for t in DTYPES)}"
            )
        table = RemoteTable(config, names[config.name])
        _check_tensor(cluster, table)
        bound.append(table)
    return bound


def _check_tensor(cluster: Cluster, table: RemoteTable) -> None:
    view = cluster.lookups.views.view(table.name)
    config = table.config
    want = (config.num_embeddings, config.embedding_dim)
    size = tuple(view.summary.metadata.size)
    if size != want or view.dtype != DTYPES[config.data_type]:
        raise InvalidArgumentError(
            f"table {config.name!r} is served by {table.name!r}, a {view.dtype} tensor of size {size}; "
            f"its config wants {DTYPES[config.data_type]} of size {want}"
        )


def upload_tables(
    cluster: Cluster,
    weights: Mapping[str, torch.Tensor],
    prefix: str,
    *,
    spec: Any = None,
    replicas: int = 1,
    oov: str = "error",
    overwrite: bool = False,
) -> dict[str, str]:
    """Put every table's weight as PREFIX/TABLE; `spec` is one spec for all or {table: spec}. Returns
    {table: tensor name}."""
    names = {}
    for table, weight in weights.items():
        names[table] = table_name(prefix, table)
        table_spec = spec.get(table) if isinstance(spec, Mapping) else spec
        cluster.put(
            names[table],
            weight.detach(),
            spec=table_spec,
            replicas=replicas,
            oov=oov,
            overwrite=overwrite,
        )
    return names


def snapshot_names(
    cluster: Cluster,
    prefix: str,
    tables: Sequence[str],
    *,
    attribute: str,
    module: str | None = None,
    number: int | None = None,
) -> dict[str, str]:
    """{table: tensor name} of the tables' weights in snapshot `number` (None: the newest) of `prefix`: the key
    MODULE.ATTRIBUTE.TABLE.weight, or without `module` the one key ending in ATTRIBUTE.TABLE.weight."""
    snapshot = cluster.snapshot(prefix, number)
    keys = snapshot.keys()
    names = {}
    for table in tables:
        suffix = f"{attribute}.{table}.weight"
        if module is not None:
            found = [f"{module}.{suffix}" if module else suffix]
            found = [key for key in found if key in keys]
        else:
            found = [key for key in keys if key == suffix or key.endswith(f".{suffix}")]
        if len(found) != 1:
            where = f"{module}.{suffix}" if module else f"a key ending in {suffix!r}"
            raise InvalidArgumentError(
                f"snapshot {snapshot.number} of {prefix!r} holds {len(found)} tensors for table "
                f"{table!r} (looked for {where}; pass module= to pick one)"
                if found
                else f"snapshot {snapshot.number} of {prefix!r} has no tensor for table {table!r} "
                f"(looked for {where})"
            )
        stored = snapshot[found[0]]
        if isinstance(stored, PackedTensor):
            raise InvalidArgumentError(
                f"table {table!r} ({found[0]!r}) of snapshot {snapshot.number} of {prefix!r} is stored in "
                f"pack {stored.pack_key!r} (put with pack=True); tables are served from tensors of their "
                f"own: put the snapshot without pack"
            )
        names[table] = stored.name
    return names
