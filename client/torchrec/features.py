"""A KeyedJaggedTensor cut into one request per table: every feature of a table put one after the other.

TorchRec lays a KJT out feature by feature (the ids of feature 0's B bags,
then feature 1's...). A table's request holds its features' bags in the
order of its config's feature_names: one slice of the KJT when they are
neighbours in that order, else the pieces joined. Answers come back as
[features * B, ...] per table and are split at multiples of B.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from shardserve.client.errors import InvalidArgumentError


@dataclass
class TableIds:
    """The ids of one table's features in a batch, feature after feature, with nn.EmbeddingBag offsets
    (include_last_offset=False, starting at 0) and the per-id weights when the batch carries them."""

    ids: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor | None
    lengths: list[torch.Tensor]  # per feature, its bags' lengths


def check_features(features: object) -> KeyedJaggedTensor:
    """`features` as a KJT of one batch size for every feature (variable batch per feature is not served)."""
    if not isinstance(features, KeyedJaggedTensor):
        raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
    if features.variable_stride_per_key():
        raise InvalidArgumentError(
            "features has a batch size per feature (variable stride); serve one batch size per call"
        )
    return features


def table_ids(
    features: KeyedJaggedTensor, names: Sequence[str], weighted: bool, index: dict[str, int]
) -> TableIds:
    """The ids of the features `names` (one table's), `index` being the KJT's {key: position}."""
    missing = [name for name in names if name not in index]
    if missing:
        raise InvalidArgumentError(
            f"features has no key {missing[0]!r}; its keys are {list(index)}"
        )
    stride = features.stride()
    values, offsets = features.values(), features.offsets()
    weights = features.weights() if weighted else None
    value_bounds = features.offset_per_key()
    positions = [index[name] for name in names]
    lengths = [features.lengths()[p * stride : (p + 1) * stride] for p in positions]
    if positions == list(range(positions[0], positions[0] + len(positions))):
        first, last = positions[0], positions[-1] + 1
        start, stop = value_bounds[first], value_bounds[last]
        return TableIds(
            values[start:stop],
            offsets[first * stride : last * stride] - start,
            None if weights is None else weights[start:stop],
            lengths,
        )
    pieces, bag_starts, base = [], [], 0
    for p in positions:
        start, stop = value_bounds[p], value_bounds[p + 1]
        pieces.append((start, stop))
        bag_starts.append(offsets[p * stride : (p + 1) * stride] - start + base)
        base += stop - start
    return TableIds(
        torch.cat([values[a:b] for a, b in pieces]),
        torch.cat(bag_starts),
        None if weights is None else torch.cat([weights[a:b] for a, b in pieces]),
        lengths,
    )


def key_index(features: KeyedJaggedTensor) -> dict[str, int]:
    """{key: position} of the KJT's keys."""
    return {key: position for position, key in enumerate(features.keys())}


def per_feature(answer: torch.Tensor, count: int, stride: int) -> list[torch.Tensor]:
    """One table's answer for `count` features of `stride` bags each, split per feature."""
    return [answer[f * stride : (f + 1) * stride] for f in range(count)]
