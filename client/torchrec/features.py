"""A KeyedJaggedTensor cut into one request per table: every feature of a table put one after the other.

TorchRec lays a KJT out feature by feature (the ids of feature 0's B bags,
then feature 1's...). The KJT's ids, offsets and weights are made plain and
checked once per forward (FeatureBatch); a table's request then holds its
features' bags in the order of its config's feature_names: one slice of them
when they are neighbours in that order, else the pieces joined. Answers come
back as [features * B, ...] per table and are split at multiples of B.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from shardserve.client.arguments import dense_tensor
from shardserve.client.embedding.ids import as_ids
from shardserve.client.errors import InvalidArgumentError


@dataclass
class TableIds:
    """The ids of one table's features in a batch, feature after feature, with nn.EmbeddingBag offsets
    (include_last_offset=False, starting at 0) and the per-id weights when the batch carries them."""

    ids: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor | None
    positions: list[int]  # the features' positions among the KJT's keys


def check_features(features: object) -> KeyedJaggedTensor:
    """`features` as a KJT of one batch size for every feature (variable batch per feature is not served)."""
    if not isinstance(features, KeyedJaggedTensor):
        raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
    if features.variable_stride_per_key():
        raise InvalidArgumentError(
            "features has a batch size per feature (variable stride); serve one batch size per call"
        )
    return features


class FeatureBatch:
    """One KJT's ids (1-D int64), bag offsets (checked once for all its features) and weights, cut per table."""

    def __init__(self, features: KeyedJaggedTensor, *, weighted: bool) -> None:
        self.features = check_features(features)
        self.index = {key: position for position, key in enumerate(features.keys())}
        self.stride = features.stride()
        self.values = as_ids(features.values(), "features.values()")
        self.offsets = as_ids(features.offsets(), "features.offsets()")
        self.weights = _checked_weights(features.weights(), self.values) if weighted else None
        self.bounds = _key_bounds(self.offsets, self.values.numel(), len(self.index), self.stride)

    def positions(self, names: Sequence[str]) -> list[int]:
        """The positions of features `names` among the KJT's keys (InvalidArgumentError for a missing one)."""
        try:
            return [self.index[name] for name in names]
        except KeyError as err:
            raise InvalidArgumentError(
                f"features has no key {err.args[0]!r}; its keys are {list(self.index)}"
            ) from None

    def table(self, names: Sequence[str]) -> TableIds:
        """The ids of the features `names` (one table's), feature after feature."""
        positions = self.positions(names)
        stride, bounds, offsets = self.stride, self.bounds, self.offsets
        first, last = positions[0], positions[-1] + 1
        if positions == list(range(first, last)):
            start, stop = bounds[first], bounds[last]
            return TableIds(
                self.values[start:stop],
                offsets[first * stride : last * stride] - start,
                None if self.weights is None else self.weights[start:stop],
                positions,
            )
        spans = [(bounds[p], bounds[p + 1]) for p in positions]
        bag_starts, base = [], 0
        for p, (start, stop) in zip(positions, spans):
            bag_starts.append(offsets[p * stride : (p + 1) * stride] - (start - base))
            base += stop - start
        return TableIds(
            torch.cat([self.values[a:b] for a, b in spans]),
            torch.cat(bag_starts),
            None if self.weights is None else torch.cat([self.weights[a:b] for a, b in spans]),
            positions,
        )

    def lengths(self, position: int) -> torch.Tensor:
        """The bag lengths of the feature at `position`."""
        return self.features.lengths()[position * self.stride : (position + 1) * self.stride]


def _key_bounds(offsets: torch.Tensor, num_ids: int, num_keys: int, stride: int) -> list[int]:
    """Where each key's ids start in the KJT's values (and where the last ends), its offsets checked to cut
    the `num_ids` ids into num_keys * stride bags, from 0 to num_ids and non-decreasing (InvalidArgumentError
    otherwise)."""
    if offsets.numel() != num_keys * stride + 1:
        raise InvalidArgumentError(
            f"features.offsets() has {offsets.numel()} entries; {num_keys} keys of {stride} bags "
            f"need {num_keys * stride + 1}"
        )
    bounds = offsets[::stride].tolist() if stride else [0] * (num_keys + 1)
    steps = offsets.numpy()
    if bounds[0] != 0 or bounds[-1] != num_ids or bool((steps[1:] < steps[:-1]).any()):
        raise InvalidArgumentError(
            f"features.offsets() must run from 0 to len(values())={num_ids}, non-decreasing "
            f"(lengths >= 0)"
        )
    return bounds


def _checked_weights(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The KJT's per-id weights, one per id as nn.EmbeddingBag wants per_sample_weights, on the CPU."""
    dense_tensor(weights, "features.weights()")
    if weights.shape != values.shape:
        raise InvalidArgumentError(
            f"features.weights() must have shape {tuple(values.shape)} (one weight per id), "
            f"got {tuple(weights.shape)}"
        )
    return weights.detach().cpu().contiguous()


def per_feature(answer: torch.Tensor, count: int, stride: int) -> list[torch.Tensor]:
    """One table's answer for `count` features of `stride` bags each, split per feature."""
    return [answer[f * stride : (f + 1) * stride] for f in range(count)]
